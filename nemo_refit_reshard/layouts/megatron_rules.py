"""Megatron-core options that change names or shapes, and the parallelism rules it enforces.

Every rule here is one Megatron-core 0.16 asserts (``divide`` in the parallel
linear layers, ``TransformerConfig.__post_init__``), raised as a ``ValueError``
that names the parameter before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.config import ArchConfig
from ..spec.parallel import TrainParallel

LAYER_SPECS = ("local", "te")


@dataclass(frozen=True)
class MegatronOptions:
    """Choices that change Megatron parameter names or shapes but not the model.

    ``layer_spec``: ``"local"`` (``get_gpt_layer_local_spec``) or ``"te"``
    (``get_gpt_layer_with_transformer_engine_spec``: input norm fused into
    ``linear_qkv.layer_norm_weight``, dense pre-MLP norm into
    ``linear_fc1.layer_norm_weight``, MLA q/kv norms into the up projections).
    ``moe_grouped_gemm``: expert names ``mlp.experts.linear_fc1.weight{i}``
    (TEGroupedMLP) instead of ``mlp.experts.local_experts.{i}.linear_fc1.weight``.
    ``params_dtype``: dtype of the local tensors (default: the checkpoint dtype).
    """

    layer_spec: str = "local"
    moe_grouped_gemm: bool = False
    make_vocab_size_divisible_by: int = 128
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    params_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.layer_spec not in LAYER_SPECS:
            raise ValueError(
                f"unknown Megatron layer_spec {self.layer_spec!r}; choose one of {LAYER_SPECS}"
            )
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError("make_vocab_size_divisible_by must be >= 1")


def megatron_padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """``Vp = ceil(V / (m·T))·m·T`` (Megatron's ``_vocab_size_with_padding``)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def check_megatron_parallel(a: ArchConfig, par: TrainParallel, opts: MegatronOptions) -> None:
    """Raise ``ValueError`` naming the parameter and rule for an impossible combination."""
    t, nq, ng = par.tp, a.num_attention_heads, a.num_key_value_heads
    if nq % t:
        raise ValueError(f"tp={t} must divide num_attention_heads={nq} (Megatron's rule)")
    if a.mla is None:
        if ng >= t and ng % t:
            raise ValueError(f"tp={t} must divide num_key_value_heads={ng} when tp <= {ng}")
        if ng < t and t % ng:
            raise ValueError(f"tp={t} > num_key_value_heads={ng} needs tp to be a multiple of {ng}")
    elif opts.layer_spec == "local":
        down = [("kv_lora_rank + qk_rope_head_dim", a.mla.kv_lora_rank + a.mla.qk_rope_head_dim)]
        if a.mla.q_lora_rank is not None:
            down.append(("q_lora_rank", a.mla.q_lora_rank))
        for key, size in down:
            if size % t:
                raise ValueError(
                    f"tp={t} must divide {key}={size}: the local spec shards the MLA down "
                    "projections over tensor parallel ranks (the TE spec replicates them)"
                )
    if a.intermediate_size % t:
        raise ValueError(
            f"tp={t} must divide intermediate_size={a.intermediate_size} "
            "(column-parallel linear_fc1)"
        )
    moe = a.moe
    if moe is None:
        if par.ep > 1 or (par.etp not in (None, par.tp)):
            raise ValueError(
                f"ep={par.ep}/etp={par.etp} given for {a.family}, which has no experts"
            )
        return
    if moe.num_experts % par.ep:
        raise ValueError(
            f"ep={par.ep} must divide num_experts={moe.num_experts} (Megatron gives every expert-"
            "parallel rank the same number of experts)"
        )
    if moe.expert_intermediate_size % par.expert_tp:
        raise ValueError(
            f"etp={par.expert_tp} must divide moe_intermediate_size={moe.expert_intermediate_size}"
        )
    if moe.shared_intermediate_size % t:
        raise ValueError(
            f"tp={t} must divide the shared-expert size {moe.shared_intermediate_size}"
        )
