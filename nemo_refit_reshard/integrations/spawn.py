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
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..engine.rendezvous import new_secret
from ..layouts import MegatronOptions, VllmOptions, megatron_layout, vllm_layouts
from ..plan import RefitPlan, plan_refit, rank_plan
from ..spec import InferParallel, TrainParallel, load_model_spec


@dataclass
class RunConfig:
    model: str = "small-qwen3"
    train: str = "tp=2,pp=2"
    infer: str = "tp=2,dp=2"
    backends: tuple[str, ...] = ("reshard", "broadcast")
    steps: int = 3
    bucket_mb: float = 512
    relay: str = "none"  # "chain": forward between inference replicas
    timeout_s: float = 600
    seed: int = 0
    train_dtype: str | None = None  # e.g. "float32" master weights; default checkpoint dtype
    first_stage_layers: int | None = None  # Megatron num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # Megatron num_layers_in_last_pipeline_stage
    infer_dtype: str | None = None
    verify: bool = True
    transport: str = "gloo"  # or "cupy-nccl" (one GPU per rank, round robin over devices)
    kill_rank: int | None = None  # fault injection: this group rank dies ...
    kill_step: int = 0  # ... at the start of this step of the first backend
    overlap: bool | None = None  # overlapped replay (engine/pipeline.py); None: CUDA only
    device: str = "cpu"  # gloo ranks' tensors: "cpu", or "cuda" (through host twins)
    host_staged: bool | None = None  # gloo through host twins; None: when device is cuda
    connect_timeout_s: float | None = None  # rendezvous; None: run_local's join timeout

    def parallel(self) -> tuple[TrainParallel, InferParallel]:
        return TrainParallel.parse(self.train), InferParallel.parse(self.infer)


def build_layouts(cfg: RunConfig):
    spec = load_model_spec(cfg.model)
    tpar, ipar = cfg.parallel()
    mopts = MegatronOptions(
        params_dtype=cfg.train_dtype,
        num_layers_in_first_pipeline_stage=cfg.first_stage_layers,
        num_layers_in_last_pipeline_stage=cfg.last_stage_layers,
    )
    vopts = VllmOptions(params_dtype=cfg.infer_dtype)
    sources = [megatron_layout(spec, tpar, r, mopts) for r in range(tpar.world_size)]
    destinations = vllm_layouts(spec, ipar, vopts)
    return spec, sources, destinations


def free_port() -> int:
    """A port free on the loopback interface now (local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_free_port = free_port  # the name the tests and drivers use


def _worker(rank: int, cfg_json: str, plan_path: str, port: int, out_dir: str, secret: str) -> None:
    import torch

    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank, "backends": {}}
    try:
        _run_rank(rank, RunConfig(**json.loads(cfg_json)), plan_path, port, secret, result)
    except BaseException as err:  # reported to the driver, which decides what to raise
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if "error" in result:
        os._exit(1)


def _run_rank(
    rank: int, cfg: RunConfig, plan_path: str, port: int, secret: str, result: dict
) -> None:
    import torch

    from ..engine.materialize import SyntheticWeights, materialize, mismatches
    from ..plan import plan_broadcast
    from .worker import RefitEndpoint, RefitWorker

    # Each worker reads only its own slice of the plan (written by the driver).
    plan_json = Path(plan_path).with_name(f"plan{rank}.json").read_text()
    spec, sources, destinations = build_layouts(cfg)
    weights = SyntheticWeights(spec, cfg.seed)
    s = len(sources)
    is_source = rank < s
    layout = sources[rank] if is_source else destinations[rank - s]
    if cfg.transport == "cupy-nccl" or cfg.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    tensors = materialize(layout, weights, fill=float("nan"), device=device)
    endpoint = RefitEndpoint(
        "127.0.0.1", port, s + len(destinations), rank, cfg.transport, cfg.timeout_s,
        cfg.connect_timeout_s, secret=secret,
    )  # fmt: skip
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
        worker.load_plan(plan_json, backend, bplan)
        worker.refit()  # warm-up: gloo connects pairs lazily on first use
        timings = []
        for step in range(cfg.steps):
            if not is_source:
                for t in tensors.values():
                    t.fill_(float("nan"))
            if cfg.kill_rank == rank and b_index == 0 and step == cfg.kill_step:
                os._exit(3)  # simulated crash: no cleanup, sockets reset
            worker.barrier()  # every rank starts the step together
            timing = worker.refit()
            timings.append([timing.seconds, timing.exchange_seconds])
            done += 1
            progress.write_text(str(done))
        entry: dict[str, Any] = {"timings": timings, "staging_bytes": _staging(worker.refitter)}
        if not is_source and cfg.verify:
            entry["mismatches"] = mismatches(layout, tensors, weights)
        result["backends"][backend] = entry


def _staging(refitter) -> int:
    prog = refitter.program
    return int(getattr(prog, "staging_bytes", 0))


@dataclass
class RunResult:
    plan: RefitPlan
    ranks: list[dict[str, Any]]
    seconds: float

    def errors(self) -> dict[int, str]:
        return {r["rank"]: r["error"] for r in self.ranks if "error" in r}


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def run_local(
    cfg: RunConfig,
    plan: RefitPlan | None = None,
    join_timeout_s: float = 900,
    progress: Callable[[int, int], None] | None = None,
) -> RunResult:
    """Spawn every rank on this machine, run the refit, return every rank's report."""
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    if cfg.connect_timeout_s is None:  # ranks start as fast as the machine lets them
        cfg = dataclasses.replace(cfg, connect_timeout_s=join_timeout_s)
    if plan is None:
        spec, sources, destinations = build_layouts(cfg)
        plan = plan_refit(spec, sources, destinations, bucket_mb=cfg.bucket_mb, relay=cfg.relay)
    world = plan.num_sources + plan.num_destinations
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        Path(plan_path).write_text(plan.to_json())
        for r in range(world):
            Path(tmp, f"plan{r}.json").write_text(rank_plan(plan, r).to_json())
        port = _free_port()
        ctx = mp.start_processes(
            _worker,
            args=(json.dumps(asdict(cfg)), plan_path, port, tmp, new_secret()),
            nprocs=world,
            start_method="spawn",
            join=False,
        )
        deadline = time.monotonic() + join_timeout_s
        total = world * cfg.steps * len(cfg.backends)
        while time.monotonic() < deadline and any(p.is_alive() for p in ctx.processes):
            time.sleep(0.2)
            if progress:
                done = sum(_read_int(Path(tmp, f"progress{r}")) for r in range(world))
                progress(done, total)
        hung = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        ranks = []
        for r in range(world):
            path = Path(tmp, f"rank{r}.json")
            if path.exists():
                ranks.append(json.loads(path.read_text()))
            else:
                code = ctx.processes[r].exitcode
                why = "still running at the deadline" if r in hung else f"exit code {code}"
                ranks.append({"rank": r, "error": f"process died without a report ({why})"})
    return RunResult(plan, ranks, time.perf_counter() - t0)
