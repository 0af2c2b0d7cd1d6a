"""Run real megatron-core 0.16 ``GPTModel``s on a CPU-only torch (gloo, no TE/Apex).

Used by ``test_megatron_truth.py`` inside spawned worker processes only:
:func:`apply_cpu_patches` rewrites a few ``torch.cuda`` entry points globally, so it
must never run in the pytest process itself.

Also holds the test's *independent* statement of Megatron's global (sharded-key)
tensors in terms of HF checkpoint tensors (:func:`megatron_global`), written from
megatron-core's sources (``attention.py`` QKV grouping, ``mlp.py`` SwiGLU factory,
``experts.py`` expert axis), not from the layout provider.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nemo_refit_reshard.layouts.base import LocalTensor
from nemo_refit_reshard.spec.config import ArchConfig
from nemo_refit_reshard.spec.model import ModelSpec
from nemo_refit_reshard.spec.parallel import TrainParallel

_PATCHED = False


def apply_cpu_patches() -> None:
    """Monkeypatch torch/megatron so that build, ``sharded_state_dict`` and forward run on CPU.

    Each patch was shown to be needed by switching it off (see /tmp/notes_megatron.md).
    """
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    # P1: ``model_parallel_cuda_manual_seed`` -> ``CudaRNGStatesTracker.add`` reads
    # ``torch.cuda.get_rng_state()`` ("Torch not compiled with CUDA enabled"), and
    # ``DotProductAttention.forward`` forks the tracker (even with dropout 0), which calls
    # ``random._get/_set_cuda_rng_state``. Map them all onto the CPU default generator.
    def get_state(*_a: Any, **_k: Any) -> Tensor:
        return torch.get_rng_state()

    def set_state(state: Tensor, *_a: Any, **_k: Any) -> None:
        torch.set_rng_state(state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = get_state
    torch.cuda.manual_seed = torch.manual_seed

    # P2: ``device=torch.cuda.current_device()`` allocates rotary ``inv_freq``, the TP
    # all-gather buffers (tensor_parallel/mappings.py) and the MoE router's casts; "cpu"
    # turns them into CPU allocations (otherwise: AssertionError, no CUDA).
    torch.cuda.current_device = lambda: "cpu"

    # P3: ``LanguageModule.setup_embeddings_and_output_layer`` does
    # ``weight.data = weight.data.cuda()`` before all-reducing the tied word embedding
    # over the embedding group (pp > 1 with share_embeddings_and_output_weights).
    torch.Tensor.cuda = lambda self, *_a, **_k: self

    # P5: megatron-core 0.16.1 imports ``te_general_gemm`` only inside ``try: import
    # transformer_engine`` but the router forward tests ``te_general_gemm is not None``
    # unconditionally: NameError in every MoE forward without TE.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # (P4, the alltoall dispatcher's CUDA streams, is not needed: we use "allgather".)
    _PATCHED = True


def rope_theta(hf: dict[str, Any]) -> float:
    """transformers 5 keeps ``rope_theta`` in ``rope_parameters``; 4.x at the top level."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)


def transformer_config(hf: dict[str, Any], arch: ArchConfig, par: TrainParallel, first: int | None):
    """The ``TransformerConfig`` of the HF model ``hf`` under ``par`` (float32, CPU-safe)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,  # explicit: Qwen3's head_dim != hidden / heads
        ffn_hidden_size=arch.intermediate_size,
        gated_linear_unit=True,  # SwiGLU: linear_fc1 = [gate; up]
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=first,
        # Every rank builds the full master weight on the CPU and keeps its slice; without
        # this, weights are allocated on current_device() and initialised by the CUDA RNG.
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # CUDA-only fused kernels (all default off in 0.16; pinned here on purpose).
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    if arch.moe is not None:
        kw.update(
            num_moe_experts=arch.moe.num_experts,
            moe_ffn_hidden_size=arch.moe.expert_intermediate_size,
            moe_router_topk=int(hf["num_experts_per_tok"]),
            moe_layer_freq=[int(arch.is_sparse(i)) for i in range(arch.num_layers)],
            expert_model_parallel_size=par.ep,
            expert_tensor_parallel_size=par.expert_tp,
            moe_grouped_gemm=False,  # SequentialMLP: local_experts.{j}.linear_fc{1,2}
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            # HF Qwen3-MoE: softmax over all experts, top-k, renormalise iff norm_topk_prob.
            # Megatron default (top-k of logits, softmax over the k) == renormalised;
            # pre-softmax (softmax, then top-k, no renormalisation) == not renormalised.
            moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        )
    return TransformerConfig(**kw)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM ``_vocab_size_with_padding`` (training code, not in megatron-core):
    round up to a multiple of ``make_vocab_size_divisible_by · tp``."""
    multiple = divisible_by * tp
    return (vocab + multiple - 1) // multiple * multiple


def build_gpt(
    hf: dict[str, Any], spec: ModelSpec, par: TrainParallel, padded_vocab: int, **kw: Any
) -> list[torch.nn.Module]:
    """This rank's ``GPTModel`` chunk(s) (one per virtual pipeline stage), in eval mode."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    arch = spec.arch
    cfg = transformer_config(hf, arch, par, kw.get("first"))
    chunks = []
    for vp in range(par.vpp) if par.vpp > 1 else [None]:
        if arch.moe is not None:
            # Per-layer specs (dense layers from moe_layer_freq), sliced for this stage.
            layer_spec = get_gpt_decoder_block_spec(
                cfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp
            )
        else:
            layer_spec = get_gpt_layer_local_spec(
                qk_layernorm=arch.qk_norm, normalization="RMSNorm"
            )
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=layer_spec,
            vocab_size=padded_vocab,  # megatron-core pads nothing itself
            max_sequence_length=64,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            position_embedding_type="rope",
            rotary_base=rope_theta(hf),
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            vp_stage=vp,
        )
        chunks.append(model.eval())
    return chunks


def local_tensors(chunks: list[torch.nn.Module], vpp: int) -> dict[str, Tensor]:
    """Parameters and persistent buffers by provider name (``model{c}.`` with vpp)."""
    out = {}
    for c, model in enumerate(chunks):
        prefix = f"model{c}." if vpp > 1 else ""
        for name, value in model.state_dict(keep_vars=True).items():
            if not name.endswith("_extra_state"):
                out[prefix + name] = value
    return out


@torch.no_grad()
def fill(params: dict[str, Tensor], tensors: tuple[LocalTensor, ...], canonical: dict) -> None:
    """``param[piece.local_box] = canonical[piece.canonical][piece.canonical_box]``; padding 0."""
    for t in tensors:
        p = params[t.name]
        p.zero_()
        for piece in t.pieces:
            src = canonical[piece.canonical][piece.canonical_box.slices()]
            p[piece.local_box.slices()] = src.reshape(piece.local_box.sizes).to(p.dtype)


def tag_tensors(spec: ModelSpec) -> dict[str, Tensor]:
    """Canonical tensors whose elements are distinct positive integers (exact in float32)."""
    out, base = {}, 1
    for t in spec:
        out[t.name] = torch.arange(base, base + t.numel, dtype=torch.float64).reshape(t.shape)
        base += t.numel
    assert base < 2**24, "tags must stay exact in float32"
    return {k: v.float() for k, v in out.items()}


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


def _layer_global(arch: ArchConfig, c: dict[str, Tensor], i: int, sub: str) -> Tensor:
    """Megatron's global tensor of layer ``i`` parameter ``sub`` (sharded-key suffix)."""
    p = f"model.layers.{i}."
    if sub == "self_attention.linear_qkv.weight":
        # attention.py: rows grouped per query group g as [q heads of g | k_g | v_g].
        q = c[p + "self_attn.q_proj.weight"].unflatten(0, (arch.num_key_value_heads, -1))
        k = c[p + "self_attn.k_proj.weight"].unflatten(0, (arch.num_key_value_heads, -1))
        v = c[p + "self_attn.v_proj.weight"].unflatten(0, (arch.num_key_value_heads, -1))
        return torch.cat([q, k, v], dim=1).flatten(0, 1)
    if sub == "self_attention.linear_qkv.bias":  # Qwen2: same grouping as the weight rows
        q, k, v = (c[p + f"self_attn.{x}_proj.bias"] for x in "qkv")
        parts = [x.unflatten(0, (arch.num_key_value_heads, -1)) for x in (q, k, v)]
        return torch.cat(parts, dim=1).flatten()
    if sub == "mlp.experts.experts.linear_fc1.weight":  # [E, 2F, H], each [gate; up]
        n = arch.moe.num_experts  # type: ignore[union-attr]
        e = [p + f"mlp.experts.{j}." for j in range(n)]
        return torch.stack(
            [torch.cat([c[x + "gate_proj.weight"], c[x + "up_proj.weight"]]) for x in e]
        )
    if sub == "mlp.experts.experts.linear_fc2.weight":  # [E, H, F]
        n = arch.moe.num_experts  # type: ignore[union-attr]
        return torch.stack([c[p + f"mlp.experts.{j}.down_proj.weight"] for j in range(n)])
    if sub == "mlp.linear_fc1.weight":  # SwiGLU factory's global view: [gate; up]
        return torch.cat([c[p + "mlp.gate_proj.weight"], c[p + "mlp.up_proj.weight"]])
    direct = {
        # local spec keys_map: the norms are saved under the TE-fused names.
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        "mlp.router.weight": "mlp.gate.weight",
    }
    return c[p + direct[sub]]


def megatron_global(key: str, arch: ArchConfig, c: dict[str, Tensor], vocab: int) -> Tensor:
    """The global tensor that Megatron's ShardedTensor ``key`` describes, from canonical ``c``.

    ``vocab`` is the padded vocabulary (rows past the HF vocabulary are zero).
    Homogeneous blocks stack layers on a leading axis (``decoder.layers.<sub>``);
    heterogeneous ones (dense + MoE layers) use ``decoder.layers.<global i>.<sub>``.
    """
    if key == "embedding.word_embeddings.weight":
        return _pad_rows(c["model.embed_tokens.weight"], vocab)
    if key == "output_layer.weight":
        return _pad_rows(c["lm_head.weight"], vocab)
    if key == "decoder.final_layernorm.weight":
        return c["model.norm.weight"]
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key)
    if m:
        return _layer_global(arch, c, int(m[1]), m[2])
    m = re.fullmatch(r"decoder\.layers\.(.+)", key)
    if m:
        return torch.stack([_layer_global(arch, c, i, m[1]) for i in range(arch.num_layers)])
    raise KeyError(f"no reference mapping for Megatron sharded key {key!r}")


def causal_mask(seq: int) -> Tensor:
    """Megatron's boolean mask, True = masked out. Passing None would make
    ``get_default_causal_mask`` allocate on ``device="cuda"``."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]


# -- checks shared by the Megatron truth tests ----------------------------------------------
def assert_names_shapes_position(name: str, layouts: list, results: dict) -> None:
    """Megatron's state_dict names/shapes and grid position equal the provider's, per rank."""
    for rank, layout in enumerate(layouts):
        got = results[rank][name]["names"]
        want = {t.name: t.shape for t in layout.tensors}
        where = f"{name} rank {rank}"
        assert sorted(set(got) - set(want)) == [], f"{where}: Megatron-only tensors"
        assert sorted(set(want) - set(got)) == [], f"{where}: provider-only tensors"
        for n in want:
            assert got[n] == want[n], f"{where} {n}: Megatron shape {got[n]} != {want[n]}"
        assert results[rank][name]["position"] == layout.position, f"{where}: grid position"


def assert_placement(name: str, layouts: list, results: dict) -> None:
    """Every ShardedTensor sits where the provider's pieces put the local data, holds the
    independently built global tensor there, and replica sets match ``layout.replicas``."""
    shard_sets = {}
    for rank, layout in enumerate(layouts):
        records = results[rank][name]["records"]
        seen = set()
        for rec in records:
            where = f"{name} rank {rank} {rec['param']} (key {rec['key']})"
            assert "problem" not in rec, f"{where}: {rec.get('problem')}"
            assert rec["flat"] is None, where
            assert rec["global_shape"] == rec["expected_shape"], f"{where}: global shape"
            for g, f, n, o in zip(
                rec["global_shape"], rec["frag"], rec["local_shape"], rec["offset"]
            ):
                assert g == f * n and o % n == 0, f"{where}: fragmentation {rec}"
            if rec["implied"] is None:  # an all-padding vocabulary shard
                rows = rec["local_shape"][0]
                vocab_key = rec["key"].endswith("word_embeddings.weight") or "output" in rec["key"]
                assert vocab_key, f"{where}: only padded vocabulary rows may hold no tag"
                assert rec["offset"] == (layout.position["tp"] * rows, 0), where
            else:
                assert rec["implied"] == rec["offset"], (
                    f"{where}: provider puts the local data at global offset {rec['implied']}, "
                    f"Megatron's ShardedTensor says {rec['offset']}"
                )
            assert rec["match"], f"{where}: local block != global tensor at {rec['offset']}"
            seen.add(rec["param"])
        missing = sorted({t.name for t in layout.tensors} - seen)
        assert missing == [], f"{name} rank {rank}: tensors without a ShardedTensor"
        shard_sets[rank] = {(rec["key"], rec["offset"]) for rec in records}
    for rank, layout in enumerate(layouts):
        same = tuple(r for r in range(len(layouts)) if shard_sets[r] == shard_sets[rank])
        assert layout.replicas == same, f"{name} rank {rank}: replicas {layout.replicas} != {same}"


def grid_position() -> dict[str, int]:
    """This process's coordinates in Megatron's parallel grid, named as the provider names them."""
    from megatron.core import parallel_state as ps

    return dict(
        tp=ps.get_tensor_model_parallel_rank(),
        cp=ps.get_context_parallel_rank(),
        dp=ps.get_data_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
        edp=ps.get_expert_data_parallel_rank(),
    )


def sharded_tensors(chunks: list, vpp: int) -> list[tuple[str, Any]]:
    """``(name, ShardedTensor)`` of every model chunk's ``sharded_state_dict()``, factories
    (SwiGLU ``linear_fc1``) built, names prefixed ``model{c}.`` when ``vpp > 1``."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    out = []
    for c, model in enumerate(chunks):
        prefix = f"model{c}." if vpp > 1 else ""
        for name, obj in model.sharded_state_dict(metadata=meta).items():
            if isinstance(obj, ShardedTensorFactory):
                built = obj.build()
                shards = built if isinstance(built, list) else [built]
            elif isinstance(obj, ShardedTensor) and not name.endswith("_extra_state"):
                shards = [obj]
            else:
                continue
            out += [(prefix + name, st) for st in shards]
    return out
