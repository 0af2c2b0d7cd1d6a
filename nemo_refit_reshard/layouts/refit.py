"""Both sides of a Megatron -> vLLM refit at once: what every driver, runner and adapter
that plans such a refit builds first."""

from __future__ import annotations

from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel, TrainParallel
from .base import RankLayout
from .fp8_wire import wire_layouts
from .megatron import MegatronOptions, megatron_layouts
from .vllm import vllm_layouts
from .vllm_releases import VllmOptions


def refit_layouts(
    spec: ModelSpec,
    train: TrainParallel,
    infer: InferParallel,
    megatron: MegatronOptions | None = None,
    vllm: VllmOptions | None = None,
    fp8_on_wire: bool = True,
) -> tuple[list[RankLayout], list[RankLayout]]:
    """``(sources, destinations)``: every Megatron training rank's layout and every vLLM
    inference rank's, each list in rank order (what ``plan_refit`` takes). For a block-FP8
    engine both are as the wire carries them (``fp8_wire.wire_layouts``): training ranks
    quantize the weights they hold in whole blocks and send e4m3 + scales, the rest
    crosses in the trained dtype and the inference ranks quantize it (all of it with
    ``fp8_on_wire=False``)."""
    sources = megatron_layouts(spec, train, megatron)
    destinations = vllm_layouts(spec, infer, vllm)
    if spec.arch.quant is not None:
        shadow = vllm.params_dtype if vllm is not None else None
        sources, destinations, _ = wire_layouts(spec, sources, destinations, shadow, fp8_on_wire)
    return sources, destinations
