"""Both sides of a Megatron -> vLLM refit at once: what every driver, runner and adapter
that plans such a refit builds first."""

from __future__ import annotations

from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel, TrainParallel
from .base import RankLayout
from .megatron import MegatronOptions, megatron_layouts
from .vllm import VllmOptions, vllm_layouts


def refit_layouts(
    spec: ModelSpec,
    train: TrainParallel,
    infer: InferParallel,
    megatron: MegatronOptions | None = None,
    vllm: VllmOptions | None = None,
) -> tuple[list[RankLayout], list[RankLayout]]:
    """``(sources, destinations)``: every Megatron training rank's layout and every vLLM
    inference rank's, each list in rank order (what ``plan_refit`` takes)."""
    return megatron_layouts(spec, train, megatron), vllm_layouts(spec, infer, vllm)
