"""Weight sources for the ``reshard`` trainer weight-transfer engine: one trainer rank's
local tensors plus every trainer rank's layout.

vLLM's own ``WeightSource`` describes parameters as full HF tensors chunked along mesh
axes (``ParamMeta``); Megatron's fused, padded, per-stage tensors are not expressible
there. A :class:`ReshardSource` says instead what this project plans from: every
trainer rank's :class:`RankLayout` (identical on every rank, so each plans alone) and
this rank's live tensors under the layout's names (sent as they are, no gather).

* :class:`MegatronSource`: a live Megatron-core model's local shards (as the NeMo RL
  worker sends them);
* :class:`DTensorSource`: an FSDP2 / DTensor module's local shards;
* :class:`FullModuleSource`: a plain module holding every tensor whole, on each rank.

No vLLM import here: sources are built in the training process.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...layouts import (
    MegatronOptions,
    RankLayout,
    Replicate,
    dtensor_layout,
    megatron_layouts,
)
from ...layouts.dtensor import PlacementFn
from ...plan import PlanError
from ...spec import ModelSpec, TrainParallel
from ..megatron import (
    UNKNOWABLE_OPTIONS,
    live_megatron_options,
    match_layout,
    megatron_live_tensors,
)


class ReshardSource(ABC):
    """One trainer rank's weights in the planner's terms."""

    spec: ModelSpec
    rank: int

    @property
    @abstractmethod
    def world_size(self) -> int:
        """The number of trainer ranks (every one sends its own shards)."""

    @abstractmethod
    def layouts(self) -> list[RankLayout]:
        """Every trainer rank's layout, rank order; the same on every rank."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """This rank's live tensors by layout name (the storage the refit reads)."""


def check_same_plan(fingerprint: str, world_size: int) -> None:
    """Every trainer rank plans alone from its own source; compare the fingerprints over
    ``torch.distributed`` (when there are several ranks and it is initialised) before
    rank 0 ships its plan's slices to the workers. A ``PlanError`` on every rank, in one
    line naming the ranks of each fingerprint, when they differ. (Without
    ``torch.distributed`` the refit group compares them when it loads the plan.)"""
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    from ...engine.refit import fingerprint_disagreement
    from ...engine.rendezvous import gather_texts

    detail = fingerprint_disagreement(gather_texts(fingerprint))
    if detail is not None:
        raise PlanError(
            f"trainer ranks planned different refits ({detail}): every rank's source must "
            "give the same layouts (MegatronSource: pass the same options on every rank)"
        )


class MegatronSource(ReshardSource):
    """A live Megatron-core model (or its virtual-pipeline chunks) on trainer rank
    ``rank`` of ``parallel``. ``options``: the layout options; default: what the model
    itself decides (``live_megatron_options``) — pass ``make_vocab_size_divisible_by``
    when it is not Megatron's default, one rank's shapes cannot tell it."""

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        spec: ModelSpec,
        parallel: TrainParallel,
        rank: int,
        options: MegatronOptions | None = None,
        **option_overrides: Any,
    ) -> None:
        self.model, self.spec, self.parallel, self.rank = model, spec, parallel, rank
        if options is None:
            live = {**live_megatron_options(model), **option_overrides}
            unknown = [k for k in UNKNOWABLE_OPTIONS if live.get(k) is None]
            if unknown:
                raise ValueError(
                    f"Megatron trainer rank {rank} cannot tell {', '.join(unknown)} from its "
                    "own parameters (it holds no such layers and its model has no config "
                    "saying): pass them to MegatronSource, the same on every rank"
                )
            options = MegatronOptions(**live)
        self.options = options

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def layouts(self) -> list[RankLayout]:
        return megatron_layouts(self.spec, self.parallel, self.options)

    def tensors(self) -> dict[str, torch.Tensor]:
        layout = self.layouts()[self.rank]
        return match_layout(megatron_live_tensors(self.model), layout)


def _local(value: torch.Tensor) -> torch.Tensor:
    # A DTensor's local shard is its storage (no gather); plain tensors pass through.
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value


def _module_tensors(
    module: torch.nn.Module | Mapping[str, torch.Tensor], layout: RankLayout, what: str
) -> dict[str, torch.Tensor]:
    """The layout's tensors of ``module`` (parameters and buffers, HF names)."""
    if isinstance(module, torch.nn.Module):
        live = dict(module.state_dict(keep_vars=True))
    else:
        live = dict(module)
    wanted = [t.name for t in layout.tensors]
    missing = [n for n in wanted if n not in live]
    if missing:
        raise PlanError.listing(
            f"{what} rank {layout.rank}: tensors the layout needs are not in the module",
            [f"{n}: missing" for n in missing],
            "name the module's tensors as the Hugging Face checkpoint does",
        )
    return {n: _local(live[n]) for n in wanted}


class DTensorSource(ReshardSource):
    """An FSDP2 / DTensor module (HF tensor names) on rank ``rank`` of a device mesh of
    ``mesh_shape``; ``placements`` maps each canonical tensor to its placements
    (``layouts.fsdp2_placements(mesh_shape)``, ``fsdp2_tp_placements(tp)``, ...)."""

    def __init__(
        self,
        module: torch.nn.Module | Mapping[str, torch.Tensor],
        spec: ModelSpec,
        mesh_shape: Sequence[int],
        rank: int,
        placements: PlacementFn,
    ) -> None:
        self.module, self.spec, self.rank = module, spec, rank
        self.mesh_shape, self.placements = tuple(mesh_shape), placements

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def layouts(self) -> list[RankLayout]:
        return [
            dtensor_layout(self.spec, self.mesh_shape, r, self.placements)
            for r in range(self.world_size)
        ]

    def tensors(self) -> dict[str, torch.Tensor]:
        layout = dtensor_layout(self.spec, self.mesh_shape, self.rank, self.placements)
        return _module_tensors(self.module, layout, "DTensor")


class FullModuleSource(DTensorSource):
    """A plain module (HF tensor names) holding every tensor whole, replicated on each of
    ``world_size`` trainer ranks: the planner spreads the sending over the replicas."""

    def __init__(
        self,
        module: torch.nn.Module | Mapping[str, torch.Tensor],
        spec: ModelSpec,
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__(module, spec, (world_size,), rank, lambda t: (Replicate(),))
