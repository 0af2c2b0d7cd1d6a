"""The case every system's figures read, the figures' shape, and the vLLM worker's side.

A case: one model, Megatron on ``S`` GPUs, vLLM on the same ``S`` GPUs (inference rank
``d`` on training rank ``d``'s GPU: ``Colocation.same_index``), layouts from
``nemo_refit_reshard.runner.build_layouts`` and our colocated plan of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nemo_refit_reshard.layouts import RankLayout
from nemo_refit_reshard.plan import DTYPE_BYTES, Colocation, RefitPlan, plan_refit
from nemo_refit_reshard.runner import RunConfig, build_layouts
from nemo_refit_reshard.spec import InferParallel, TrainParallel
from nemo_refit_reshard.spec.model import ModelSpec


@dataclass
class Case:
    """One configuration, built once; every system reads it."""

    cfg: RunConfig
    spec: ModelSpec
    sources: list[RankLayout]
    destinations: list[RankLayout]
    plan: RefitPlan
    plan_seconds: float

    @property
    def train(self) -> TrainParallel:
        return self.cfg.parallel()[0]

    @property
    def infer(self) -> InferParallel:
        return self.cfg.parallel()[1]

    @property
    def num_gpus(self) -> int:
        return len(self.sources)


def build_case(model: str, train: str, infer: str, bucket_mb: float = 512) -> Case:
    """Layouts and our colocated plan; refused unless both sides use the same GPUs."""
    cfg = RunConfig(model=model, train=train, infer=infer, bucket_mb=bucket_mb)
    spec, sources, destinations = build_layouts(cfg)
    if len(sources) != len(destinations):
        raise ValueError(
            f"{model}: {len(sources)} training ranks, {len(destinations)} inference ranks; "
            "this benchmark puts one of each on every GPU"
        )
    t0 = time.perf_counter()
    colocation = Colocation.same_index(len(sources), len(destinations))
    plan = plan_refit(spec, sources, destinations, bucket_mb, colocation=colocation)
    return Case(cfg, spec, sources, destinations, plan, time.perf_counter() - t0)


@dataclass
class Figures:
    """One system's figures for one case, bytes; each ``*_max`` is the largest over GPUs.

    ``net_total`` / ``net_max``: bytes received over the interconnect (all GPUs / one GPU).
    ``copied_max``: bytes written by device copies on one GPU (both processes on it;
    bytes landing from the interconnect excluded). ``materialized_max``: full HF tensors
    one GPU builds that it did not hold whole. ``extra_max``: peak memory one GPU holds
    beyond both sides' live weights; ``extra_runtime``, when set, names a further term
    only a GPU can tell (printed after the number)."""

    net_total: int
    net_max: int
    copied_max: int
    materialized_max: int
    extra_max: int | None
    extra_runtime: str = ""
    notes: list[str] = field(default_factory=list)


def itemsize(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


def loaded_bytes(layout: RankLayout) -> int:
    """Bytes a vLLM worker's ``load_weights`` writes: every element of its layout that
    comes from a checkpoint tensor (each weight loader copies its narrowed shard once;
    padding rows are filled, not copied)."""
    return sum(p.canonical_box.numel * itemsize(t.dtype) for t in layout.tensors for p in t.pieces)


def param_bytes(layout: RankLayout) -> int:
    """Bytes of a vLLM worker's parameters, padding included."""
    return sum(t.numel * itemsize(t.dtype) for t in layout.tensors)


def vllm_modules(layout: RankLayout) -> tuple[dict[str, str], dict[str, set[str]], dict[str, int]]:
    """vLLM's layers as its layerwise reload sees them (``model_loader/reload``: one
    ``LayerReloadingInfo`` per module owning parameters): ``module_of[canonical]``,
    ``needs[module]`` (the checkpoint names that complete it), ``size[module]`` (bytes
    of its parameters, which ``materialize_layer`` allocates once it is complete)."""
    module_of: dict[str, str] = {}
    needs: dict[str, set[str]] = {}
    size: dict[str, int] = {}
    for t in layout.tensors:
        module = t.name.rsplit(".", 1)[0]
        size[module] = size.get(module, 0) + t.numel * itemsize(t.dtype)
        for p in t.pieces:
            module_of.setdefault(p.canonical, module)
            needs.setdefault(module, set()).add(p.canonical)
    return module_of, needs, size
