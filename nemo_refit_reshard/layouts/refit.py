"""Both sides of a Megatron -> inference-engine refit at once: what every driver, runner
and adapter that plans such a refit builds first."""

from __future__ import annotations

from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel, TrainParallel
from .base import RankLayout
from .fp8_wire import wire_layouts
from .megatron import MegatronOptions, megatron_layouts
from .sglang import sglang_layout
from .vllm import vllm_layouts
from .vllm_releases import VllmOptions

INFER_ENGINES = ("vllm", "sglang")


def engine_layouts(
    spec: ModelSpec, infer: InferParallel, engine: str = "vllm", vllm: VllmOptions | None = None
) -> list[RankLayout]:
    """Every inference rank's layout, in rank order, for ``engine`` (``vllm`` or
    ``sglang``). ``vllm``'s ``params_dtype`` (default: the checkpoint dtype) is the
    local tensors' dtype and its ``pp_layer_partition`` the stages' layer counts
    (``VLLM_PP_LAYER_PARTITION`` / ``SGLANG_PP_LAYER_PARTITION``) for either engine; its
    other options are vLLM's own."""
    if engine == "vllm":
        return vllm_layouts(spec, infer, vllm)
    if engine != "sglang":
        raise ValueError(f"unknown inference engine {engine!r}; choose from {INFER_ENGINES}")
    dtype = (vllm.params_dtype if vllm is not None else None) or spec.arch.dtype
    out: list[RankLayout] = []
    for rank in range(infer.world_size):
        partition = vllm.pp_layer_partition if vllm is not None else None
        layout = sglang_layout(spec, infer, rank, dtype, pp_layer_partition=partition)
        first = layout.replicas[0]
        # A replica shares its first member's tensors (as vllm_layouts does): the planner
        # recognises it at once, and replicas cost one replica's memory.
        if first != rank:
            layout = RankLayout(
                framework=layout.framework,
                rank=rank,
                world_size=layout.world_size,
                position=layout.position,
                replicas=layout.replicas,
                tensors=out[first].tensors,
            )
        out.append(layout)
    return out


def refit_layouts(
    spec: ModelSpec,
    train: TrainParallel,
    infer: InferParallel,
    megatron: MegatronOptions | None = None,
    vllm: VllmOptions | None = None,
    fp8_on_wire: bool = True,
    engine: str = "vllm",
) -> tuple[list[RankLayout], list[RankLayout]]:
    """``(sources, destinations)``: every Megatron training rank's layout and every
    inference rank's (``engine``: vLLM's or SGLang's), each list in rank order (what
    ``plan_refit`` takes). For a block-FP8 engine both are as the wire carries them
    (``fp8_wire.wire_layouts``): training ranks quantize the weights they hold in whole
    blocks and send e4m3 + scales, the rest crosses in the trained dtype and the
    inference ranks quantize it (all of it with ``fp8_on_wire=False``)."""
    sources = megatron_layouts(spec, train, megatron)
    destinations = engine_layouts(spec, infer, engine, vllm)
    if spec.arch.quant is not None:
        shadow = vllm.params_dtype if vllm is not None else None
        sources, destinations, _ = wire_layouts(spec, sources, destinations, shadow, fp8_on_wire)
    return sources, destinations
