"""The SGLang rank provider (:func:`sglang_layout`): SGLang's parameter names, shapes and
shards, for the families proven against SGLang's own model classes.

Read from SGLang 0.5.23 (``sglang/srt/layers/linear.py``, ``vocab_parallel_embedding.py``,
``models/llama.py``, ``qwen2.py``, ``qwen3.py``) and checked on CPU rank by rank
(``tests/test_sglang_truth.py``: SGLang's own classes built with its own parallel state,
loaded through its own ``load_weights``). For the dense families SGLang's rules are
vLLM's, name for name (``layouts/vllm.py`` states them): its ``QKVParallelLinear`` puts
``[q heads | k heads | v heads]`` of rank s in ``qkv_proj`` and replicates a KV head
over ``tp / num_key_value_heads`` ranks, ``MergedColumnParallelLinear`` stacks
``[gate rows; up rows]`` in ``gate_up_proj``, ``RowParallelLinear`` takes input columns,
and ``VocabParallelEmbedding`` pads the vocabulary to a multiple of 64 and splits the
padded rows. So the provider is vLLM's, named ``sglang``.

Qwen3-MoE with tensor parallelism only: SGLang's ``FusedMoE`` holds every expert, each
sliced over the tp ranks, as ``mlp.experts.w13_weight`` / ``w2_weight`` — vLLM 0.11's
layout (before vLLM moved them under ``experts.routed_experts``). SGLang 0.5.23 builds
an MoE block in *every* layer (it reads no ``mlp_only_layers``), so a config with dense
layers is refused: SGLang would hold experts where the checkpoint has a dense MLP.

Not yet proven here, and refused by name: expert parallelism and SGLang's MoE-TP widths,
MLA (DeepSeek-V3, Kimi-K2), DP attention (``--enable-dp-attention``: attention TP =
tp / dp), pipeline parallelism and FP8.
"""

from __future__ import annotations

import dataclasses

from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel
from .base import RankLayout
from .vllm import vllm_layout
from .vllm_releases import VllmOptions

SGLANG_VERSION = "0.5.23"
SGLANG_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")  # proven against SGLang's classes
# vLLM's release whose MoE names SGLang's match (``experts.w13_weight``)
_MOE_NAMES_OF = "0.11.0"


def check_sglang_parallel(spec: ModelSpec, parallel: InferParallel) -> None:
    """Raise ``ValueError`` for what this provider has not proven against SGLang."""
    a = spec.arch
    if a.family not in SGLANG_FAMILIES or a.mla is not None:
        raise ValueError(
            f"SGLang layouts cover {', '.join(SGLANG_FAMILIES)} so far; {spec.name} is "
            f"family {a.family!r}{' with MLA' if a.mla else ''}: use the vLLM engine for it"
        )
    if a.moe is not None:
        if a.moe.sparse_layers != tuple(range(a.num_layers)):
            dense = sorted(set(range(a.num_layers)) - set(a.moe.sparse_layers))
            raise ValueError(
                f"{spec.name} has dense MLP layers {dense} (mlp_only_layers / "
                "decoder_sparse_step): SGLang 0.5.23 builds experts in every Qwen3-MoE "
                "layer, so its parameters would not match the checkpoint there"
            )
        if parallel.tp > a.moe.num_experts:
            raise ValueError(
                f"tp={parallel.tp} exceeds num_experts={a.moe.num_experts} (SGLang's rule)"
            )
    if a.quant is not None:
        raise ValueError("SGLang layouts do not cover FP8 engines yet; serve BF16 weights")
    if parallel.pp > 1 or parallel.engine_dp > 1 or parallel.expert_parallel:
        raise ValueError(
            f"SGLang layouts cover tensor parallelism (tp=) and replicas (dp=) so far, not "
            f"{parallel}: drop pp/engine_dp/ep for SGLang"
        )


def sglang_layout(
    spec: ModelSpec, parallel: InferParallel, rank: int, params_dtype: str = "bfloat16"
) -> RankLayout:
    """The local tensors and canonical pieces of SGLang inference rank ``rank``."""
    check_sglang_parallel(spec, parallel)
    version = _MOE_NAMES_OF if spec.arch.moe is not None else None
    opts = VllmOptions(params_dtype=params_dtype, vllm_version=version)
    layout = vllm_layout(spec, parallel, rank, opts)
    return dataclasses.replace(layout, framework="sglang")
