"""The GRPO run with engines that come and go (``faults:`` in ``configs/grpo_cpu.yaml``).

Training runs every step whatever happens to the generation engines (replicas): the
refit group is the membership's (``integrations/worker/membership.py``), each step's
refit is ``refit_step`` (a failed attempt fences the engines to blame, the others join
a new group with the plan for them and refit the step again), and an engine that joins
is caught up by ``admit_engine`` before the step it first generates in. Generation
splits each step's prompts over the engines serving. The faults are staged from the
config: an engine's tp rank 0 exits when the refit of ``lose_engine_at_step`` starts;
at ``add_engine_at_step`` its actors start (again) and it is admitted.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..engine.transport import first_line
from ..integrations.worker.membership import (
    DEAD,
    OK,
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
from .cluster import ActorInfo, GrpoCluster
from .config import GrpoRunConfig


class RayParties:
    """The membership's ``Parties`` over the cluster's Ray actors."""

    def __init__(self, cluster: GrpoCluster) -> None:
        self.cluster = cluster
        self.results: dict[tuple, Any] = {}  # the last call's return values, per party

    def actor(self, party: tuple) -> ActorInfo:
        if party[0] == "training":
            return self.cluster.trainers[party[1]]
        return next(
            a for a in self.cluster.generators if (a.replica, a.tp_rank) == (party[1], party[2])
        )

    def _outcomes(self, calls: dict[Any, tuple], deadline_s: float) -> dict[tuple, str]:
        import ray
        from ray.exceptions import RayActorError, RayError

        end = time.monotonic() + deadline_s
        out: dict[tuple, str] = {}
        self.results = {}
        pending = dict(calls)
        while pending and time.monotonic() < end:
            left = max(0.0, end - time.monotonic())
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
        calls = {
            self.actor(p).handle.refit.remote("reshard", step, False): p for p in group.endpoints
        }
        cfg = self.cluster.cfg
        # the actors give up within refit.timeout_s; the margin is the call budget
        return self._outcomes(calls, cfg.refit.timeout_s + cfg.ray.call_timeout_s)


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
        self.parties = RayParties(cluster)
        self.engine = cfg.faults.engine_of(dp)
        self.events: list[str] = []  # what changed, in order (printed with the steps)
        self.group: RefitGroup | None = None
        self.last_delta: tuple[int, int] | None = None

    @property
    def serving(self) -> tuple[int, ...]:
        return self.membership.serving

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
        self.group = admit_engine(self.membership, self.parties, self.engine, step - 1)
        record = self.membership.engines[self.engine]
        if record.status != "serving":  # its catch-up failed: it receives nothing more
            self.cluster.stop_replica(self.engine)
        note = f" ({record.note})" if record.status != "serving" else ""
        self.events.append(f"before step {step}: engine {self.engine} {record.status}{note}")

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
