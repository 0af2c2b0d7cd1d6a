"""The colocated refit between local processes: the CPU twin of same-GPU refits.

Training rank ``s`` and inference rank ``d`` with ``hosts[d] == s`` stand for one GPU:
two processes that share the host's staging through OS shared memory (CUDA IPC on a
GPU, ``engine/staging.py``) and hand rounds over a local connection. The training ranks
form the gloo refit group. Every inference rank checks its tensors bit for bit after
the last step, as in ``spawn.py``; the reports have the same shape, under the backend
name :data:`BACKEND`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ..engine.rendezvous import free_port, new_secret
from ..plan import Colocation, RankPlan, RefitPlan, plan_refit
from .config import RunConfig, build_layouts
from .spawn import RunResult, collect_reports, wait_ranks, write_plans

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
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    if cfg.connect_timeout_s is None:
        cfg = replace(cfg, connect_timeout_s=join_timeout_s)
    plan = plan or colocated_plan(cfg)
    world = plan.num_sources + plan.num_destinations
    ports = [free_port() for _ in range(plan.num_sources)]  # host s listens for its guest
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = write_plans(plan, world, tmp)
        ctx = mp.start_processes(
            _worker,
            args=(json.dumps(asdict(cfg)), plan_path, free_port(), ports, tmp, new_secret()),
            nprocs=world,
            start_method="spawn",
            join=False,
        )
        hung = wait_ranks(ctx.processes, tmp, join_timeout_s, world * cfg.steps, progress)
        ranks = collect_reports(ctx.processes, tmp, hung)
    return RunResult(plan, ranks, time.perf_counter() - t0)


def _worker(
    rank: int, cfg_json: str, plan_path: str, port: int, ports: list[int], out: str, secret: str
) -> None:
    import torch

    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank, "backends": {}}
    try:
        cfg = RunConfig(**json.loads(cfg_json))
        _run(rank, cfg, Path(plan_path), port, ports, secret, result)
    except BaseException as err:  # reported to the driver
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if "error" in result:
        os._exit(1)


def _run(
    rank: int, cfg: RunConfig, plan_path: Path, port: int, ports: list[int], secret: str,
    result: dict[str, Any],
) -> None:  # fmt: skip
    from multiprocessing.connection import Client, Listener

    from ..engine.colocated import ColocatedGuest, ColocatedHost
    from ..engine.materialize import SyntheticWeights, materialize, mismatches
    from ..engine.transport import GlooTransport

    def share(r: int) -> RankPlan:
        return RankPlan.from_json(plan_path.with_name(f"plan{r}.json").read_text())

    spec, sources, destinations = build_layouts(cfg)
    weights, s = SyntheticWeights(spec, cfg.seed), len(sources)
    own = share(rank)
    hosts = own.colocated_hosts
    progress = plan_path.with_name(f"progress{rank}")
    timings, key = [], secret.encode()[:32]
    if rank < s:  # a training rank: the refit group's member, and its guest's host
        tensors = materialize(sources[rank], weights, fill=float("nan"))
        guest_rank = Colocation(hosts).guest_of(rank, s)
        guest = share(guest_rank) if guest_rank is not None else None
        host = ColocatedHost(own, guest, rank, tensors)
        if guest is not None:
            with Listener(("127.0.0.1", ports[rank]), authkey=key) as listener:
                conn = listener.accept()
            host.attach(conn, cfg.timeout_s)
        network = GlooTransport(
            "127.0.0.1", port, rank, s, cfg.timeout_s, cfg.connect_timeout_s, secret=secret
        )
        for step in range(cfg.steps + 1):  # the first: warm-up (gloo connects lazily)
            t0 = time.perf_counter()
            waited = host.replay(network)
            if step:
                timings.append([time.perf_counter() - t0, waited])
                progress.write_text(str(step))
        entry: dict[str, Any] = {"timings": timings, "staging_bytes": host.staging_bytes}
    else:
        layout = destinations[rank - s]
        tensors = materialize(layout, weights, fill=float("nan"))
        worker = ColocatedGuest(own, rank, tensors)
        conn = _connect(Client, ("127.0.0.1", ports[hosts[rank - s]]), key, cfg)
        worker.attach(conn, cfg.timeout_s)
        for step in range(cfg.steps + 1):
            for t in tensors.values():
                t.fill_(float("nan"))
            t0 = time.perf_counter()
            waited = worker.replay()
            if step:
                timings.append([time.perf_counter() - t0, waited])
                progress.write_text(str(step))
        entry = {"timings": timings, "staging_bytes": 0}
        if cfg.verify:
            entry["mismatches"] = mismatches(layout, tensors, weights)
    result["backends"][BACKEND] = entry


def _connect(client: Any, address: tuple[str, int], key: bytes, cfg: RunConfig) -> Any:
    """The guest's connection to its host, which listens once it has compiled."""
    deadline = time.monotonic() + (cfg.connect_timeout_s or cfg.timeout_s)
    while True:
        try:
            return client(address, authkey=key)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


__all__ = ["BACKEND", "colocated_plan", "run_colocated"]
