"""Run a refit between local processes: training ranks and inference ranks on gloo.

The driver (this process) builds the plan once and writes it as JSON; it then
spawns one process per training rank and per inference rank. Training ranks
hold Megatron-layout shards of deterministic random weights, inference ranks
hold vLLM-layout tensors. All of them join one gloo refit group over a
``TCPStore`` on localhost, replay each backend for a number of steps and check
every destination element bit for bit against the canonical weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..engine.rendezvous import new_rendezvous
from ..plan import RefitPlan, plan_broadcast, plan_refit, rank_plan
from ..spec import load_model_spec
from .config import RunConfig, build_layouts

TRAJECTORY = "trajectory"  # beside the plan: a delta run's weights, step by step


@dataclass
class RunResult:
    """What a local run came back with: the plan it replayed, every rank's report (in
    rank order; a rank that failed has an ``"error"``) and the run's wall time."""

    plan: RefitPlan
    ranks: list[dict[str, Any]]
    seconds: float

    def errors(self) -> dict[int, str]:
        """Each failed rank's error, by refit-group rank."""
        return {r["rank"]: r["error"] for r in self.ranks if "error" in r}


def run_local(
    cfg: RunConfig,
    plan: RefitPlan | None = None,
    join_timeout_s: float = 900,
    progress: Callable[[int, int], None] | None = None,
) -> RunResult:
    """Spawn every rank on this machine, run the refit, return every rank's report."""
    t0 = time.perf_counter()
    if plan is None:
        spec, sources, destinations = build_layouts(cfg)
        plan = plan_refit(spec, sources, destinations, bucket_mb=cfg.bucket_mb, relay=cfg.relay)
    ranks = spawn_ranks(_worker, cfg, plan, len(cfg.backends), join_timeout_s, progress)
    return RunResult(plan, ranks, time.perf_counter() - t0)


def spawn_ranks(
    worker: Callable[..., None],
    cfg: RunConfig,
    plan: RefitPlan,
    rounds_of_steps: int,
    join_timeout_s: float,
    progress: Callable[[int, int], None] | None,
    after: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Spawn one ``worker(rank, cfg_json, plan_path, port, out_dir, secret)`` per rank of
    ``plan``, wait for them (``rounds_of_steps`` x ``cfg.steps`` steps each, for the
    progress bar) and return every rank's report. ``after``: run once every rank has
    exited, before the temporary folder goes."""
    import torch.multiprocessing as mp

    if cfg.connect_timeout_s is None:  # ranks start as fast as the machine lets them
        cfg = dataclasses.replace(cfg, connect_timeout_s=join_timeout_s)
    world = plan.num_sources + plan.num_destinations
    meet = new_rendezvous()
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = write_plans(plan, world, tmp)
        if cfg.delta:  # the optimizer runs once, here; the ranks map its weights
            from .training import AdamTrainedWeights, write_trajectory

            trained = AdamTrainedWeights(load_model_spec(cfg.model).unquantized(), cfg.seed, cfg.lr)
            write_trajectory(trained, cfg.steps * rounds_of_steps, os.path.join(tmp, TRAJECTORY))
            del trained  # its masters and moments: not needed while the ranks run
        ctx = mp.start_processes(
            worker,
            args=(json.dumps(asdict(cfg)), plan_path, meet.port, tmp, meet.secret),
            nprocs=world,
            start_method="spawn",
            join=False,
        )
        total = world * cfg.steps * rounds_of_steps
        grace = cfg.timeout_s + 5  # a failed rank's peers see it within their timeout
        hung = wait_ranks(ctx.processes, tmp, join_timeout_s, total, progress, grace)
        ranks = collect_reports(ctx.processes, tmp, hung, grace)
        if after is not None:
            after()
    return ranks


def write_plans(plan: RefitPlan, world: int, tmp: str) -> str:
    """Write the whole plan and every rank's slice of it; return the whole plan's path
    (each rank finds its slice beside it)."""
    plan_path = os.path.join(tmp, "plan.json")
    Path(plan_path).write_text(plan.to_json())
    for r in range(world):
        Path(tmp, f"plan{r}.json").write_text(rank_plan(plan, r).to_json())
    return plan_path


def wait_ranks(
    processes: Sequence[Any],
    tmp: str,
    join_timeout_s: float,
    total: int,
    progress: Callable[[int, int], None] | None,
    grace_s: float,
) -> list[int]:
    """Wait until every rank exits or the deadline passes, reporting rank-steps done;
    kill the ranks still running then and return their ranks. Once a rank has failed
    (a non-zero exit) the run has failed: the others, which may be waiting for it (a
    rendezvous, a peer's listen address), get ``grace_s`` (the transport's timeout, in
    which a peer's failure shows) to report theirs, not the whole deadline."""
    deadline = time.monotonic() + join_timeout_s
    while time.monotonic() < deadline and any(p.is_alive() for p in processes):
        time.sleep(0.2)
        if progress:
            done = sum(_read_int(Path(tmp, f"progress{r}")) for r in range(len(processes)))
            progress(done, total)
        if any(p.exitcode not in (None, 0) for p in processes):
            deadline = min(deadline, time.monotonic() + grace_s)
    hung = [i for i, p in enumerate(processes) if p.is_alive()]
    for p in processes:
        if p.is_alive():
            p.kill()
    return hung


def collect_reports(
    processes: Sequence[Any], tmp: str, hung: list[int], grace_s: float
) -> list[dict[str, Any]]:
    """Every rank's report; for a rank that wrote none, an error saying why."""
    ranks = []
    for r, process in enumerate(processes):
        path = Path(tmp, f"rank{r}.json")
        if path.exists():
            ranks.append(json.loads(path.read_text()))
        else:
            failed = [i for i, p in enumerate(processes) if i not in hung and p.exitcode]
            if r in hung:
                why = (
                    f"still running {grace_s:.0f} s after rank {failed[0]} failed"
                    if failed
                    else "still running at the deadline"
                )
            else:
                why = f"exit code {process.exitcode}"
            ranks.append({"rank": r, "error": f"process died without a report ({why})"})
    return ranks


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0  # not written yet, or caught mid-write


def report_rank(rank: int, out_dir: str, run: Callable[[dict[str, Any]], None]) -> None:
    """One spawned rank (of this runner or ``colocated.py``'s): ``run(report)`` fills its
    report; written whatever happens, an error included, for the driver (which decides
    what to raise). A failed rank exits non-zero at once: peers waiting on it see it."""
    import torch

    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank, "backends": {}}
    try:
        run(result)
    except BaseException as err:  # reported to the driver, which decides what to raise
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if "error" in result:
        os._exit(1)


def _worker(rank: int, cfg_json: str, plan_path: str, port: int, out_dir: str, secret: str) -> None:
    """One spawned rank: run it and write its report, errors included, for the driver."""

    def run(result: dict[str, Any]) -> None:
        _run_rank(rank, RunConfig(**json.loads(cfg_json)), plan_path, port, secret, result)

    report_rank(rank, out_dir, run)


def _run_rank(
    rank: int, cfg: RunConfig, plan_path: str, port: int, secret: str, result: dict
) -> None:
    """Join the refit group, then time every backend for ``cfg.steps`` steps (after one
    warm-up refit), checking an inference rank's tensors after the last step."""
    import torch

    # Loaded in the ranks only: importing the runner (every CLI command does) stays light.
    from ..engine.delta import DeltaOptions
    from ..engine.materialize import SyntheticWeights, materialize
    from ..integrations.worker import RefitEndpoint, RefitWorker
    from .destination import destination_tensors
    from .training import TrajectoryWeights, refill

    # Each worker reads only its own slice of the plan (written by the driver).
    plan_json = Path(plan_path).with_name(f"plan{rank}.json").read_text()
    spec, sources, destinations = build_layouts(cfg)
    # the trained weights; with deltas, Adam steps between refits (runner/training.py)
    weights = (
        TrajectoryWeights(spec.unquantized(), str(Path(plan_path).with_name(TRAJECTORY)))
        if cfg.delta
        else SyntheticWeights(spec.unquantized(), cfg.seed)
    )
    s = len(sources)
    is_source = rank < s
    layout = sources[rank] if is_source else destinations[rank - s]
    if cfg.transport == "cupy-nccl" or cfg.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if is_source:
        tensors = materialize(layout, weights, fill=float("nan"), device=device)
    else:
        mine = destination_tensors(cfg, spec, layout, rank - s, weights, device)
        tensors = mine.tensors
    endpoint = RefitEndpoint(
        "127.0.0.1", port, s + len(destinations), rank, cfg.transport, cfg.timeout_s,
        cfg.connect_timeout_s, secret=secret,
    )  # fmt: skip
    delta = DeltaOptions(cfg.anchor_every, cpu_kernel=cfg.delta_kernel, check=cfg.delta_check)
    worker = RefitWorker(
        endpoint, tensors, device, overlap=cfg.overlap, host_staged=cfg.host_staged
    )
    worker.join()
    result["transport"] = type(worker.transport).__name__
    bplan = (
        plan_broadcast(spec, sources, destinations, cfg.bucket_mb)
        if ("broadcast" in cfg.backends)
        else None
    )
    progress = Path(plan_path).with_name(f"progress{rank}")
    done = 0
    for b_index, backend in enumerate(cfg.backends):
        # "delta": the reshard plan, each message in its smallest form (engine/delta/program.py)
        worker.delta = delta if backend == "delta" else None
        worker.load_plan(plan_json, "reshard" if backend == "delta" else backend, bplan)
        worker.refit()  # warm-up: gloo connects pairs lazily on first use
        timings, steps = [], []
        for step in range(cfg.steps):
            if cfg.delta:  # an optimizer step
                weights.advance()
                if is_source:
                    refill(layout, tensors, weights)
                else:
                    mine.retrain(weights)
            if not is_source and backend != "delta":  # a delta receiver keeps what it holds
                mine.poison()
            if cfg.kill_rank == rank and b_index == 0 and step == cfg.kill_step:
                os._exit(3)  # simulated crash: no cleanup, sockets reset
            worker.barrier()  # every rank starts the step together
            timing = worker.refit()
            timings.append([timing.seconds, timing.exchange_seconds])
            if backend == "delta":
                steps.append(_delta_step(worker, None if is_source else mine, cfg.verify))
            done += 1
            progress.write_text(str(done))
        entry: dict[str, Any] = {"timings": timings, "staging_bytes": _staging(worker.refitter)}
        if steps:
            entry["delta"] = steps
        if not is_source and cfg.verify:
            entry["mismatches"] = mine.mismatches()
        result["backends"][backend] = entry


def _staging(refitter: Any) -> int:
    """Bytes of staging buffers the rank's compiled program holds (0 if it reports none)."""
    return int(getattr(refitter.program, "staging_bytes", 0))


def _delta_step(worker: Any, mine: Any, verify: bool) -> dict[str, Any]:
    """One delta step's figures on this rank (``engine.delta.DeltaStats``) and, on an
    inference rank with ``verify``, the tensors that differ from the trained weights."""
    from .training import delta_figures  # in the ranks only (it loads torch)

    out = delta_figures(worker.refitter.delta.last, worker.refitter.delta.baseline_bytes)
    if mine is not None and verify:
        out["mismatches"] = mine.mismatches()
    return out
