"""Read a live vLLM engine's configuration into our layout terms, refusing what we do not model.

``engine_layout(vllm_config, vllm_version)`` gives the :class:`InferParallel` of one
engine and the :class:`VllmOptions` the layout provider needs. Options that change
which parameters a rank holds, or their contents after loading, and that the
provider does not model are refused with an error naming the option — a wrong plan
would silently corrupt weights. Only attributes are read (no vLLM import), so the
checks run wherever a config object is at hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...layouts.vllm_releases import VllmOptions, vllm_release
from ...spec.parallel import InferParallel

# Unquantized MoE backends that use w13/w2 exactly as loaded. The others permute, pad
# or re-lay the weights in process_weights_after_loading (FlashInfer swaps to
# [up; gate] and shuffles, ROCm AITER shuffles, XPU transposes, ...).
IN_PLACE_MOE_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON", "CPU"})
# Block-FP8 kernels whose process_weights_after_loading leaves weight and scale as
# loaded (vLLM 0.33: the base block strategy), so quantizing in place is what a load
# would give. DeepGEMM requantizes to UE8M0 scales and re-lays them, Marlin and the
# CPU kernels repack, FlashInfer-CUTLASS MoE swaps w13 to [up; gate]: refused by name.
IN_PLACE_FP8_LINEAR_KERNELS = frozenset(
    {"TritonFp8BlockScaledMMKernel", "CutlassFp8BlockScaledMMKernel",
     "BlockWiseTorchFP8ScaledMMLinearKernel"}
)  # fmt: skip
IN_PLACE_FP8_MOE_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON", "VLLM_CUTLASS"})


class UnsupportedVllmOption(ValueError):
    """A vLLM option this refit cannot serve (it says which and what to do)."""


@dataclass(frozen=True)
class EngineLayout:
    """One engine's parallel sizes, provider options and vLLM version."""

    parallel: InferParallel
    options: VllmOptions
    vllm_version: str
    fp8_block: tuple[int, int] | None = None  # a block-FP8 engine's weight block


def _get(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return default
    return obj


def fp8_block(vllm_config: Any) -> tuple[int, int] | None:
    """The weight block of a block-FP8 engine (``quantization='fp8'`` with the
    checkpoint's ``weight_block_size``), else None."""
    if _get(vllm_config, "model_config.quantization") != "fp8":
        return None
    q = _get(vllm_config, "model_config.hf_config.quantization_config") or {}
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    return (int(block[0]), int(block[1])) if block else None


def check_supported(vllm_config: Any) -> None:
    """Raise :class:`UnsupportedVllmOption` for options the layout provider does not model."""
    model, par = _get(vllm_config, "model_config"), _get(vllm_config, "parallel_config")
    problems: list[str] = []
    quant = _get(model, "quantization")
    if quant and fp8_block(vllm_config) is None:
        problems.append(
            f"quantization={quant!r}: quantized weights are re-packed after loading; refit "
            "serves unquantized (bf16/fp16/fp32) and block-FP8 (quantization='fp8' with "
            "weight_block_size) engines"
        )
    if _get(par, "enable_eplb", False):
        problems.append(
            "enable_eplb=True: EPLB moves experts between ranks at run time; turn it off"
        )
    redundant = _get(par, "eplb_config.num_redundant_experts", 0) or 0
    if redundant:
        problems.append(f"eplb_config.num_redundant_experts={redundant}: set it to 0")
    if _get(par, "expert_placement_strategy", "linear") == "round_robin" and _get(
        par, "enable_expert_parallel", False
    ):
        problems.append(
            "expert_placement_strategy='round_robin': only linear expert placement is "
            "modelled; use the default 'linear'"
        )
    for key in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        size = _get(par, key, 1) or 1
        if size > 1:
            problems.append(f"{key}={size}: context parallel is not modelled; set it to 1")
    if problems:
        raise UnsupportedVllmOption(
            "this vLLM engine uses options reshard refit does not support:\n  "
            + "\n  ".join(problems)
        )


def engine_layout(vllm_config: Any, vllm_version: str) -> EngineLayout:
    """The layout terms of the engine ``vllm_config`` describes (after :func:`check_supported`)."""
    check_supported(vllm_config)
    par = vllm_config.parallel_config
    tp, pp = int(par.tensor_parallel_size), int(par.pipeline_parallel_size)
    edp = int(_get(par, "data_parallel_size", 1) or 1)
    expert_parallel = bool(_get(par, "enable_expert_parallel", False))
    ep = tp * edp if expert_parallel and tp * edp > 1 else 1
    dtype = str(_get(vllm_config, "model_config.dtype", "")).removeprefix("torch.") or None
    options = VllmOptions(
        params_dtype=dtype,
        vllm_version=vllm_version,
        all2all_backend=_get(par, "all2all_backend"),
    )
    vllm_release(vllm_version)  # an unknown release fails here, naming the known ones
    parallel = InferParallel(tp=tp, pp=pp, engine_dp=edp, ep=ep)
    return EngineLayout(parallel, options, vllm_version, fp8_block(vllm_config))
