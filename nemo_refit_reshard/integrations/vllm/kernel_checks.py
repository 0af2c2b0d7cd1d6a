"""Refusals of MoE and block-FP8 kernels that re-lay weights after loading (a refit
writes weights in place, as a load gives them): run by ``worker.check_engine``."""

from __future__ import annotations

import torch

from .config import (
    IN_PLACE_FP8_LINEAR_KERNELS,
    IN_PLACE_FP8_MOE_BACKENDS,
    IN_PLACE_MOE_BACKENDS,
    UnsupportedVllmOption,
)


def _first_four(bad: list[str]) -> str:
    """The first offending layers, and how many more (a refusal stays one readable line)."""
    return ", ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else "")


def check_moe_backends(model: torch.nn.Module) -> None:
    """Refuse MoE layers whose backend re-lays the weights after loading."""
    bad = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        backend = getattr(method, "unquantized_backend", None)
        if backend is None:
            continue
        label = getattr(backend, "name", str(backend))
        if label not in IN_PLACE_MOE_BACKENDS:
            bad.append(f"{name}: {label}")
    if bad:
        raise UnsupportedVllmOption(
            "MoE backends that re-lay w13/w2 after loading cannot be refit in place: "
            + _first_four(bad)
            + f"; supported: {sorted(IN_PLACE_MOE_BACKENDS)} (select one with vLLM's MoE "
            "backend setting)"
        )


def check_fp8_kernels(model: torch.nn.Module) -> None:
    """Refuse block-FP8 layers whose kernel processes weights or scales after loading
    (``config.IN_PLACE_FP8_LINEAR_KERNELS`` / ``IN_PLACE_FP8_MOE_BACKENDS``): a refit that
    quantizes in place writes what a load gives, which only those kernels use as is."""
    bad = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kind = type(method).__name__
        if kind == "Fp8LinearMethod":
            label = type(getattr(method, "fp8_linear", None)).__name__
            if label not in IN_PLACE_FP8_LINEAR_KERNELS:
                bad.append(f"{name}: {label}")
        elif kind == "Fp8MoEMethod":
            backend = getattr(method, "fp8_backend", None)
            label = getattr(backend, "name", str(backend))
            if label not in IN_PLACE_FP8_MOE_BACKENDS:
                bad.append(f"{name}: MoE backend {label}")
    if bad:
        raise UnsupportedVllmOption(
            "block-FP8 kernels that re-lay or requantize weights after loading cannot be "
            "refit in place: "
            + _first_four(bad)
            + f"; in place: linear {sorted(IN_PLACE_FP8_LINEAR_KERNELS)}, MoE "
            f"{sorted(IN_PLACE_FP8_MOE_BACKENDS)} (e.g. VLLM_USE_DEEP_GEMM=0)"
        )
