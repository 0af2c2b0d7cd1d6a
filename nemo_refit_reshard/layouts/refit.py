"""Both sides of a Megatron -> vLLM refit at once: what every driver, runner and adapter
that plans such a refit builds first."""

from __future__ import annotations

from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel, TrainParallel
from .base import RankLayout
from .megatron import MegatronOptions, megatron_layouts
from .vllm import VllmOptions, vllm_layouts
from .vllm_fp8 import bf16_twin


def refit_layouts(
    spec: ModelSpec,
    train: TrainParallel,
    infer: InferParallel,
    megatron: MegatronOptions | None = None,
    vllm: VllmOptions | None = None,
) -> tuple[list[RankLayout], list[RankLayout]]:
    """``(sources, destinations)``: every Megatron training rank's layout and every vLLM
    inference rank's, each list in rank order (what ``plan_refit`` takes). For a block-FP8
    engine the destinations are its BF16 twins (``vllm_fp8.bf16_twin``): the refit moves
    the trained weights and each receiving rank quantizes them into its FP8 parameters."""
    sources = megatron_layouts(spec, train, megatron)
    destinations = vllm_layouts(spec, infer, vllm)
    if spec.arch.quant is not None:
        twin = vllm.params_dtype if vllm is not None else None
        destinations = [bf16_twin(d, spec, twin) for d in destinations]
    return sources, destinations
