"""Engines come and go between steps: the driver's one view of who holds what.

A refit group is fixed once joined; the inference side of a *run* is not. Between two
steps the driver may

* **fence** an engine that failed a step (a rank dead, hung past its deadline, or
  raising): it receives nothing more, and its weights stay as the failed step left
  them — stale, never served (its ranks' :class:`~.weights.WeightsState` says so);
* **admit** an engine (new, or restarted): a group of the training ranks and that
  engine alone refits it to the version the others hold (:meth:`Membership.catch_up`),
  the others untouched; from the next step it is in the plan.

Each change is a new refit group (:meth:`Membership.group`: a new port and secret, the
plan for the engines in it from :class:`~...plan.membership.MembershipPlans`, derived
and cached). Training ranks keep their refit ranks; an engine's ranks are numbered
after them in engine order. Every party of the new group calls
:meth:`~.refit_worker.RefitWorker.rejoin` with its endpoint and the plan; a step that
failed is then refit again for the engines left (their weights, torn by the failed
step, are stale until it completes).

:func:`engines_to_fence` reads a failed step's outcomes: the engines with a rank dead
or silent past the deadline; if none, those with a rank that raised something other
than the transport's error a peer's failure causes. A training rank that fails is not
an engine's failure: the run cannot go on without it (:class:`TrainingRankFailed`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ...engine.delta import DeltaOptions
from ...engine.rendezvous import new_rendezvous
from ...plan.membership import MemberPlan, MembershipPlans
from .endpoint import RefitEndpoint

SERVING, FENCED, JOINING = "serving", "fenced", "joining"
# How a party's call ended: "ok", "dead" (its process is gone), "silent" (no answer by
# the deadline), or "raised <ExceptionType>: <first line>".
OK, DEAD, SILENT = "ok", "dead", "silent"
# what a rank raises when a peer fails it (GroupUnusableError: a step of its group failed)
PEER_FAILURES = ("raised TransportError", "raised GroupUnusableError")


class TrainingRankFailed(RuntimeError):
    """A training rank failed a refit: no membership change can go on without it."""


@dataclass
class EngineRecord:
    """One engine as the driver sees it."""

    engine: int
    ranks: tuple[int, ...]  # its destination indices in the full plan
    status: str = SERVING
    version: int | None = None  # the step whose weights it holds whole; None: none yet
    note: str = ""  # why it was fenced, or when it was admitted

    def row(self) -> str:
        version = "-" if self.version is None else str(self.version)
        ranks = f"{self.ranks[0]}-{self.ranks[-1]}" if len(self.ranks) > 1 else str(self.ranks[0])
        return f"{self.engine:>6}  {ranks:>9}  {self.status:<8}  {version:>7}  {self.note}"


@dataclass(frozen=True)
class RefitGroup:
    """One refit group of a run: its plan and every party's endpoint.

    Parties are ``("training", r)`` and ``("engine", e, i)`` (rank ``i`` of engine
    ``e``)."""

    plan: MemberPlan
    endpoints: dict[tuple, RefitEndpoint]
    # the step every party holds whole when it joins (a group made between steps), or
    # None: a delta refit may start from it (``RefitWorker.rejoin(..., version)``)
    version: int | None = None

    @property
    def engines(self) -> tuple[int, ...]:
        return self.plan.engines


@dataclass
class Membership:
    """Which engines are in the run, what each holds, and the groups that refit them.

    ``timeout_s`` / ``connect_timeout_s`` / ``transport`` go into every endpoint, as
    :class:`RefitEndpoint` documents them."""

    plans: MembershipPlans
    host: str = "127.0.0.1"
    timeout_s: float = 60.0
    connect_timeout_s: float | None = None
    transport: str = "gloo"
    delta: DeltaOptions | None = (
        None  # delta refit on every rank (the first step of a group is dense)
    )
    derive_ahead: bool = True  # derive the plans for one engine fewer in a thread
    engines: dict[int, EngineRecord] = field(init=False)
    groups_made: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.engines = {
            e: EngineRecord(e, tuple(ranks)) for e, ranks in enumerate(self.plans.engines)
        }

    @property
    def serving(self) -> tuple[int, ...]:
        return tuple(e for e, r in self.engines.items() if r.status == SERVING)

    def group(
        self, engines: tuple[int, ...] | None = None, version: int | None = None
    ) -> RefitGroup:
        """A new refit group for ``engines`` (default: those serving) and the training
        ranks: a new port and secret, the plan for those engines. ``version``: the step
        every party holds whole (see :class:`RefitGroup`)."""
        engines = self.serving if engines is None else tuple(sorted(engines))
        if not engines:
            raise RuntimeError(
                "no engine is serving: admit one (Membership.admit) before the next refit"
            )
        fewer = [tuple(x for x in engines if x != e) for e in engines] if len(engines) > 1 else []
        self.plans.keep_only([engines, *fewer])  # what the next failure can need
        made = self.plans.for_engines(engines)
        if self.derive_ahead and fewer:  # a failure next finds its plan ready
            self.plans.derive_ahead(fewer)
        plan = made.plan
        world = plan.num_sources + plan.num_destinations
        rdv = new_rendezvous(self.host)
        self.groups_made += 1

        def endpoint(rank: int) -> RefitEndpoint:
            return RefitEndpoint(
                rdv.ip, rdv.port, world, rank, self.transport, self.timeout_s,
                self.connect_timeout_s, secret=rdv.secret, delta=self.delta,
            )  # fmt: skip

        endpoints: dict[tuple, RefitEndpoint] = {
            ("training", r): endpoint(r) for r in range(plan.num_sources)
        }
        for e in engines:
            for i, d in enumerate(self.engines[e].ranks):
                endpoints[("engine", e, i)] = endpoint(made.refit_rank(d))
        return RefitGroup(made, endpoints, version)

    def refitted(self, engines: tuple[int, ...], step: int) -> None:
        """``engines`` completed the refit of ``step``: they hold it whole."""
        for e in engines:
            record = self.engines[e]
            record.version = step
            if record.status == JOINING:
                record.status, record.note = SERVING, f"caught up to step {step}"

    def fence(self, engine: int, why: str) -> None:
        """``engine`` receives nothing more; what it holds is stale from now on."""
        record = self.engines[engine]
        record.status, record.version, record.note = FENCED, None, why

    def admit(self, engine: int) -> None:
        """``engine`` (fenced, or never started) joins: its weights are none of ours until
        its catch-up refit completes (:meth:`catch_up`)."""
        record = self.engines[engine]
        if record.status == SERVING:
            raise ValueError(f"engine {engine} is already serving; fence it before admitting")
        record.status, record.version, record.note = JOINING, None, "catching up"

    def catch_up(self, engine: int) -> RefitGroup:
        """The group that refits a joining ``engine`` alone."""
        if self.engines[engine].status != JOINING:
            raise ValueError(f"engine {engine} is not joining: admit it first")
        return self.group((engine,))

    def __str__(self) -> str:
        head = f"{'engine':>6}  {'ranks':>9}  {'status':<8}  {'version':>7}  note"
        return "\n".join([head, *(r.row() for r in self.engines.values())])


def engines_to_fence(outcomes: Mapping[tuple, str]) -> dict[int, str]:
    """The engines a failed step's outcomes blame (module docstring), each with why.

    ``outcomes``: per party (:class:`RefitGroup`'s keys), how its call ended."""
    failed = {p: o for p, o in outcomes.items() if o != OK}
    for party, outcome in sorted(failed.items()):
        if party[0] == "training" and not outcome.startswith(PEER_FAILURES):
            raise TrainingRankFailed(
                f"training rank {party[1]} failed the refit ({outcome}): the run cannot "
                "continue without it; restart the run from its last checkpoint"
            )
    blamed: dict[int, str] = {}
    for kinds in ((DEAD, SILENT), None):
        for party, outcome in sorted(failed.items()):
            if party[0] != "engine" or party[1] in blamed:
                continue
            culprit = outcome in kinds if kinds else not outcome.startswith(PEER_FAILURES)
            if culprit:
                blamed[party[1]] = f"rank {party[2]} {outcome}"
        if blamed:
            return blamed
    return blamed


class Parties(Protocol):
    """How a driver reaches the parties of a group (Ray actors, processes, ...): each
    call runs on every party of ``group`` at once and returns, per party, how it ended
    (``OK``, ``DEAD``, ``SILENT`` by the deadline, or ``"raised <Type>: <line>"``)."""

    def join(self, group: RefitGroup) -> dict[tuple, str]:
        """``RefitWorker.rejoin(endpoint, plan, group.version)`` on every party
        (collective)."""
        ...

    def refit(self, group: RefitGroup, step: int) -> dict[tuple, str]:
        """``RefitWorker.refit(step)`` on every party (collective)."""
        ...


def _joined(membership: Membership, parties: Parties, group: RefitGroup, why: str) -> RefitGroup:
    """Join every party of ``group``; an engine that fails to join is fenced (``why``)
    and the others join a group without it, until one forms."""
    for _ in range(len(membership.engines) + 1):
        outcomes = parties.join(group)
        if all(o == OK for o in outcomes.values()):
            return group
        blamed = engines_to_fence(outcomes)
        if not blamed:
            failed = {p: o for p, o in outcomes.items() if o != OK}
            raise RuntimeError(
                f"joining refit group {group.plan.plan.fingerprint} failed with no engine to "
                "blame: " + "; ".join(f"{p}: {o}" for p, o in sorted(failed.items()))
            )
        for engine, reason in blamed.items():
            membership.fence(engine, f"{why}, joining: {reason}")
        group = membership.group(version=group.version)
    raise RuntimeError("no refit group could be joined")


def refit_step(
    membership: Membership, parties: Parties, group: RefitGroup, step: int
) -> RefitGroup:
    """Refit ``step`` on ``group``; on failure fence the engines to blame, join the
    others in a new group and refit ``step`` again, until it completes. Returns the
    group that completed it (the next step's). Training ranks wait at most one deadline
    per attempt. An attempt that fails with no engine to blame (every party a peer's
    victim) is tried once more in a new group, then raised."""
    unblamed = 0
    for _ in range(len(membership.engines) + 2):
        outcomes = parties.refit(group, step)
        if all(o == OK for o in outcomes.values()):
            membership.refitted(group.engines, step)
            return group
        blamed = engines_to_fence(outcomes)
        unblamed = 0 if blamed else unblamed + 1
        if unblamed == 2:
            failed = {p: o for p, o in outcomes.items() if o != OK}
            raise RuntimeError(
                f"the refit of step {step} failed twice with no engine to blame: "
                + "; ".join(f"{p}: {o}" for p, o in sorted(failed.items()))
            )
        for engine, why in blamed.items():
            membership.fence(engine, f"step {step}: {why}")
        group = _joined(membership, parties, membership.group(), f"step {step}")
    raise RuntimeError(f"the refit of step {step} failed on every attempt")


def admit_engine(membership: Membership, parties: Parties, engine: int, version: int) -> RefitGroup:
    """Between steps: refit the newcomer ``engine`` alone to ``version`` (what the
    training ranks hold now, and the serving engines since the last step), then join
    everyone serving in the group for the next step, which is returned. A newcomer that
    fails its catch-up is fenced again; the others are not touched."""
    membership.admit(engine)
    why = f"catch-up to step {version}"
    catch_up = _joined(membership, parties, membership.catch_up(engine), why)
    if engine in catch_up.engines:
        outcomes = parties.refit(catch_up, version)
        if all(o == OK for o in outcomes.values()):
            membership.refitted((engine,), version)
        else:
            blamed = engines_to_fence(outcomes) or {engine: "its catch-up failed"}
            membership.fence(engine, f"{why}: {blamed.get(engine, 'its catch-up failed')}")
    # every party holds ``version`` whole: a delta refit's next step need not be dense
    return _joined(membership, parties, membership.group(version=version), why)
