"""The colocated refit between local processes: the CPU twin of same-GPU refits.

Training rank ``s`` and inference rank ``d`` with ``hosts[d] == s`` stand for one GPU:
two processes that share the host's staging through OS shared memory (CUDA IPC with
``device="cuda"``, ``engine/staging.py``) and hand rounds over a local connection. The
training ranks form the refit group. Both sides run the framework-neutral worker API
(``integrations/worker/colocated.py``), as an adapter would. Every inference rank
checks its tensors bit for bit after the last step, as in ``spawn.py``; the reports have
the same shape, under the backend name :data:`BACKEND`.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engine.shm_segments import sweep_orphans
from ..plan import Colocation, RankPlan, RefitPlan, plan_refit
from .config import RunConfig, build_layouts
from .spawn import RunResult, report_rank, spawn_ranks

BACKEND = "reshard-colocated"


def colocated_plan(cfg: RunConfig) -> RefitPlan:
    """The colocated plan of ``cfg``: inference rank ``d`` on training rank ``d``'s GPU."""
    spec, sources, destinations = build_layouts(cfg)
    colocation = Colocation.same_index(len(sources), len(destinations))
    return plan_refit(spec, sources, destinations, cfg.bucket_mb, colocation=colocation)


def run_colocated(
    cfg: RunConfig,
    plan: RefitPlan | None = None,
    join_timeout_s: float = 900,
    progress: Callable[[int, int], None] | None = None,
) -> RunResult:
    """Spawn every training rank and its co-located inference rank; run and check."""
    t0 = time.perf_counter()
    plan = plan or colocated_plan(cfg)
    # Every rank has exited: remove what a killed one left (this driver's resource
    # tracker, which the ranks share, would only do so when the driver exits).
    ranks = spawn_ranks(_worker, cfg, plan, 1, join_timeout_s, progress, after=sweep_orphans)
    return RunResult(plan, ranks, time.perf_counter() - t0)


def _worker(rank: int, cfg_json: str, plan_path: str, port: int, out: str, secret: str) -> None:
    """One spawned rank, reported as ``spawn.py``'s are."""

    def run(result: dict[str, Any]) -> None:
        _run(rank, RunConfig(**json.loads(cfg_json)), Path(plan_path), port, secret, result)

    report_rank(rank, out, run)


def _run(
    rank: int, cfg: RunConfig, plan_path: Path, port: int, secret: str, result: dict[str, Any]
) -> None:
    """One process: a training rank (the group's member and its GPU's host) or the
    inference rank on a training rank's GPU, through the framework-neutral worker API."""
    import torch

    from ..engine.delta import DeltaOptions
    from ..engine.materialize import SyntheticWeights, materialize
    from ..integrations.worker import ColocatedTrainer, ColocatedWorker, RefitEndpoint
    from .destination import destination_tensors
    from .spawn import TRAJECTORY
    from .training import TrajectoryWeights, delta_figures, refill

    def share(r: int) -> RankPlan:
        return RankPlan.from_json(plan_path.with_name(f"plan{r}.json").read_text())

    if cfg.kill_rank == rank and cfg.kill_step < 0:
        os._exit(3)  # simulated crash at start-up: its peers wait for it (a grace, not a hang)
    spec, sources, destinations = build_layouts(cfg)
    s = len(sources)
    weights = (  # with deltas, Adam steps between refits (runner/training.py)
        TrajectoryWeights(spec.unquantized(), str(plan_path.with_name(TRAJECTORY)))
        if cfg.delta
        else SyntheticWeights(spec.unquantized(), cfg.seed)
    )
    delta = (
        DeltaOptions(cfg.anchor_every, cpu_kernel=cfg.delta_kernel, check=cfg.delta_check)
        if cfg.delta
        else None
    )
    hosts = share(rank).colocated_hosts
    host_rank = rank if rank < s else hosts[rank - s]
    device = torch.device("cpu")
    if cfg.device == "cuda":  # a pair shares its host's device, like a GPU in the job
        device = torch.device("cuda", host_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    address = plan_path.with_name(f"listen{host_rank}")  # where a host says it listens
    progress = plan_path.with_name(f"progress{rank}")
    timings = []
    if rank < s:
        tensors = materialize(sources[rank], weights, fill=float("nan"), device=device)
        endpoint = RefitEndpoint(
            "127.0.0.1", port, s, rank, cfg.transport, cfg.timeout_s, cfg.connect_timeout_s,
            secret,
        )  # fmt: skip
        plan = RefitPlan.from_json(plan_path.read_text())
        trainer = ColocatedTrainer(endpoint, tensors, plan, device, delta=delta)
        steps = []
        try:  # its staging is released on every way out (a killed rank: shm_segments.py)
            listening = trainer.listen()
            if listening is not None:
                address.with_suffix(".tmp").write_text(listening)
                address.with_suffix(".tmp").rename(address)  # whole, or not there
            trainer.join()
            trainer.accept_worker()
            for step in range(cfg.steps + 1):  # the first: warm-up (gloo connects lazily)
                if cfg.kill_rank == rank and step == cfg.kill_step + 1:
                    # simulated crash mid-step, its guest waiting on the staging: no cleanup
                    os.kill(os.getpid(), signal.SIGKILL)
                if cfg.delta and step:  # an optimizer step before each timed refit
                    weights.advance()
                    refill(sources[rank], tensors, weights)
                # As the separate-pools run: every pair starts the step together, its
                # worker poisoned (not poisoning while the step runs).
                if trainer.guest_rank is not None:
                    _wait_ready(plan_path.with_name(f"ready{trainer.guest_rank}"), step, cfg)
                trainer.net.barrier()
                seconds = trainer.refit()
                if step:
                    # like a separate-pools rank's [step, exchange]: its time on the
                    # network and waiting for its worker is not its own work
                    timings.append([seconds, trainer.host.exchange_seconds])
                    progress.write_text(str(step))
                    if trainer.host.delta is not None:
                        d = trainer.host.delta
                        steps.append(delta_figures(d.stats, d.baseline_bytes))
            staging = trainer.host.staging_bytes
        finally:
            trainer.close()
        result["backends"][BACKEND] = {"timings": timings, "staging_bytes": staging}
        if steps:
            result["backends"][BACKEND]["delta"] = steps
        return
    mine = destination_tensors(cfg, spec, destinations[rank - s], rank - s, weights, device)
    worker = ColocatedWorker(mine.tensors, device)
    deadline = time.monotonic() + (cfg.connect_timeout_s or cfg.timeout_s)
    while not address.exists():  # the host writes it once it has compiled
        if time.monotonic() > deadline:
            raise TimeoutError(f"training rank {host_rank} never listened for its worker")
        time.sleep(0.1)
    try:
        worker.connect(address.read_text(), secret, share(rank), rank, cfg.timeout_s)
        ready = plan_path.with_name(f"ready{rank}")
        checked: list[dict[str, Any]] = []
        for step in range(cfg.steps + 1):
            if cfg.delta and step:  # the trained weights its host now sends
                weights.advance()
                mine.retrain(weights)
            mine.poison()  # with deltas too: its host holds every message it gets whole
            ready.with_suffix(".tmp").write_text(str(step))
            ready.with_suffix(".tmp").rename(ready)
            seconds = worker.refit()
            if step:
                assert worker.guest is not None
                timings.append([seconds, worker.guest.waited])
                progress.write_text(str(step))
                if cfg.delta and cfg.verify:  # every delta step must leave it exact
                    checked.append({"mismatches": mine.mismatches()})
    finally:
        worker.close()
    # Its step began before its host's (the host starts once it is ready): the pair's
    # step is the host's, which ends when this worker has unpacked (step_stats).
    entry: dict[str, Any] = {"timings": timings, "staging_bytes": 0, "wall_is_host's": True}
    if cfg.verify:
        entry["mismatches"] = mine.mismatches()
    if checked:
        entry["delta"] = checked
    result["backends"][BACKEND] = entry


def _wait_ready(ready: Path, step: int, cfg: RunConfig) -> None:
    """Wait until the worker on this GPU says it is ready for ``step`` (poisoned)."""
    deadline = time.monotonic() + cfg.timeout_s
    while True:
        try:
            if ready.read_text() == str(step):
                return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the worker on this GPU was not ready for step {step}")
        time.sleep(0.0005)


__all__ = ["BACKEND", "colocated_plan", "run_colocated"]
