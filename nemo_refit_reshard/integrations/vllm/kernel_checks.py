"""Refusals of MoE and block-FP8 kernels that re-lay weights after loading (a refit
writes weights in place, as a load gives them): run by ``worker.check_engine``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .config import (
    IN_PLACE_FP8_LINEAR_KERNELS,
    IN_PLACE_FP8_MOE_BACKENDS,
    IN_PLACE_MOE_BACKENDS,
    UnsupportedVllmOption,
)


def _refuse_relaying(
    model: torch.nn.Module, relays: Callable[[Any], str | None], refusal: str, allowed: str
) -> None:
    """Raise :class:`UnsupportedVllmOption` if any module's quant method re-lays its
    weights after loading (``relays(method)`` says how, None where it keeps them as
    loaded): ``refusal``, the first four such modules and how many more (the refusal
    stays one readable line), then ``allowed``, what would serve."""
    bad = []
    for name, module in model.named_modules():
        how = relays(getattr(module, "quant_method", None))
        if how is not None:
            bad.append(f"{name}: {how}")
    if bad:
        more = f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""
        raise UnsupportedVllmOption(refusal + ", ".join(bad[:4]) + more + allowed)


def _moe_relayout(method: Any) -> str | None:
    """The unquantized MoE backend of ``method`` if it is not one that keeps w13/w2."""
    backend = getattr(method, "unquantized_backend", None)
    if backend is None:
        return None
    label = getattr(backend, "name", str(backend))
    return None if label in IN_PLACE_MOE_BACKENDS else label


def check_moe_backends(model: torch.nn.Module) -> None:
    """Refuse MoE layers whose backend re-lays the weights after loading."""
    _refuse_relaying(
        model,
        _moe_relayout,
        "MoE backends that re-lay w13/w2 after loading cannot be refit in place: ",
        f"; supported: {sorted(IN_PLACE_MOE_BACKENDS)} (select one with vLLM's MoE "
        "backend setting)",
    )


def _fp8_relayout(method: Any) -> str | None:
    """The kernel of a block-FP8 linear or the backend of a block-FP8 MoE layer if it
    processes weights or scales after loading."""
    kind = type(method).__name__
    if kind == "Fp8LinearMethod":
        label = type(getattr(method, "fp8_linear", None)).__name__
        return None if label in IN_PLACE_FP8_LINEAR_KERNELS else label
    if kind == "Fp8MoEMethod":
        backend = getattr(method, "fp8_backend", None)
        label = getattr(backend, "name", str(backend))
        return None if label in IN_PLACE_FP8_MOE_BACKENDS else f"MoE backend {label}"
    return None


def check_fp8_kernels(model: torch.nn.Module) -> None:
    """Refuse block-FP8 layers whose kernel processes weights or scales after loading
    (``config.IN_PLACE_FP8_LINEAR_KERNELS`` / ``IN_PLACE_FP8_MOE_BACKENDS``): a refit that
    quantizes in place writes what a load gives, which only those kernels use as is."""
    _refuse_relaying(
        model,
        _fp8_relayout,
        "block-FP8 kernels that re-lay or requantize weights after loading cannot be "
        "refit in place: ",
        f"; in place: linear {sorted(IN_PLACE_FP8_LINEAR_KERNELS)}, MoE "
        f"{sorted(IN_PLACE_FP8_MOE_BACKENDS)} (e.g. VLLM_USE_DEEP_GEMM=0)",
    )
