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

Not yet proven here, and refused by name: MoE (SGLang's ``FusedMoE`` with its own
expert-parallel and MoE-TP widths), MLA (DeepSeek-V3, Kimi-K2), DP attention
(``--enable-dp-attention``: attention TP = tp / dp), pipeline parallelism and FP8.
"""

from __future__ import annotations

import dataclasses

from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel
from .base import RankLayout
from .vllm import vllm_layout
from .vllm_releases import VllmOptions

SGLANG_VERSION = "0.5.23"
SGLANG_FAMILIES = ("llama", "qwen2", "qwen3")  # proven against SGLang's classes


def check_sglang_parallel(spec: ModelSpec, parallel: InferParallel) -> None:
    """Raise ``ValueError`` for what this provider has not proven against SGLang."""
    a = spec.arch
    if a.family not in SGLANG_FAMILIES or a.moe is not None or a.mla is not None:
        raise ValueError(
            f"SGLang layouts cover {', '.join(SGLANG_FAMILIES)} (dense) so far; "
            f"{spec.name} is family {a.family!r}{' with experts' if a.moe else ''}"
            f"{' with MLA' if a.mla else ''}: use the vLLM engine for it"
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
    layout = vllm_layout(spec, parallel, rank, VllmOptions(params_dtype=params_dtype))
    return dataclasses.replace(layout, framework="sglang")
