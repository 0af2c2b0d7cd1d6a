"""The GRPO run with engines that come and go (``faults:`` in ``configs/grpo_cpu.yaml``).

Training runs every step whatever happens to the generation engines (replicas): the
refit group is the membership's (``integrations/worker/membership.py``), each step's
refit is ``refit_step`` (a failed attempt fences the engines to blame, the others join
a new group with the plan for them and refit the step again), and an engine that joins
is caught up by ``admit_engine`` before the step it first generates in. Generation
splits each step's prompts over the engines serving. The faults are staged from the
config: an engine's tp rank 0 exits when the refit of ``lose_engine_at_step`` starts;
at ``add_engine_at_step`` its actors start (again) and it is admitted.

A lost engine costs the run ``refit.timeout_s``: the other ranks of that refit are
blocked in its collectives until their deadline, and only then can the others join a
group without it. The driver knows at once (Ray reports the dead actor), so it says so
then (:func:`lost_engine_line`), and every ``WAIT_PROGRESS_S`` while it waits
(:func:`waiting_line`), instead of standing silent for a minute. With ``refit.verify``
every refit that completes, the catch-up of a joining engine included, is checked per
destination tensor over the group that ran it (:func:`verified_line` says which engines).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..engine.transport import first_line
from ..integrations.worker.membership import (
    DEAD,
    OK,
    PEER_FAILURES,
    SILENT,
    Membership,
    RefitGroup,
    admit_engine,
    refit_step,
)
from ..layouts.base import RankLayout
from ..plan import RefitPlan, plan_refit, rank_plan
from ..plan.membership import MembershipPlans
from ..spec.model import ModelSpec
from .cluster import ActorInfo, GrpoCluster, check_checksums
from .config import GrpoRunConfig

# While a failed refit's other ranks wait out their deadline: a line this often (seconds).
WAIT_PROGRESS_S = 15.0


def _engines(engines: Sequence[int]) -> str:
    ids = ",".join(map(str, engines))
    return f"engine {ids}" if len(engines) == 1 else f"engines {ids}"


def lost_engine_line(
    label: str, engine: int, why: str, timeout_s: float, step: int, others: Sequence[int]
) -> str:
    """The line printed as soon as a refit attempt of ``step`` loses ``engine`` (``why``:
    which rank, how): the run now stands still until the attempt's other ranks time out,
    at most ``timeout_s`` (``refit.timeout_s``); ``others``: the engines that then refit
    ``step`` again without it (none: a newcomer's catch-up)."""
    then = (
        f"then {_engines(others)} refit{'s' if len(others) == 1 else ''} step {step} again "
        f"on a plan without engine {engine}"
        if others
        else "then the run goes on without it"
    )
    return (
        f"{label}: engine {engine} lost ({why}); waiting up to {timeout_s:.0f} s "
        f"(refit.timeout_s) for the other refit ranks to time out, {then}"
    )


def waiting_line(label: str, waited_s: float, timeout_s: float) -> str:
    """Every ``WAIT_PROGRESS_S`` of that wait (seconds since the refit started, as the
    ranks' deadline counts): the run is alive, and how far along."""
    return (
        f"{label}: still waiting for the other refit ranks to time out "
        f"({waited_s:.0f} s of their {timeout_s:.0f} s deadline)"
    )


def verified_line(label: str, engines: Sequence[int], tensors: int, ranks: int) -> str:
    """``refit.verify``'s result for one completed refit: which engines it checked."""
    return (
        f"{label}: refit.verify: {_engines(engines)} bit-exact "
        f"({tensors} destination tensors on {ranks} ranks)"
    )


class RayParties:
    """The membership's ``Parties`` over the cluster's Ray actors.

    ``say`` prints a line at once (the lost-engine wait); ``label`` names the refit now
    running in those lines (None: ``step N``); ``verified`` collects ``refit.verify``'s
    lines until the caller takes them (:meth:`take_verified`)."""

    def __init__(self, cluster: GrpoCluster, say: Callable[[str], None] | None = None) -> None:
        self.cluster = cluster
        self.results: dict[tuple, Any] = {}  # the last call's return values, per party
        self.say: Callable[[str], None] = say or (lambda line: None)
        self.label: str | None = None
        self.verified: list[str] = []
        self.clock: Callable[[], float] = time.monotonic  # the deadlines' (tests: a fake)

    def actor(self, party: tuple) -> ActorInfo:
        if party[0] == "training":
            return self.cluster.trainers[party[1]]
        return next(
            a for a in self.cluster.generators if (a.replica, a.tp_rank) == (party[1], party[2])
        )

    def _outcomes(
        self,
        calls: dict[Any, tuple],
        deadline_s: float,
        on_failure: Callable[[tuple, str], bool] | None = None,
        on_wait: Callable[[float], None] | None = None,
    ) -> dict[tuple, str]:
        """How each call ended, by ``deadline_s``. ``on_failure(party, outcome)`` sees
        each failure while others are still pending; once it returns True, ``on_wait``
        is called with the seconds since the calls started at every multiple of
        ``WAIT_PROGRESS_S`` (the parties' own deadlines count from that start too)."""
        import ray
        from ray.exceptions import RayActorError, RayError

        start = self.clock()
        end = start + deadline_s
        out: dict[tuple, str] = {}
        self.results = {}
        pending = dict(calls)
        watching = False  # on_failure said something: progress lines from now on
        ticks = 0  # multiples of WAIT_PROGRESS_S passed (said, or before the failure)
        while pending and self.clock() < end:
            wake = min(end, start + (ticks + 1) * WAIT_PROGRESS_S) if watching else end
            left = max(0.0, wake - self.clock())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            for ref in ready:
                party = pending.pop(ref)
                try:
                    self.results[party] = ray.get(ref)
                    out[party] = OK
                except RayActorError:
                    out[party] = DEAD
                except RayError as err:
                    cause = getattr(err, "cause", None) or err
                    out[party] = f"raised {type(cause).__name__}: {first_line(cause)}"
                if on_failure is None or out[party] == OK or not pending:
                    continue
                if on_failure(party, out[party]) and not watching:
                    watching = True
                    ticks = int((self.clock() - start) // WAIT_PROGRESS_S)
            due = watching and self.clock() >= start + (ticks + 1) * WAIT_PROGRESS_S
            if due and pending and on_wait is not None:
                ticks += 1
                on_wait(ticks * WAIT_PROGRESS_S)
        for party in pending.values():
            out[party] = SILENT
        return out

    def join(self, group: RefitGroup) -> dict[tuple, str]:
        plan = group.plan.plan
        calls = {
            self.actor(p).handle.enter.remote(
                e.to_json(), rank_plan(plan, e.group_rank).to_json(), group.version
            ): p
            for p, e in group.endpoints.items()
        }
        cfg = self.cluster.cfg
        return self._outcomes(calls, cfg.ray.setup_timeout_s + cfg.refit.timeout_s)

    def refit(self, group: RefitGroup, step: int) -> dict[tuple, str]:
        """One refit attempt over ``group``. An engine lost in it is said at once (the
        wait for the others' deadline follows); an attempt that completes is verified
        with ``refit.verify`` (:class:`~.cluster.RefitVerifyError` on a mismatch)."""
        cfg = self.cluster.cfg
        verify, timeout_s = cfg.refit.verify, cfg.refit.timeout_s
        calls = {
            self.actor(p).handle.refit.remote("reshard", step, verify): p for p in group.endpoints
        }
        label = self.label or f"step {step}"
        lost: list[int] = []

        def on_failure(party: tuple, outcome: str) -> bool:
            # a peer's victim (TransportError) is no news: the lost engine was said
            if party[0] != "engine" or party[1] in lost or outcome.startswith(PEER_FAILURES):
                return False
            lost.append(party[1])
            others = [e for e in group.engines if e not in lost]
            why = f"rank {party[2]} {outcome}"
            self.say(lost_engine_line(label, party[1], why, timeout_s, step, others))
            return True

        def on_wait(waited_s: float) -> None:
            self.say(waiting_line(label, waited_s, timeout_s))

        # the actors give up within refit.timeout_s; the margin is the call budget
        deadline_s = timeout_s + cfg.ray.call_timeout_s
        outcomes = self._outcomes(calls, deadline_s, on_failure, on_wait)
        if verify and all(o == OK for o in outcomes.values()):
            self._verify(group, label)
        return outcomes

    def _verify(self, group: RefitGroup, label: str) -> None:
        """The completed attempt's checksums, senders against receivers, keyed by the
        group's own refit ranks (a derived plan numbers the engines' ranks anew)."""
        by_rank = {e.group_rank: p for p, e in group.endpoints.items()}
        senders = [r["checksums"] for p, r in self.results.items() if p[0] == "training"]
        receivers = [r["checksums"] for p, r in self.results.items() if p[0] == "engine"]
        tensors = check_checksums(
            f"{label}, refit (reshard)",
            senders,
            receivers,
            lambda rank: str(self.actor(by_rank[rank])),
        )
        self.verified.append(verified_line(label, group.engines, tensors, len(receivers)))

    def take_verified(self) -> list[str]:
        """``refit.verify``'s lines since the last call."""
        lines, self.verified = self.verified, []
        return lines


class ElasticRefit:
    """The run's membership, its current group, and the staged faults."""

    def __init__(
        self,
        cfg: GrpoRunConfig,
        cluster: GrpoCluster,
        plan: RefitPlan,
        spec: ModelSpec,
        sources: list[RankLayout],
        destinations: list[RankLayout],
    ) -> None:
        self.cfg, self.cluster = cfg, cluster
        tp, dp = cfg.infer.tp, cfg.num_replicas
        engines = tuple(tuple(range(e * tp, (e + 1) * tp)) for e in range(dp))

        def replan(kept: list[RankLayout], keep: tuple[int, ...]) -> RefitPlan:
            return plan_refit(spec, sources, kept, bucket_mb=cfg.refit.bucket_mb)

        self.membership = Membership(
            MembershipPlans(plan, spec, sources, destinations, engines, replan),
            timeout_s=cfg.refit.timeout_s,
            connect_timeout_s=cfg.ray.setup_timeout_s,
            delta=cfg.refit.delta_options,
        )
        self.engine = cfg.faults.engine_of(dp)
        self.events: list[str] = []  # what changed, in order (printed with the steps)
        # lines said at once, as they happen (a lost engine's wait); all kept, in order
        self.said: list[str] = []
        self.parties = RayParties(cluster, say=self._say)
        self.group: RefitGroup | None = None
        self.last_delta: tuple[int, int] | None = None

    @property
    def serving(self) -> tuple[int, ...]:
        return self.membership.serving

    def _say(self, line: str) -> None:
        """Print ``line`` now (above the progress bar), not with the step's lines: it
        comes before a wait of up to ``refit.timeout_s``."""
        self.said.append(line)
        if self.cfg.progress:
            from tqdm import tqdm

            tqdm.write(line)

    def start(self) -> None:
        """Start the actors of the engines serving at step 0 and join them in a group."""
        f = self.cfg.faults
        first = list(range(self.cfg.num_replicas))
        if f.starts_without_it():
            first.remove(self.engine)
            self.membership.fence(self.engine, f"joins before step {f.add_engine_at_step}")
        if f.lose_engine_at_step is not None:
            rank = next(
                a.refit_rank
                for a in self.cluster.generators
                if (a.replica, a.tp_rank) == (self.engine, 0)
            )
            self.cluster.exit_steps[rank] = f.lose_engine_at_step
        self.cluster.start(first)
        self.group = self.membership.group()
        outcomes = self.parties.join(self.group)
        failed = {p: o for p, o in outcomes.items() if o != OK}
        if failed:
            raise RuntimeError(f"joining the first refit group failed: {failed}")

    def before_generation(self, step: int) -> None:
        """At ``add_engine_at_step``: start the engine's actors and catch it up to the
        version the others hold (the last step's)."""
        if step != self.cfg.faults.add_engine_at_step:
            return
        self.cluster.start_replica(self.engine)
        self.parties.label = f"before step {step}, catch-up to step {step - 1}"
        try:
            self.group = admit_engine(self.membership, self.parties, self.engine, step - 1)
        finally:
            self.parties.label = None
        record = self.membership.engines[self.engine]
        if record.status != "serving":  # its catch-up failed: it receives nothing more
            self.cluster.stop_replica(self.engine)
        note = f" ({record.note})" if record.status != "serving" else ""
        self.events.append(f"before step {step}: engine {self.engine} {record.status}{note}")
        self.events.extend(self.parties.take_verified())

    def refit(self, step: int) -> float:
        """Step ``step``'s refit over the engines serving (fencing those that fail it);
        the slowest rank's seconds of the attempt that completed."""
        assert self.group is not None
        before = set(self.serving)
        self.group = refit_step(self.membership, self.parties, self.group, step)
        for engine in sorted(before - set(self.serving)):
            self.cluster.stop_replica(engine)
            note = self.membership.engines[engine].note
            self.events.append(f"step {step}: engine {engine} fenced ({note})")
        self.events.extend(self.parties.take_verified())
        results = self.parties.results
        trainers = [r for p, r in results.items() if p[0] == "training"]
        self.last_delta = None
        if trainers and trainers[0].get("delta") is not None:
            self.last_delta = (
                sum(r["delta"]["sent_bytes"] for r in trainers),
                sum(r["delta"]["dense_bytes"] for r in trainers),
            )
        return max(r["seconds"] for r in results.values())

    @property
    def bytes_per_refit(self) -> int:
        assert self.group is not None
        return self.group.plan.plan.stats.total_bytes

    def weights(self, replicas: Sequence[int]) -> dict[tuple[int, int], dict[str, Any]]:
        """What each generation rank of ``replicas`` reports it holds."""
        actors = [a for a in self.cluster.generators if a.replica in replicas]
        out = self.cluster.call_all(
            actors, "weights", (), self.cfg.ray.call_timeout_s, "weights versions"
        )
        return {(a.replica, a.tp_rank): w for a, w in zip(actors, out)}
