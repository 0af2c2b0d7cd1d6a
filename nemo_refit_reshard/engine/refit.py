"""A rank's handle on refit: check the plan, compile, replay each step.

``Refitter`` is what training and inference workers hold. It refuses to start
unless every rank of the refit group holds a plan with the same fingerprint
(the plan is built once and shipped, never rebuilt differently per rank).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..plan import BroadcastPlan, PlanError, RankPlan, RefitPlan
from .broadcast import BroadcastProgram
from .delta import UNKNOWN, DeltaOptions, DeltaProgram, DeltaStats
from .program import RankProgram
from .transport import Transport

BACKENDS = ("reshard", "broadcast")


@dataclass(frozen=True)
class StepTiming:
    seconds: float  # wall time of the whole step on this rank
    exchange_seconds: float  # time inside transport.exchange (waiting on the wire and peers)

    @property
    def host_seconds(self) -> float:
        """Pack/unpack and bookkeeping: the part of a step that is this rank's own work."""
        return self.seconds - self.exchange_seconds


class _TimedTransport:
    """Wraps a transport to measure time spent inside it (issuing and waiting)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.seconds = 0.0

    def start_exchange(self, sends, recvs, round_index: int = 0) -> _TimedPending:
        t0 = time.perf_counter()
        pending = self.inner.start_exchange(sends, recvs, round_index)
        self.seconds += time.perf_counter() - t0
        return _TimedPending(self, pending)

    def exchange(self, sends, recvs, round_index: int = 0) -> None:
        self.start_exchange(sends, recvs, round_index).wait()


class _TimedPending:
    def __init__(self, timed: _TimedTransport, inner) -> None:
        self.timed, self.inner = timed, inner

    def wait(self) -> None:
        t0 = time.perf_counter()
        self.inner.wait()
        self.timed.seconds += time.perf_counter() - t0


def fingerprint_disagreement(prints: list[str]) -> str | None:
    """``"ranks [0, 2]: fp; ranks [1]: fp'"`` for each rank's plan fingerprint, or None
    when every rank holds the same plan."""
    if len(set(prints)) == 1:
        return None
    groups: dict[str, list[int]] = {}
    for rank, fp in enumerate(prints):
        groups.setdefault(fp, []).append(rank)
    return "; ".join(f"ranks {ranks}: {fp}" for fp, ranks in sorted(groups.items()))


def check_same_fingerprint(transport: Transport, fingerprint: str) -> None:
    """Raise ``PlanError`` on every rank if any rank's plan fingerprint differs."""
    detail = fingerprint_disagreement(transport.all_gather_object_str(fingerprint))
    if detail is not None:
        raise PlanError(
            f"refit ranks hold different plans ({detail}); build the plan once (on the driver "
            "or rank 0) and ship the same plan file to every rank"
        )


class Refitter:
    """Compiled refit for one rank of the refit group."""

    def __init__(
        self,
        plan: RefitPlan | RankPlan,
        group_rank: int,
        tensors: Mapping[str, torch.Tensor],
        transport: Transport,
        backend: str = "reshard",
        broadcast_plan: BroadcastPlan | None = None,
        device: torch.device | str = "cpu",
        overlap: bool | None = None,
        delta: DeltaOptions | None = None,
    ) -> None:
        """``overlap``: pack/unpack of neighbouring rounds overlap the wire
        (``engine/pipeline.py``; two staging sets). Default: on for CUDA, off on CPU.
        ``delta``: send each message in its smallest form (``engine/delta/program.py``; the
        reshard backend only, on every rank of the group or none)."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown refit backend {backend!r}; choose one of {BACKENDS}")
        if delta is not None and backend != "reshard":
            raise ValueError("delta refit runs on the reshard backend; drop delta or backend")
        check_same_fingerprint(transport, plan.fingerprint)
        self.backend = backend
        self.transport = transport
        self.plan = plan
        if backend == "reshard":
            if overlap is None:
                overlap = torch.device(device).type == "cuda"
            self.program: RankProgram | BroadcastProgram = RankProgram(
                plan, group_rank, tensors, device, overlap
            )
        else:
            if broadcast_plan is None:
                raise ValueError("backend 'broadcast' needs the broadcast plan")
            self.program = BroadcastProgram(broadcast_plan, group_rank, tensors, device)
        self.delta: DeltaProgram | None = None
        mine = "[]"
        if delta is not None:
            assert isinstance(self.program, RankProgram)
            self.delta = DeltaProgram(self.program, plan, delta)
            mine = json.dumps([self.delta.check, self.delta.fixed_in])
        # One gather, on every rank alike: whether each rank refits with deltas and, if
        # so, whether it asks for the base check (engine/delta/check.py: a collective
        # step, on only when every rank asks) and which bytes of its messages it cannot
        # re-pack (engine/delta/rounds.py).
        shared = transport.all_gather_object_str(f"{int(delta is not None)}{mine}")
        modes = {text[0] for text in shared}
        if len(modes) > 1:
            on = [r for r, text in enumerate(shared) if text[0] == "1"]
            raise PlanError(
                f"refit ranks {on} refit with deltas and the others do not; turn delta refit "
                "on for every rank of the group or for none"
            )
        if self.delta is not None:
            wishes = [json.loads(text[1:]) for text in shared]
            self.delta.check = all(check for check, _ in wishes)
            self.delta.learn_fixed([fixed for _, fixed in wishes])

    def refit(self, step: int | None = None) -> StepTiming:
        """Run one refit step (the caller's ``step``, named in errors); returns this
        rank's timing. Any failure makes the group unusable on this rank: every later
        step raises ``GroupUnusableError`` naming this one, until the group is re-joined
        (``engine/transport.py``)."""
        timed = _TimedTransport(self.transport)
        t0 = time.perf_counter()
        self.transport.begin_step(step)
        try:
            if self.delta is None:
                self.program.replay(timed)  # type: ignore[arg-type]
            else:
                self.delta_replay(timed)
        except BaseException as err:
            self.transport.fail_step(err)
            raise
        return StepTiming(time.perf_counter() - t0, timed.seconds)

    def delta_replay(self, timed: _TimedTransport) -> DeltaStats:
        """A delta step: every rank's version (one gather), then the rounds."""
        assert self.delta is not None
        mine = str(self.delta.version)
        versions = self.delta.gather_versions(
            lambda: [int(v) for v in self.transport.all_gather_object_str(mine)]
        )
        return self.delta.replay(timed, versions)  # type: ignore[arg-type]

    def prime(self, version: int) -> bool:
        """Every rank of the group holds ``version`` whole (``DeltaProgram.prime``): the
        next delta step starts from it. False without delta, or where it cannot."""
        return self.delta.prime(version) if self.delta is not None else False

    def forget_version(self) -> None:
        """This rank's weights no longer hold the last refit's version (a restarted or
        slept engine): its next delta step is dense."""
        if self.delta is not None:
            self.delta.version = UNKNOWN
