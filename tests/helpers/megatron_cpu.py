"""Run real megatron-core 0.16 ``GPTModel``s on a CPU-only torch (gloo, no TE/Apex).

Used by ``test_megatron_truth.py`` (and the MLA one) inside spawned worker processes only:
:func:`apply_cpu_patches` rewrites a few ``torch.cuda`` entry points globally, so it
must never run in the pytest process itself. The patches and the model builder live in
``nemo_refit_reshard.integrations.megatron.cpu`` (the GRPO trainer uses them);
this module adapts them to HF config dicts and adds MoE.

Also holds the test's *independent* statement of Megatron's global (sharded-key)
tensors in terms of HF checkpoint tensors (:func:`megatron_global`), written from
megatron-core's sources (``attention.py`` QKV grouping, ``mlp.py`` SwiGLU factory,
``experts.py`` expert axis), not from the layout provider.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from nemo_refit_reshard.integrations.megatron import cpu as prod
from nemo_refit_reshard.integrations.megatron.cpu import (  # noqa: F401 (re-exported)
    apply_cpu_patches,
    causal_mask,
)
from nemo_refit_reshard.layouts.base import LocalTensor, Piece
from nemo_refit_reshard.spec.config import ArchConfig
from nemo_refit_reshard.spec.model import ModelSpec
from nemo_refit_reshard.spec.parallel import TrainParallel


def rope_theta(hf: dict[str, Any]) -> float:
    """transformers 5 keeps ``rope_theta`` in ``rope_parameters``; 4.x at the top level."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)


def transformer_config(hf: dict[str, Any], arch: ArchConfig, par: TrainParallel, first: int | None):
    """The ``TransformerConfig`` of the HF model ``hf`` under ``par`` (float32, CPU-safe)."""
    kw: dict[str, Any] = {}
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
    eps = float(hf.get("rms_norm_eps", 1e-6))
    return prod.transformer_config(arch, par, norm_eps=eps, first=first, **kw)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM ``_vocab_size_with_padding`` (training code, not in megatron-core):
    round up to a multiple of ``make_vocab_size_divisible_by · tp``."""
    multiple = divisible_by * tp
    return (vocab + multiple - 1) // multiple * multiple


def build_gpt(
    hf: dict[str, Any], spec: ModelSpec, par: TrainParallel, padded_vocab: int, **kw: Any
) -> list[torch.nn.Module]:
    """This rank's ``GPTModel`` chunk(s) (one per virtual pipeline stage), in eval mode."""
    cfg = transformer_config(hf, spec.arch, par, kw.get("first"))
    chunks = prod.build_gpt(cfg, spec.arch, par, padded_vocab, rope_theta=rope_theta(hf))
    return [model.eval() for model in chunks]


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


# -- checks shared by the Megatron truth tests ----------------------------------------------
def swap_pieces(tensors: tuple[LocalTensor, ...], neg: tuple[str, str, str]) -> tuple:
    """The pieces of local tensors named like ``neg[0]`` with canonical ``a`` <-> ``b``."""
    part, a, b = neg

    def swap(p: Piece) -> Piece:
        name = p.canonical.replace(a, "\0").replace(b, a).replace("\0", b)
        return replace(p, canonical=name)

    return tuple(
        replace(t, pieces=tuple(map(swap, t.pieces))) if part in t.name else t for t in tensors
    )


def shard_record(name: str, st: Any, arch: Any, tags: dict, vocab: int) -> dict[str, Any]:
    """Where the provider's tags put ``st``'s local data, next to what ``st`` claims."""
    rec: dict[str, Any] = dict(
        param=name,
        key=st.key,
        offset=tuple(st.global_offset),
        global_shape=tuple(st.global_shape),
        local_shape=(1,) * st.prepend_axis_num + tuple(st.local_shape),
        frag=tuple(st.axis_fragmentations),
        flat=st.flattened_range,
    )
    try:
        glob = megatron_global(st.key, arch, tags, vocab)
    except KeyError as e:
        return dict(rec, problem=str(e))
    data = st.data.reshape(rec["local_shape"])
    rec["expected_shape"] = tuple(glob.shape)
    nonzero = data.flatten().nonzero()
    rec["implied"] = None  # all padding: no tag to locate
    if len(nonzero):
        k = int(nonzero[0])
        hits = (glob == data.flatten()[k]).nonzero()
        local_idx = torch.unravel_index(torch.tensor(k), rec["local_shape"])
        if len(hits) == 1:
            rec["implied"] = tuple(int(h) - int(i) for h, i in zip(hits[0], local_idx))
        else:
            rec["problem"] = f"tag found {len(hits)} times in the global tensor"
    region = glob[tuple(slice(o, o + n) for o, n in zip(rec["offset"], rec["local_shape"]))]
    rec["match"] = region.shape == data.shape and torch.equal(region, data)
    return rec


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


@torch.no_grad()
def load_hf_through_sharded_state_dict(
    chunks: list, vpp: int, arch: ArchConfig, canonical: dict[str, Tensor], vocab: int
) -> int:
    """Fill a live Megatron model from HF checkpoint tensors the way Megatron's own
    checkpoint loading places them, never through this project's layout.

    Megatron's ``sharded_state_dict()`` says where each local tensor sits in its global
    tensor (``global_offset``, ``local_shape``; the SwiGLU factory splits ``linear_fc1``
    into its gate and up halves); the global tensor comes from :func:`megatron_global`
    (written from megatron-core's sources). Every parameter is first set to NaN, and any
    NaN left afterwards is an element Megatron's own mapping never wrote: refused.
    Returns the number of ShardedTensors loaded."""
    live = local_tensors(chunks, vpp)
    for value in live.values():
        value.fill_(float("nan"))
    loaded = 0
    for _, st in sharded_tensors(chunks, vpp):
        if st.flattened_range is not None:
            raise AssertionError(f"{st.key}: flattened (distributed-optimizer) shards unexpected")
        shape = (1,) * st.prepend_axis_num + tuple(st.local_shape)
        glob = megatron_global(st.key, arch, canonical, vocab)
        region = glob[tuple(slice(o, o + n) for o, n in zip(st.global_offset, shape))]
        st.data.copy_(region.reshape(st.data.shape))
        loaded += 1
    unwritten = sorted(n for n, v in live.items() if v.is_floating_point() and v.isnan().any())
    if unwritten:
        raise AssertionError(f"Megatron's sharded state dict left unwritten: {unwritten}")
    return loaded
