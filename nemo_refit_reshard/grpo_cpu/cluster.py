"""The driver's handle on the GRPO actors: start, call with deadlines, refit, stop.

Every call the driver makes goes through :meth:`GrpoCluster.gather`, which waits with
a deadline and turns failures into one :class:`GrpoActorError` naming the actors: a
dead actor (Ray's ``RayActorError``) is named as dead as soon as Ray reports it, the
others' errors (e.g. the refit transport's ``TransportError``) are listed with it. The
driver then kills every actor, so a step that fails never hangs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.checksum import Checksums, combine, compare
from ..engine.materialize import canonical_from_ranks
from ..engine.rendezvous import free_port, new_rendezvous
from ..integrations.worker import RefitEndpoint
from ..layouts.base import RankLayout
from ..plan import BroadcastPlan, RefitPlan, rank_plan
from .config import GrpoRunConfig
from .plans import broadcast_plan_to_json, check_worker_tensors

# After a first failure, how long to collect the other actors' errors for the report. Not
# a deadline: nothing is cut short by it (the actors' own waits end by their timeouts).
FAILURE_GRACE_S = 1.0


class GrpoActorError(RuntimeError):
    """An actor died, raised, or did not answer in time; ``dead`` names the dead ones."""

    def __init__(self, message: str, dead: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.dead = list(dead)


class RefitVerifyError(RuntimeError):
    """Checksums of a destination tensor differ between its senders and its receiver."""


@dataclass(frozen=True)
class ActorInfo:
    role: str  # "training" | "generation"
    refit_rank: int
    rank: int  # training rank or inference rank
    replica: int = 0
    tp_rank: int = 0
    handle: Any = field(default=None, compare=False, hash=False, repr=False)

    def __str__(self) -> str:
        if self.role == "training":
            return f"training actor rank {self.rank} (refit rank {self.refit_rank})"
        return (
            f"generation actor replica {self.replica} tp rank {self.tp_rank} "
            f"(inference rank {self.rank}, refit rank {self.refit_rank})"
        )


def check_checksums(
    what: str,
    senders: Sequence[Checksums],
    receivers: Sequence[Checksums],
    name_of: Callable[[int], str],
) -> int:
    """``refit.verify``'s verdict on one refit: the senders' checksums summed per
    (destination refit rank, tensor) against the receivers'. Raises
    :class:`RefitVerifyError` naming up to 8 differing tensors (``name_of``: the actor of
    a destination refit rank, in the group that refit); else the number of destination
    tensors found bit-exact. Shared by the fixed group and the groups of a run whose
    engines come and go, whose ranks are numbered per group."""
    received = combine(receivers)
    bad = compare(combine(senders), received)
    if bad:
        rows = [
            f"{name_of(d)}: {name} (received {got:#018x}, sent {sent:#018x})"
            for d, name, sent, got in bad[:8]
        ]
        more = f"\n  ... and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise RefitVerifyError(
            f"{what}: checksum mismatch in {len(bad)} destination tensor(s):\n  "
            + "\n  ".join(rows)
            + more
        )
    return len(received)


def _first_line(err: BaseException) -> str:
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


class GrpoCluster:
    """Training and generation actors of one run, with their plans loaded."""

    def __init__(
        self,
        cfg: GrpoRunConfig,
        plan: RefitPlan,
        broadcast: BroadcastPlan | None,
        sources: list[RankLayout],
        destinations: list[RankLayout],
        canonical_shapes: dict[str, tuple[int, ...]],
    ) -> None:
        self.cfg, self.plan, self.broadcast = cfg, plan, broadcast
        self.sources, self.destinations = sources, destinations
        self.shapes = canonical_shapes
        # The last refit's delta bytes over the training actors (sent, dense); None when
        # it was not a delta refit.
        self.last_delta: tuple[int, int] | None = None
        # refit rank -> the step at whose refit that generation actor exits (fault
        # injection, taken by the actor's next setup: elastic.py)
        self.exit_steps: dict[int, int | None] = {}
        s = len(sources)
        tp = cfg.infer.tp
        self.trainers = [ActorInfo("training", r, r) for r in range(s)]
        self.generators = [
            ActorInfo("generation", s + d, d, replica=d // tp, tp_rank=d % tp)
            for d in range(len(destinations))
        ]

    @property
    def actors(self) -> list[ActorInfo]:
        return self.trainers + self.generators

    # -- calls ------------------------------------------------------------------------------
    def gather(
        self, calls: Sequence[tuple[ActorInfo, Any]], timeout_s: float, what: str
    ) -> list[Any]:
        """Results of ``(actor, ObjectRef)`` calls in order; :class:`GrpoActorError`
        if any fails or the deadline passes."""
        import ray
        from ray.exceptions import RayActorError, RayError

        deadline = time.monotonic() + timeout_s
        pending = {ref: info for info, ref in calls}
        results: dict[ActorInfo, Any] = {}
        failures: list[tuple[ActorInfo, BaseException]] = []
        stop_at = deadline
        while pending and time.monotonic() < stop_at:
            # The loop's test and this read are two clock reads: never a negative wait.
            left = max(0.0, stop_at - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            for ref in ready:
                info = pending.pop(ref)
                try:
                    results[info] = ray.get(ref)  # ready: returns at once
                except RayError as err:
                    failures.append((info, err))
                    # Peers of a dead actor block until their transport timeout; collect
                    # what arrives in a short grace, then stop waiting for the rest.
                    stop_at = min(stop_at, time.monotonic() + FAILURE_GRACE_S)
        if not failures and not pending:
            return [results[info] for info, _ in calls]
        dead = [str(i) for i, e in failures if isinstance(e, RayActorError)]
        parts = [f"{d} died" for d in dead]
        for info, err in failures:
            if not isinstance(err, RayActorError):
                cause = getattr(err, "cause", None) or err
                parts.append(f"{info} raised {type(cause).__name__}: {_first_line(cause)}")
        if pending:
            names = ", ".join(str(i) for i in pending.values())
            if failures:
                parts.append(f"still running, stopped: {names}")
            else:
                parts.append(f"no answer within {timeout_s:.0f}s from: {names}")
        # The first part names the cause (a dead actor comes first), one line per other.
        raise GrpoActorError(f"{what} failed: " + "\n  ".join(parts), dead)

    def call_all(
        self,
        actors: Sequence[ActorInfo],
        method: str,
        args: Sequence[Any],
        timeout_s: float,
        what: str,
    ) -> list[Any]:
        """The same call on every actor of ``actors`` (concurrently: collectives)."""
        calls = [(a, getattr(a.handle, method).remote(*args)) for a in actors]
        return self.gather(calls, timeout_s, what)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, replicas: Sequence[int] | None = None) -> None:
        """Create the actors, build their worlds and models, check their tensors against
        the plans, join the refit group and load the plans. With ``replicas`` (a run
        whose engines come and go, ``elastic.py``): only those generation replicas start,
        and joining is left to the membership's groups."""
        import ray

        cfg = self.cfg
        exit_rank, _ = cfg.test_only_exit or (-1, -1)
        if cfg.test_only_exit is not None and exit_rank not in {
            a.refit_rank for a in self.generators
        }:
            raise ValueError(
                f"test_only_exit names refit rank {exit_rank}, which is no generation actor "
                f"(those are refit ranks {self.generators[0].refit_rank}.."
                f"{self.generators[-1].refit_rank})"
            )
        # Fractional CPUs so every actor fits the cluster at once (collectives need all
        # ranks running); each actor runs one torch thread.
        total = float(ray.cluster_resources().get("CPU", cfg.ray.num_cpus))
        self._per_actor = min(1.0, int(total / len(self.actors) * 100) / 100)
        if self._per_actor <= 0:
            raise ValueError(f"{len(self.actors)} actors do not fit {total} Ray CPUs")
        chosen = range(cfg.num_replicas) if replicas is None else replicas
        started = self._create(self.trainers, chosen)
        self._setup(started)
        if replicas is not None:
            return
        self._join_all()

    def _create(self, trainers: Sequence[ActorInfo], replicas: Sequence[int]) -> list[ActorInfo]:
        """Ray actors for ``trainers`` and every tp rank of ``replicas``."""
        import ray

        from .actors import GenerationActor, TrainingActor

        opts = dict(num_cpus=self._per_actor, max_restarts=0, max_task_retries=0)
        train_cls = ray.remote(TrainingActor).options(**opts)
        gen_cls = ray.remote(GenerationActor).options(**opts)
        made = []
        for i, a in enumerate(self.trainers):
            if a in trainers:
                self.trainers[i] = _with(a, train_cls.remote())
                made.append(self.trainers[i])
        for i, a in enumerate(self.generators):
            if a.replica in replicas:
                self.generators[i] = _with(a, gen_cls.remote())
                made.append(self.generators[i])
        return made

    def _setup(self, actors: Sequence[ActorInfo]) -> None:
        """Build the actors' worlds and models; check their tensors against the plan."""
        cfg = self.cfg
        exit_rank, exit_step = cfg.test_only_exit or (-1, -1)
        setup_s = cfg.ray.setup_timeout_s
        train_port = free_port()
        replica_ports = {a.replica: free_port() for a in actors if a.role == "generation"}
        calls = [
            (
                a,
                a.handle.setup.remote(
                    cfg.policy, a.rank, str(cfg.train), cfg.grpo, cfg.seed, train_port, setup_s
                ),
            )
            for a in actors
            if a.role == "training"
        ]
        calls += [
            (
                a,
                a.handle.setup.remote(
                    cfg.policy,
                    a.replica,
                    a.tp_rank,
                    str(cfg.infer),
                    cfg.infer_dtype,
                    replica_ports[a.replica],
                    setup_s,
                    self.exit_steps.pop(
                        a.refit_rank, exit_step if a.refit_rank == exit_rank else None
                    ),
                ),
            )  # fmt: skip
            for a in actors
            if a.role == "generation"
        ]
        self.gather(calls, setup_s, "actor setup")
        described = self.call_all(actors, "describe", (), setup_s, "describe_tensors")
        for a, tensors in zip(actors, described):
            check_worker_tensors(self.plan, self.broadcast, a.refit_rank, tensors, str(a))

    def start_replica(self, replica: int) -> None:
        """Start (or start again) every tp rank of generation ``replica``."""
        self._setup(self._create((), (replica,)))

    def stop_replica(self, replica: int) -> None:
        """End every actor of generation ``replica`` (a fenced engine receives nothing)."""
        import ray

        for i, a in enumerate(self.generators):
            if a.replica == replica and a.handle is not None:
                ray.kill(a.handle, no_restart=True)
                self.generators[i] = _with(a, None)

    def _join_all(self) -> None:
        """Every actor joins one refit group and loads the full plans."""
        cfg = self.cfg
        timeout, setup_s = cfg.refit.timeout_s, cfg.ray.setup_timeout_s
        world = len(self.actors)
        # This run's rendezvous: only the actors its secret is shipped to can join.
        meet = new_rendezvous()
        calls = [
            (
                a,
                a.handle.join.remote(
                    RefitEndpoint(
                        meet.ip,
                        meet.port,
                        world,
                        a.refit_rank,
                        "gloo",
                        timeout,
                        setup_s,
                        meet.secret,
                        cfg.refit.delta_options,  # every rank alike, with the endpoint
                    ).to_json()
                ),
            )
            for a in self.actors
        ]
        self.gather(calls, setup_s + timeout, "joining the refit group")
        bjson = broadcast_plan_to_json(self.broadcast) if self.broadcast is not None else None
        backends = list(cfg.refit.backends)
        calls = [
            (
                a,
                a.handle.load_plans.remote(
                    rank_plan(self.plan, a.refit_rank).to_json(), bjson, backends
                ),
            )
            for a in self.actors
        ]
        self.gather(calls, setup_s + timeout, "loading the plans")

    def shutdown(self) -> None:
        """Kill every actor (a failed step leaves survivors blocked in collectives)."""
        import ray

        for a in self.actors:
            if a.handle is not None:
                ray.kill(a.handle, no_restart=True)

    # -- refit ------------------------------------------------------------------------------
    def refit(self, backend: str, step: int) -> float:
        """One refit over every actor; the slowest rank's seconds. With ``refit.verify``,
        compares the senders' and receivers' checksums per destination tensor. A delta
        refit leaves the bytes the training actors sent and what the same messages
        weigh dense in :attr:`last_delta`."""
        verify = self.cfg.refit.verify
        self.last_delta = None
        what = f"step {step}, refit ({backend})"
        out = self.call_all(
            self.actors,
            "refit",
            (backend, step, verify),
            # the actors give up within refit.timeout_s; the margin is the call budget
            self.cfg.refit.timeout_s + self.cfg.ray.call_timeout_s,
            what,
        )
        s = len(self.trainers)
        if out[0].get("delta") is not None:
            sent = sum(o["delta"]["sent_bytes"] for o in out[:s])
            self.last_delta = (sent, sum(o["delta"]["dense_bytes"] for o in out[:s]))
        if verify:
            check_checksums(
                what,
                [o["checksums"] for o in out[:s]],
                [o["checksums"] for o in out[s:]],
                lambda d: str(self.generators[d - s]),
            )
        return max(o["seconds"] for o in out)

    # -- canonical views (tests, debugging) ------------------------------------------------
    def trainer_canonical(self) -> dict[str, torch.Tensor]:
        """Canonical tensors reassembled from every training rank's live parameters."""
        states = self.call_all(
            self.trainers, "local_state", (), self.cfg.ray.call_timeout_s, "local_state"
        )
        return canonical_from_ranks(self.shapes, self.sources, states, "training actors")

    def generator_canonical(self, replicas: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
        """Canonical tensors reassembled from the live tensors of every generation rank
        (of ``replicas`` only, if given); replicas must agree bit for bit."""
        actors = [a for a in self.generators if replicas is None or a.replica in replicas]
        states = self.call_all(
            actors, "local_state", (), self.cfg.ray.call_timeout_s, "local_state"
        )
        layouts = [self.destinations[a.rank] for a in actors]
        return canonical_from_ranks(self.shapes, layouts, states, "generation actors")


def _with(info: ActorInfo, handle: Any) -> ActorInfo:
    return ActorInfo(info.role, info.refit_rank, info.rank, info.replica, info.tp_rank, handle)
