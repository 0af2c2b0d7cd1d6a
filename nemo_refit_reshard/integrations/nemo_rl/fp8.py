"""NeMo RL's FP8 generation (``policy.generation.vllm_cfg.precision: fp8``) as the
block-FP8 engine it builds, for ``refit.backend: reshard``.

NeMo RL's vLLM worker (``nemo_rl/models/generation/vllm/quantization/fp8.py``,
``init_fp8``) starts vLLM from the trained (BF16) checkpoint with ``quantization="fp8"``
and ``hf_overrides={"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128], "ignored_layers":
[...]}}``, where ``ignored_layers`` names every linear module of the first
``num_first_layers_in_bf16`` and last ``num_last_layers_in_bf16`` decoder layers. vLLM
then holds e4m3 weights with float32 ``weight_scale_inv`` per 128×128 block — the
vLLM engine ``spec/quantization.py`` models — and NeMo RL's own refit quantizes each full
BF16 weight on the generation side. ``reshard`` refits the same vLLM engine with e4m3 +
scales on the wire where training ranks hold whole blocks (``layouts/fp8_wire.py``).

Refused by name, never served as something else: MXFP8 (``is_mx``), power-of-two weight
scales, extra ignore keywords, an FP8 KV cache (its scales are not refit), DeepGEMM
(``use_deep_gemm: true``: it re-lays weights after loading, and this refit writes them
in place), and BF16 first/last layers in a MoE model (vLLM's fused experts are skipped by
another naming rule). Scales differ from NeMo RL's generation-side quantizer in the last
bit where it computes ``1 / (448 / amax)``; ours is vLLM's reference ``amax / 448``
(``engine/quantize.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...spec.model import ModelSpec
from ...spec.quantization import BlockFp8, quantized_module
from .errors import NemoRlConfigError

WHERE = "policy.generation.vllm_cfg"
BLOCK = (128, 128)  # NeMo RL's FP8_BLOCK_QUANT_KWARGS weight_block_size


def is_fp8(vllm_cfg: Mapping[str, Any]) -> bool:
    return vllm_cfg.get("precision") == "fp8"


def check_fp8(vllm_cfg: Mapping[str, Any]) -> None:
    """The FP8 settings ``reshard`` serves; any other: ``NemoRlConfigError`` naming it."""
    refusals = {
        "is_mx": "MXFP8 generation is not modeled (block FP8 is: is_mx: false)",
        "pow2_weight_scaling_factors": (
            "power-of-two weight scales are not modeled (set it to false)"
        ),
        "use_deep_gemm": (
            "vLLM's DeepGEMM kernels re-lay FP8 weights after loading and reshard writes "
            "them in place: set it to false (and VLLM_USE_DEEP_GEMM=0)"
        ),
        "quantization_ignored_layer_kws": "extra ignored-layer keywords are not modeled",
    }
    for key, why in refusals.items():
        if vllm_cfg.get(key):
            raise NemoRlConfigError(
                f"{WHERE}.{key}={vllm_cfg[key]!r} with precision fp8 and "
                f"refit.backend=reshard: {why}"
            )
    kv = vllm_cfg.get("kv_cache_dtype", "auto")
    if kv not in (None, "auto"):
        raise NemoRlConfigError(
            f"{WHERE}.kv_cache_dtype={kv!r} with refit.backend=reshard: the FP8 KV cache's "
            "scales are not refit; use kv_cache_dtype: auto"
        )


def fp8_spec(spec: ModelSpec, vllm_cfg: Mapping[str, Any]) -> ModelSpec:
    """``spec`` as NeMo RL's FP8 engine holds it (module docstring); ``spec`` itself
    unless ``precision`` is ``fp8``."""
    if not is_fp8(vllm_cfg):
        return spec
    check_fp8(vllm_cfg)
    first = int(vllm_cfg.get("num_first_layers_in_bf16") or 0)
    last = int(vllm_cfg.get("num_last_layers_in_bf16") or 0)
    n = spec.arch.num_layers
    bf16 = set(range(min(first, n))) | set(range(max(n - last, 0), n))
    if bf16 and spec.arch.moe is not None:
        raise NemoRlConfigError(
            f"{WHERE}.num_first_layers_in_bf16={first}, num_last_layers_in_bf16={last}: "
            "BF16 layers in a MoE model are not modeled (vLLM skips fused experts by "
            "another naming rule); set both to 0"
        )
    ignored = set()
    for t in spec.unquantized():
        module = quantized_module(t.name, spec.arch.family)
        if module is not None and _layer(module) in bf16:
            ignored.add(module)
    return spec.unquantized().quantized(BlockFp8(BLOCK, frozenset(ignored)))


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        return int(parts[2])
    return None


__all__ = ["check_fp8", "fp8_spec", "is_fp8"]
