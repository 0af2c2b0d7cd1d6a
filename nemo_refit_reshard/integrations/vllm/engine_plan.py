"""The plan of the vLLM-native ``reshard`` backend: a trainer source to one vLLM engine.

No vLLM import: every trainer rank plans alone and identically from what the init info
states (``transfer_trainer.py``), and tests plan the same way without vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...layouts import VllmOptions, vllm_layouts
from ...layouts.fp8_wire import wire_layouts
from ...plan import Colocation, RefitPlan, plan_refit
from ...spec import InferParallel
from ...spec.quantization import quantization_from_hf_config
from .transfer_sources import ReshardSource


def plan_for_engine(
    source: ReshardSource,
    infer: InferParallel,
    options: VllmOptions,
    bucket_mb: float = 512,
    quantization: Mapping[str, Any] | None = None,
    colocated_hosts: tuple[int, ...] | None = None,
) -> RefitPlan:
    """The refit plan from ``source``'s trainer layouts to one vLLM engine of ``infer``.

    ``quantization``: the engine's ``quantization_config`` when it quantizes what the
    trainer holds unquantized; block FP8 plans e4m3 + scales on the wire where trainer
    ranks hold whole blocks (``layouts/fp8_wire.py``), any other method is refused by
    name (``spec/quantization.py``). ``colocated_hosts``: a colocated refit, engine rank
    ``d`` on trainer rank ``colocated_hosts[d]``'s GPU (``()``: rank ``d``'s)."""
    if infer.dp != 1:
        raise ValueError(
            f"vllm_parallel dp={infer.dp}: one reshard engine serves one vLLM engine per "
            "client (its data-parallel ranks inside: engine_dp)"
        )
    spec = source.spec
    if quantization:
        quant = quantization_from_hf_config({"quantization_config": dict(quantization)})
        spec = spec.unquantized().quantized(quant) if quant is not None else spec
    sources, destinations = source.layouts(), vllm_layouts(spec, infer, options)
    if spec.arch.quant is not None:
        sources, destinations, _ = wire_layouts(spec, sources, destinations, options.params_dtype)
    colocation = None
    if colocated_hosts is not None:
        s, d = len(sources), len(destinations)
        colocation = Colocation(colocated_hosts) if colocated_hosts else Colocation.same_index(s, d)
    return plan_refit(spec, sources, destinations, bucket_mb=bucket_mb, colocation=colocation)


__all__ = ["plan_for_engine"]
