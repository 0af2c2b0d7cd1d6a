"""Replay a whole plan inside one process: every rank's compiled program, real tensors.

The in-process hub plays the transport: per round it runs every sender's pack,
copies each message's bytes from the sender's staging span into the
receiver's, then runs every receiver's unpack. It exercises exactly the
compiled programs the distributed engine runs, without processes, so property
tests can check a plan on thousands of random cases.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..plan import BroadcastPlan, RefitPlan
from .broadcast import BroadcastProgram
from .program import CopyPhase, RankProgram


class _Hub:
    """Collects each round's sends and receives from all ranks, then matches them."""

    def __init__(self) -> None:
        self.sends: dict[tuple[int, int], torch.Tensor] = {}
        self.recvs: dict[tuple[int, int], torch.Tensor] = {}

    def transport_for(self, rank: int) -> _HubTransport:
        return _HubTransport(self, rank)

    def deliver(self) -> None:
        if set(self.sends) != set(self.recvs):
            raise AssertionError(
                f"unmatched messages: sends {sorted(set(self.sends) - set(self.recvs))}, "
                f"receives {sorted(set(self.recvs) - set(self.sends))}"
            )
        for key, buf in self.sends.items():
            target = self.recvs[key]
            if target.numel() != buf.numel():
                raise AssertionError(
                    f"message {key}: {buf.numel()} bytes sent, {target.numel()} expected"
                )
            target.copy_(buf)
        self.sends.clear()
        self.recvs.clear()


class _HubTransport:
    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub = hub
        self.rank = rank

    def exchange(self, sends, recvs) -> None:
        for peer, buf in sends:
            self.hub.sends[(self.rank, peer)] = buf
        for peer, buf in recvs:
            self.hub.recvs[(peer, self.rank)] = buf


def simulate_phases(phases_by_rank: Sequence[Sequence[CopyPhase]]) -> None:
    """Run every rank's phases in lock step; phase k of every rank forms one exchange."""
    hub = _Hub()
    steps = {len(p) for p in phases_by_rank}
    if len(steps) != 1:
        raise AssertionError(f"ranks compiled different numbers of phases: {sorted(steps)}")
    with torch.no_grad():
        for k in range(steps.pop()):
            for rank, phases in enumerate(phases_by_rank):
                phase = phases[k]
                phase.pack()
                hub.transport_for(rank).exchange(phase.sends, phase.recvs)
            hub.deliver()
            for phases in phases_by_rank:
                phases[k].unpack()


def simulate_plan(
    plan: RefitPlan,
    sources: Sequence[Mapping[str, torch.Tensor]],
    destinations: Sequence[Mapping[str, torch.Tensor]],
) -> None:
    """Run one refit of ``plan`` from ``sources[s]`` into ``destinations[d]`` in place.
    Each rank's program is compiled on the device its tensors are on (CPU or a GPU: the
    same programs a distributed rank runs there)."""
    s = plan.num_sources
    ranks = [*sources[:s], *destinations[: plan.num_destinations]]
    programs = [RankProgram(plan, r, t, device=tensors_device(t)) for r, t in enumerate(ranks)]
    for p in programs:
        p.prepare()
    simulate_phases([p.rounds for p in programs])
    for p in programs:
        p.finish()


def tensors_device(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    """The device of a rank's first tensor (CPU for a rank that holds none); the program
    refuses a rank with tensors of another device type (``check_live_tensors``)."""
    first = next(iter(tensors.values()), None)
    return torch.device("cpu") if first is None else first.device


def simulate_broadcast(
    plan: BroadcastPlan,
    sources: Sequence[Mapping[str, torch.Tensor]],
    destinations: Sequence[Mapping[str, torch.Tensor]],
) -> None:
    """Run one gather-broadcast refit in place, like :func:`simulate_plan`."""
    tensors = list(sources) + list(destinations)
    programs = [
        BroadcastProgram(plan, r, t, device=tensors_device(t)) for r, t in enumerate(tensors)
    ]
    simulate_phases([p.phases for p in programs])
    for p in programs:
        if p.fp8 is not None:
            p.fp8.run()
