"""The SGLang rank provider (:func:`sglang_layout`): SGLang's parameter names, shapes and
shards, for the families proven against SGLang's own model classes.

Read from SGLang 0.5.23 (``sglang/srt/layers/linear.py``, ``vocab_parallel_embedding.py``,
``layers/moe/``, ``models/llama.py``, ``qwen2.py``, ``qwen3.py``, ``qwen3_moe.py``,
``deepseek_v2.py``) and checked on CPU rank by rank (``tests/test_sglang_truth.py``:
SGLang's own classes built with its own parallel state, loaded through its own
``load_weights``). For the dense families SGLang's rules are vLLM's, name for name
(``layouts/vllm.py`` states them): ``qkv_proj`` = ``[q heads | k heads | v heads]`` of
rank s with a KV head replicated over ``tp / num_key_value_heads`` ranks,
``gate_up_proj`` = ``[gate rows; up rows]``, row-parallel layers take input columns, and
the vocabulary is padded to a multiple of 64 and split by rows. Where SGLang differs
(MLA names, expert parallelism, fused shared experts) ``layouts/sglang_walk.py`` says how.

* Qwen3-MoE: ``FusedMoE`` holds ``mlp.experts.w13_weight`` / ``w2_weight`` (vLLM 0.11's
  names). SGLang 0.5.23 builds an MoE block in *every* layer (it reads no
  ``mlp_only_layers``), so a config with dense layers is refused.
* DeepSeek-V3 / Kimi-K2 (``DeepseekV3ForCausalLM``, MLA): the first
  ``first_k_dense_replace`` layers dense, shared experts sliced over tp, and
  ``gate.e_score_correction_bias`` (float32) when ``topk_method`` is ``noaux_tc``.
  On a CUDA GPU (sm80+) SGLang *fuses* the shared expert into the routed experts by
  default when the config has 256 routed experts and one shared expert (DeepSeek-V3/R1)
  and ``--ep-size`` is 1 (``DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason``):
  :func:`sglang_fuses_shared_experts` is that rule, ``shared_experts_fusion=False`` is
  ``--disable-shared-experts-fusion`` and ``True`` ``--enforce-shared-experts-fusion``.
  Kimi-K2 (384 experts, not Quark MXFP4) keeps ``mlp.shared_experts``.
* Expert parallelism: ``--ep-size`` is ``ep=`` and must equal tp (whole experts per
  rank; ``InferParallel`` accepts ep = 1 or tp). SGLang's ``moe_tp_size = tp / ep`` > 1
  would need ``ep`` < tp, which the ``ep`` grammar (vLLM's) cannot say yet.
* Derived weights (:func:`sglang_derived_tensors`): after loading, SGLang's
  ``post_load_weights`` (``deepseek_weight_loader.py``) splits every MLA layer's local
  ``kv_b_proj`` (N = heads/tp, P = qk_nope_head_dim, V = v_head_dim, L = kv_lora_rank)::

      W = kv_b_proj.weight.unflatten(0, (N, P + V));  W_K, W_V = W.split([P, V], 1)
      self_attn.w_kc = W_K               [N, P, L]  (a copy, column-major in P, L)
      self_attn.w_vc = W_V.transpose(1, 2)   [N, L, V]  (a copy)

  They are plain module attributes, not parameters, and copies: a refit of
  ``kv_b_proj`` does not change them, so after each refit the receiver must run SGLang's
  ``model.post_load_weights()`` again (``bind_or_assign`` then copies into the same
  storage). The layouts below describe only parameters a checkpoint piece maps to.
* MTP (``num_nextn_predict_layers``): SGLang serves the next-token layer only as a
  separate draft model (``DeepseekV3ForCausalLMNextN``, with
  ``--speculative-algorithm EAGLE``); the target model holds no MTP tensor, so the
  layouts here hold none and a draft model is not refit.

* Pipeline parallelism (``--pp-size`` = ``pp=``): SGLang's own layer split
  (``layouts/sglang_grid.py::sglang_pp_indices``: the last ``L%P`` stages take the extra
  layers; ``pp_layer_partition`` is ``SGLANG_PP_LAYER_PARTITION``) and SGLang's own rank
  order ``pp_rank·tp + tp_rank``; which stage holds ``embed_tokens``, ``norm`` and
  ``lm_head`` per family is in ``layouts/sglang_walk.py``. A tied-embedding Llama,
  Qwen3-MoE or DeepSeek under pp is refused: SGLang's Llama ties ``lm_head`` to the
  embedding only the first stage builds, and its Qwen3-MoE and DeepSeek load ``lm_head``
  only from a ``lm_head.weight`` a tied checkpoint lacks.

* Data-parallel attention (``--tp-size S --dp-size D --enable-dp-attention``, 0.5.23's
  ``--attn-dp-size D``) is ``InferParallel(tp=S/D, engine_dp=D)``: an engine of
  ``engine_dp·tp = S`` ranks, engine rank = SGLang's tp rank ``t = edp·tp + tp_rank``
  (``attn_dp_rank = t // (S/D)``, ``attn_tp_rank = t % (S/D)``). Attention and
  ``embed_tokens`` are split over ``tp`` = S/D and replicated over the D groups; the
  dense MLP, shared experts, FusedMoE (ep = 1 or S) and ``lm_head`` over all S ranks
  (``layouts/sglang_walk.py`` has the file:line rules). Covered for Qwen3, Qwen3-MoE and
  DeepSeek-V3 at ``pp=1``; Llama and Qwen2 (SGLang builds their attention over the whole
  tp group), ``pp`` > 1 (SGLang's rank order ``pp_rank·S + t`` is not ``engine_dp``'s)
  and tied Qwen3-MoE / DeepSeek are refused by name. ``plan`` / ``simulate`` and the
  receiver use it (``tests/test_sglang_receiver.py`` refits DeepSeek-V3 so); the NeMo RL
  and veRL routes refuse ``engine_dp`` (neither starts SGLang with it).

* Block FP8 (``quantization_config`` ``quant_method: fp8``, 128x128 ``weight_block_size``,
  dynamic activations), Qwen3, Qwen3-MoE and DeepSeek-V3, under ``pp`` and dp attention
  too (the rules below per stage and per group): SGLang's
  ``Fp8LinearMethod.create_weights`` (``layers/quantization/fp8.py`` ~613-716) registers
  ``weight`` e4m3 and ``weight_scale_inv`` float32 ``[ceil(rows/128), ceil(cols/128)]``
  per quantized linear, ``Fp8MoEMethod`` (~1545-1746) ``w13_weight_scale_inv`` /
  ``w2_weight_scale_inv`` per local expert; no ``input_scale`` (dynamic). Its loaders
  shard scales in whole blocks as vLLM's do, so the names, shapes and slices are vLLM's
  (``layouts/vllm_fp8.py``); embeddings, norms, ``lm_head`` and Qwen3-MoE's router
  ``mlp.gate`` stay unquantized (``models/qwen3_moe.py`` ~280-289: the gate takes a quant
  config only for ModelSlim), so a checkpoint that quantizes the gate is refused. The
  layout is what SGLang's ``load_weights`` leaves; ``process_weights_after_loading`` keeps
  it on an NVIDIA Hopper GPU (~835-848) but requantizes scales to UE8M0 where DeepGEMM
  runs UE8M0 (sm100/sm120, ``requant_block_scale_ue8m0_for_deepgemm``), pre-shuffles on
  AMD (aiter) and repacks for AMX on CPU (~826-834), none of which a refit written in
  place reproduces. DeepSeek-V3's ``fused_qkv_a_proj_with_mqa`` scale stacks the block
  rows of ``q_a_proj``'s and ``kv_a_proj_with_mqa``'s scales (vLLM's ``fused_qkv_a_proj``
  rule); its ``w_kc``/``w_vc`` are derived from the FP8 ``kv_b_proj`` by
  ``post_load_weights`` (``deepseek_weight_loader.py`` ~586-820: dequantized to BF16 on
  CUDA with 128x128 blocks, requantized per tensor with a ``w_scale`` elsewhere), which
  the receiver reruns after each refit; the MLA attentions' ``attn_mqa`` / ``attn_mha``
  ``k_scale`` / ``v_scale`` (``BaseKVCacheMethod``: KV-cache scales from the checkpoint, or 1.0) are
  parameters no refit writes (:data:`SGLANG_KV_CACHE_SCALES`).

Refused by name (:func:`check_sglang_parallel`): ``ep`` with fused shared experts (SGLang
fuses them under ep only on AMD), FP8 engines other than the above, other families, and
the dp-attention cases above. Not covered either (they change the layout and no config says so):
``SGLANG_ENABLE_EMBED_REPLICATION``, ``SGLANG_SHARED_EXPERT_TP1``, the all-to-all MoE
backends (``--moe-a2a-backend``), which replicate tensors here split, and under dp attention
``--enable-dp-lm-head``, ``--moe-dense-tp-size 1`` and ``--attn-cp-size``.
"""

from __future__ import annotations

from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel
from ..spec.quantization import FP8
from .base import RankLayout, paused_gc
from .sglang_grid import sglang_pp_indices, sglang_replicas
from .sglang_walk import SglangRank
from .vllm import vllm_padded_vocab
from .vllm_grid import vllm_position
from .vllm_releases import VllmOptions

SGLANG_VERSION = "0.5.23"
# proven against SGLang's classes
SGLANG_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
# whose block-FP8 engines are proven against SGLang's classes
SGLANG_FP8_FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3")
# whose attention SGLang builds over the attention tp group (dp attention, proven)
SGLANG_DP_ATTENTION_FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3")
# vLLM's release whose MoE names SGLang's match (``experts.w13_weight``)
_MOE_NAMES_OF = "0.11.0"
# What SGLang's post_load_weights derives in every MLA layer's self_attn (unquantized).
MLA_DERIVED = ("w_kc", "w_vc")
# The KV-cache scales an FP8 engine's attention (RadixAttention: ``attn``; DeepSeek's MLA
# ``attn_mqa`` / ``attn_mha``) registers as parameters (SGLang's BaseKVCacheMethod: from
# the checkpoint's k_scale / v_scale, else 1.0 after loading): not tensors of the trained
# model; no refit writes them, and the receiver refuses calibrated ones (their values
# would stay those of the old weights).
SGLANG_KV_CACHE_SCALES = tuple(
    f".{attention}.{kv}_scale" for attention in ("attn", "attn_mqa", "attn_mha") for kv in "kv"
)


def sglang_fuses_shared_experts(spec: ModelSpec, parallel: InferParallel) -> bool:
    """SGLang 0.5.23's default on a CUDA GPU (sm80+, no all-to-all MoE backend, BF16):
    a ``DeepseekV3ForCausalLM`` with 256 routed experts and one shared expert, ``ep=1``."""
    moe = spec.arch.moe
    return (
        spec.arch.family == "deepseek_v3"
        and moe is not None
        and moe.num_experts == 256
        and moe.num_shared_experts == 1
        and not parallel.expert_parallel
    )


def _rule(text: str) -> ValueError:
    return ValueError(f"{text} (SGLang's rule)")


def _check_moe(spec: ModelSpec, par: InferParallel, fuse_shared: bool) -> None:
    a, moe = spec.arch, spec.arch.moe
    s, s_name = _ffn_ranks(par)
    if moe is None:
        if par.expert_parallel:
            raise ValueError(f"ep={par.ep} given for {a.family}, which has no experts")
        return
    if a.family == "qwen3_moe" and moe.sparse_layers != tuple(range(a.num_layers)):
        dense = sorted(set(range(a.num_layers)) - set(moe.sparse_layers))
        raise ValueError(
            f"{spec.name} has dense MLP layers {dense} (mlp_only_layers / "
            "decoder_sparse_step): SGLang 0.5.23 builds experts in every Qwen3-MoE "
            "layer, so its parameters would not match the checkpoint there"
        )
    if s > moe.num_experts:
        raise _rule(f"{s_name}={s} exceeds num_experts={moe.num_experts}")
    if par.expert_parallel:
        if moe.num_experts % par.ep:
            raise ValueError(
                f"ep={par.ep} must divide num_experts={moe.num_experts} (SGLang's rule: its "
                "FusedMoE gives every expert-parallel rank num_experts/ep experts); use ep=1"
            )
        if fuse_shared:
            raise ValueError(
                f"shared-expert fusion with ep={par.ep} is not covered (SGLang fuses under "
                "expert parallelism only on AMD GPUs): use shared_experts_fusion=False "
                "(--disable-shared-experts-fusion) or ep=1"
            )
    elif moe.expert_intermediate_size % s:
        raise ValueError(
            f"{s_name}={s} must divide moe_intermediate_size={moe.expert_intermediate_size} "
            "(SGLang's rule: without --ep-size its FusedMoE slices every expert over the tp "
            f"ranks); use ep={s} or a smaller {s_name}"
        )
    if moe.num_shared_experts and moe.shared_intermediate_size % s:
        raise _rule(
            f"{s_name}={s} must divide the shared-expert size {moe.shared_intermediate_size}"
        )
    if fuse_shared and moe.num_shared_experts != 1:
        raise ValueError(
            f"shared-expert fusion needs one shared expert; {spec.name} has "
            f"{moe.num_shared_experts}: use shared_experts_fusion=False"
        )


def check_sglang_parallel(
    spec: ModelSpec,
    parallel: InferParallel,
    shared_experts_fusion: bool | None = None,
    pp_layer_partition: tuple[int, ...] | None = None,
) -> None:
    """Raise ``ValueError`` for what this provider has not proven against SGLang, or
    what SGLang itself refuses, naming the rule and what to do."""
    a, s = spec.arch, parallel.tp
    if a.family not in SGLANG_FAMILIES:
        raise ValueError(
            f"SGLang layouts cover {', '.join(SGLANG_FAMILIES)} so far; {spec.name} is "
            f"family {a.family!r}: use the vLLM engine for it"
        )
    _check_fp8(spec, parallel)
    _check_pp(spec, parallel, pp_layer_partition)
    if a.tie_word_embeddings and a.family == "qwen3_moe":
        # qwen3_moe.py builds its own ParallelLMHead whatever the config says and loads it
        # only from lm_head.weight: SGLang itself would serve an unloaded head.
        raise ValueError(
            f"{spec.name} ties its word embeddings, but SGLang 0.5.23's qwen3_moe model "
            "never ties lm_head to embed_tokens and loads it only from lm_head.weight, which "
            "a tied checkpoint lacks: its lm_head would hold no checkpoint tensor; untie the "
            "embeddings (save lm_head.weight) or serve the model with vLLM"
        )
    _check_dp_attention(spec, parallel)
    _check_moe(spec, parallel, _fusion(spec, parallel, shared_experts_fusion))
    if a.num_attention_heads % s:
        raise _rule(f"tp={s} must divide num_attention_heads={a.num_attention_heads}")
    ng = a.num_key_value_heads
    if a.mla is None and (ng % s if s < ng else s % ng):
        raise ValueError(
            f"tp={s} and num_key_value_heads={ng}: one must divide the other "
            "(SGLang's QKVParallelLinear)"
        )
    has_dense = a.moe is None or len(a.moe.sparse_layers) < a.num_layers + a.num_mtp_layers
    ffn, ffn_name = _ffn_ranks(parallel)
    if has_dense and a.intermediate_size % ffn:
        raise _rule(f"{ffn_name}={ffn} must divide intermediate_size={a.intermediate_size}")
    vp = vllm_padded_vocab(a.vocab_size)
    if vp % s:
        raise _rule(f"tp={s} must divide the padded vocabulary {vp} (vocab padded to 64)")
    if vp % ffn and not a.tie_word_embeddings:  # lm_head over SGLang's whole tp group
        raise _rule(f"{ffn_name}={ffn} must divide the padded vocabulary {vp} (lm_head)")


def _check_fp8(spec: ModelSpec, par: InferParallel) -> None:
    """Block-FP8 engines: proven for Qwen3, Qwen3-MoE and DeepSeek-V3 (at tp, ep, pp=2,
    dp attention; DeepSeek-V3 with the shared expert fused too)."""
    a = spec.arch
    if a.quant is None:
        return
    if a.family not in SGLANG_FP8_FAMILIES:
        raise ValueError(
            f"SGLang FP8 layouts cover {', '.join(SGLANG_FP8_FAMILIES)} so far; {spec.name} "
            f"is family {a.family!r}: serve BF16 weights or use the vLLM engine"
        )
    moe = a.moe
    if moe is None:
        return
    quantized = [
        layer
        for layer in moe.sparse_layers
        if spec.tensor(f"model.layers.{layer}.mlp.gate.weight").dtype == FP8
    ]
    if quantized:
        raise ValueError(
            f"{spec.name} quantizes the router gate of layers {quantized}: SGLang 0.5.23's "
            "Qwen3-MoE builds mlp.gate unquantized under fp8 (models/qwen3_moe.py, "
            "gate_quant_config), so it cannot hold that checkpoint; list each "
            "model.layers.N.mlp.gate in modules_to_not_convert"
        )
    n = moe.expert_intermediate_size * par.ep // (par.tp * par.engine_dp)
    if n % a.quant.block[0]:
        raise ValueError(
            f"{n} expert intermediate rows per rank is not a multiple of the FP8 block "
            f"{a.quant.block[0]} (SGLang's Fp8MoEMethod refuses it); use ep={par.tp} or a "
            "smaller tp"
        )


def _ffn_ranks(par: InferParallel) -> tuple[int, str]:
    """SGLang's ``--tp-size``: the ranks its MLP, experts and lm_head are split over."""
    if par.engine_dp == 1:
        return par.tp, "tp"
    return par.engine_dp * par.tp, "engine_dp·tp"


def _check_dp_attention(spec: ModelSpec, par: InferParallel) -> None:
    """Data-parallel attention (``engine_dp`` > 1): what is proven, by name."""
    a, d = spec.arch, par.engine_dp
    if d == 1:
        return
    flags = f"--tp-size {d * par.tp} --dp-size {d} --enable-dp-attention (engine_dp={d})"
    if a.family not in SGLANG_DP_ATTENTION_FAMILIES:
        raise ValueError(
            f"{flags} is not covered for {a.family}: SGLang 0.5.23's {a.family} attention is "
            "split over the whole tp group, not the attention tp group (its dp attention "
            "covers qwen3, qwen3_moe and deepseek_v3 here); use engine_dp=1"
        )
    if par.pp > 1:
        raise ValueError(
            f"{flags} with pp={par.pp} is not covered: SGLang numbers such an engine "
            "pp_rank·tp_size + tp_rank, not the engine_dp-major order of engine_dp; use pp=1"
        )
    if a.tie_word_embeddings and a.family != "qwen3":
        raise ValueError(
            f"{flags} is not covered for {spec.name}, which ties its word embeddings "
            f"({a.family}): untie them or use engine_dp=1"
        )


def _check_pp(spec: ModelSpec, par: InferParallel, partition: tuple[int, ...] | None) -> None:
    a = spec.arch
    if par.pp == 1:
        return
    if par.pp > a.num_layers:
        raise _rule(f"pp={par.pp} exceeds num_hidden_layers={a.num_layers}")
    if a.tie_word_embeddings and a.family in ("llama", "qwen3_moe", "deepseek_v3"):
        why = {
            "llama": "ties lm_head to embed_tokens, which only the first stage builds",
            "qwen3_moe": "loads every stage's lm_head from lm_head.weight only",
            "deepseek_v3": "loads the last stage's lm_head from lm_head.weight only",
        }[a.family]
        raise ValueError(
            f"{spec.name} ties its word embeddings: under pp={par.pp} SGLang 0.5.23's "
            f"{a.family} model {why}, so its lm_head would not be the checkpoint's; use pp=1"
        )
    sglang_pp_indices(a.num_layers, 0, par.pp, partition)  # a wrong partition raises


def _fusion(spec: ModelSpec, parallel: InferParallel, option: bool | None) -> bool:
    if spec.arch.moe is None or not spec.arch.moe.num_shared_experts:
        return False
    return sglang_fuses_shared_experts(spec, parallel) if option is None else option


@paused_gc
def sglang_layout(
    spec: ModelSpec,
    parallel: InferParallel,
    rank: int,
    params_dtype: str = "bfloat16",
    shared_experts_fusion: bool | None = None,
    pp_layer_partition: tuple[int, ...] | None = None,
) -> RankLayout:
    """The local tensors and canonical pieces of SGLang inference rank ``rank``.
    ``shared_experts_fusion``: None is SGLang's default on a CUDA GPU
    (:func:`sglang_fuses_shared_experts`). ``pp_layer_partition``: the engine's
    ``SGLANG_PP_LAYER_PARTITION`` as layer counts per stage (None: SGLang's split)."""
    check_sglang_parallel(spec, parallel, shared_experts_fusion, pp_layer_partition)
    version = _MOE_NAMES_OF if spec.arch.moe is not None else None
    opts = VllmOptions(
        pp_layer_partition=pp_layer_partition, params_dtype=params_dtype, vllm_version=version
    )
    walker = SglangRank(spec, parallel, rank, opts, _fusion(spec, parallel, shared_experts_fusion))
    walker.build()
    return RankLayout(
        framework="sglang",
        rank=rank,
        world_size=parallel.world_size,
        position=vllm_position(parallel, rank).as_dict(),
        replicas=sglang_replicas(parallel, rank),
        tensors=walker.b.build(),
    )


def sglang_derived_tensors(
    spec: ModelSpec,
    parallel: InferParallel,
    rank: int = 0,
    pp_layer_partition: tuple[int, ...] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of what SGLang derives on rank ``rank`` after loading (no checkpoint
    piece maps to these; rerun ``model.post_load_weights()`` after a refit): each MLA
    layer's ``self_attn.w_kc`` [N, P, L] and ``self_attn.w_vc`` [N, L, V], for the layers
    of the rank's pipeline stage (every layer when pp = 1)."""
    a, m = spec.arch, spec.arch.mla
    if m is None:
        return {}
    n = a.num_attention_heads // parallel.tp
    shapes = {
        "w_kc": (n, m.qk_nope_head_dim, m.kv_lora_rank),
        "w_vc": (n, m.kv_lora_rank, m.v_head_dim),
    }
    stage = vllm_position(parallel, rank).pp
    start, end = sglang_pp_indices(a.num_layers, stage, parallel.pp, pp_layer_partition)
    return {
        f"model.layers.{layer}.self_attn.{attr}": shapes[attr]
        for layer in range(start, end)
        for attr in MLA_DERIVED
    }
