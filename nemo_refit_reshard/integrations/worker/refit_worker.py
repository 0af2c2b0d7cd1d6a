"""Worker-side refit API, framework neutral: what a training or generation worker calls.

The driver (NeMo RL's or veRL's controller, or the CLI's local runner) builds the
plan once from every rank's layout and ships its JSON to every worker, together with
a :class:`~.endpoint.RefitEndpoint` (the refit group's rendezvous address and this
worker's rank in it). A worker then::

    worker = RefitWorker(endpoint, dict(model.named_parameters()))
    worker.join()                 # rendezvous: every rank of the refit group
    worker.load_plan(plan_json)   # check fingerprints + live tensors, compile
    ...
    worker.refit()                # every training step, on every rank

Training workers send from their parameters; generation workers receive into
theirs, in place. Nothing here knows Megatron, vLLM or Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...engine.delta import DeltaOptions
from ...engine.host_staged import HostStagedTransport
from ...engine.refit import Refitter, StepTiming
from ...engine.transport import GlooTransport, Transport
from ...plan import BroadcastPlan, RankPlan, RefitPlan, load_plan_json
from .endpoint import RefitEndpoint
from .weights import WeightsState


def describe_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Name -> ``[shape, dtype]`` of a worker's live tensors, for the driver to check."""
    return {
        name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()
    }


class RefitWorker:
    """One worker's membership in the refit group."""

    def __init__(
        self,
        endpoint: RefitEndpoint,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device | str | None = None,
        overlap: bool | None = None,
        host_staged: bool | None = None,
        weights: WeightsState | None = None,
        delta: DeltaOptions | None = None,
    ) -> None:
        """``overlap``: overlapped replay (``engine/pipeline.py``); None: on for CUDA.
        ``host_staged``: exchange through pinned host copies of the staging buffers
        (``engine/host_staged.py``, gloo only); None: when the tensors are on a GPU.
        ``weights``: the tensors' version and staleness (kept across memberships).
        ``delta``: refit the reshard backend with deltas (``engine/delta/program.py``); every
        rank of the group alike (default: the endpoint's)."""
        self.endpoint = endpoint
        self.tensors = tensors
        self.weights = weights if weights is not None else WeightsState()
        self._loaded: tuple | None = None
        self.overlap = overlap
        self.host_staged = host_staged
        self.delta = delta if delta is not None else endpoint.delta
        first = next(iter(tensors.values()), None)
        self.device = (
            torch.device(device)
            if device is not None
            else (first.device if first is not None else torch.device("cpu"))
        )
        self.transport: Transport | None = None
        self.refitter: Refitter | None = None

    def join(self) -> None:
        """Rendezvous with every other rank of the refit group (blocks up to the timeout)."""
        e = self.endpoint
        if e.transport == "gloo":
            gloo = GlooTransport(
                e.host, e.port, e.group_rank, e.world_size, e.timeout_s, e.connect_timeout_s,
                secret=e.secret,
            )  # fmt: skip
            # gloo moves host memory: tensors on a GPU go through pinned host copies.
            staged = self.host_staged
            if staged is None:
                staged = self.device.type == "cuda"
            self.transport = HostStagedTransport(gloo) if staged else gloo
        else:
            if self.host_staged:
                raise ValueError("host staging goes with the gloo transport, not cupy-nccl")
            from ...engine.cupy_nccl import CupyNcclTransport

            self.transport = CupyNcclTransport(
                e.host, e.port, e.group_rank, e.world_size, self.device.index, e.timeout_s,
                connect_timeout_s=e.connect_timeout_s, secret=e.secret,
            )  # fmt: skip

    def load_plan(
        self,
        plan: RefitPlan | RankPlan | str,
        backend: str = "reshard",
        broadcast_plan: BroadcastPlan | None = None,
    ) -> None:
        """Check that every rank holds this plan and that the live tensors match it, then
        compile this rank's program. ``plan`` is the full plan or this rank's slice
        (``RankPlan``), as an object or JSON. Collective: every rank must call it."""
        if self.transport is None:
            raise RuntimeError("call join() before load_plan()")
        if isinstance(plan, str):
            plan = load_plan_json(plan)
        world = plan.num_sources + plan.num_destinations
        if world != self.endpoint.world_size:
            raise ValueError(
                f"the plan spans {world} ranks but this refit group has "
                f"{self.endpoint.world_size}; build the plan for this group"
            )
        self.refitter = Refitter(
            plan,
            self.endpoint.group_rank,
            self.tensors,
            self.transport,
            backend,
            broadcast_plan,
            self.device,
            self.overlap,
            self.delta if backend == "reshard" else None,
        )
        self._loaded = (plan, backend, broadcast_plan)

    def refit(self, step: int | None = None, refitter: Refitter | None = None) -> StepTiming:
        """One refit step (collective over the refit group), versioned: the weights are
        stale from here until it completes, and stay stale if it fails (the error is
        raised). ``step`` defaults to the last complete one plus one; ``refitter`` to the
        last loaded plan's. After a failed step the group is unusable: every later
        refit, barrier or plan load raises ``GroupUnusableError`` naming the failed step
        until :meth:`rejoin` (the messages of that step may still be in flight; the
        transport tags each message with the group's step and round, so none can pair
        with a later step's)."""
        refitter = refitter or self.refitter
        if refitter is None:
            raise RuntimeError("call load_plan() before refit()")
        step = step if step is not None else (self.weights.step or 0) + 1
        fingerprint = refitter.plan.fingerprint
        self.weights.begin(step, fingerprint)
        try:
            timing = refitter.refit(step)
        except BaseException as err:
            self.weights.failed(step, err)
            raise
        self.weights.done(step, fingerprint)
        return timing

    def rejoin(
        self,
        endpoint: RefitEndpoint,
        plan: RefitPlan | RankPlan | str | None = None,
        version: int | None = None,
    ) -> None:
        """Join a new refit group (after a failed one: a replaced peer, a new port and
        secret; or engines fenced or admitted, ``integrations/worker/membership.py``) and
        load ``plan`` — the plan for that group — or, if None, the same plan again.
        Collective over the new group. Stale weights stay stale until the next refit
        succeeds. ``version``: every party of the new group holds that step's weights
        whole (the driver knows: engines admitted between steps), so a delta refit's
        first step on the new plan goes as deltas (``Refitter.prime``); a rank whose
        weights are not that version whole (by its own record) stays dense."""
        self.close()
        self.endpoint = endpoint
        self.join()
        if plan is not None:
            self.load_plan(plan)
        elif self._loaded is not None:
            self.load_plan(*self._loaded)
        if version is not None and self.refitter is not None:
            if self.weights.fresh and self.weights.step == version:
                self.refitter.prime(version)

    def forget_version(self) -> None:
        """The live tensors no longer hold the last refit (an engine woken from sleep mode
        with its weights discarded, a reload): the next delta refit sends this rank
        everything."""
        if self.refitter is not None:
            self.refitter.forget_version()

    def barrier(self) -> None:
        if self.transport is None:
            raise RuntimeError("call join() first")
        self.transport.barrier()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
