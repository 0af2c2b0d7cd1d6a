"""Calibrate the cluster model on this machine's CPU twin: predicted vs measured gloo refits.

    python benchmarks/calibrate.py [--steps 5]

1. Measure gloo over loopback: one pair's bandwidth (64 MiB messages), the
   aggregate bandwidth of 4 pairs sending at once, and the one-way latency of
   small messages.
2. For each configuration, build the plan, predict its time with the cluster
   model of this machine — every rank is a "GPU" on one node, so every link is
   the loopback "NVLink" — and run it (``bench``) side by side.

Two models are reported: *independent* links at the single-pair bandwidth (the
GPU model, where each GPU has its own links), and *shared*: all ranks share the
measured aggregate bandwidth of the machine (per-rank bandwidth = aggregate /
ranks busy at once). On a 2-core machine the second is the honest one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

from nemo_refit_reshard.cli.run import run_report
from nemo_refit_reshard.engine.rendezvous import free_port
from nemo_refit_reshard.plan import Cluster, Placement, Topology, plan_refit, predict_refit
from nemo_refit_reshard.runner import RunConfig, build_layouts

CASES = [
    ("small-qwen3", "tp=2,pp=2", "tp=2,dp=2", "none"),
    ("small-qwen3-moe", "ep=2,dp=2", "tp=2,dp=2", "none"),
    ("small-qwen3", "tp=2", "tp=1,dp=3", "chain"),
]
MIB = 2**20


def _pairs_worker(rank: int, world: int, port: int, size: int, reps: int, out: str) -> None:
    from nemo_refit_reshard.engine.transport import GlooTransport

    torch.set_num_threads(1)
    t = GlooTransport("127.0.0.1", port, rank, world, timeout_s=120)
    buf = torch.zeros(size, dtype=torch.uint8)
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    sends, recvs = ([(peer, buf)], []) if rank % 2 == 0 else ([], [(peer, buf)])
    t.exchange(sends, recvs)  # connect
    t.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        t.exchange(sends, recvs)
    t.barrier()
    with open(os.path.join(out, f"{rank}"), "w") as f:
        f.write(str(time.perf_counter() - t0))


def measure(world: int, size: int, reps: int) -> float:
    """Seconds for ``reps`` messages of ``size`` bytes on each of ``world/2`` pairs at once."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _pairs_worker,
            args=(world, free_port(), size, reps, tmp),
            nprocs=world,
            start_method="spawn",
        )
        return max(float(open(os.path.join(tmp, f"{r}")).read()) for r in range(world))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    one_pair = 4 * 64 * MIB / measure(2, 64 * MIB, 4)
    aggregate = 4 * 4 * 64 * MIB / measure(8, 64 * MIB, 4)
    latency = measure(2, 1, 200) / 200
    print(
        f"loopback gloo: one pair {one_pair / 1e9:.2f} GB/s, 4 pairs together "
        f"{aggregate / 1e9:.2f} GB/s, latency {latency * 1e6:.0f} us"
    )
    print()
    print(
        "| model | training → inference | relay | measured (median) | predicted, independent "
        "links | predicted, shared bandwidth |"
    )
    print("|---|---|---|---|---|---|")
    for model, train, infer, relay in CASES:
        cfg = RunConfig(
            model=model,
            train=train,
            infer=infer,
            steps=args.steps,
            backends=("reshard",),
            relay=relay,
            timeout_s=300,
        )
        spec, src, dst = build_layouts(cfg)
        plan = plan_refit(spec, src, dst, relay=relay)
        world = len(src) + len(dst)
        busy = max(2, min(world, 2 * max(len(src), len(dst))))  # ranks moving data at once
        predictions = []
        for per_rank in (one_pair, aggregate / (busy / 2)):
            cluster = Cluster(
                gpus_per_node=world, nvlink_gbps=per_rank / 1e9, nvlink_latency_us=latency * 1e6
            )
            placement = Placement.explicit((0,) * world, len(src), len(dst), cluster)
            predictions.append(predict_refit(plan, Topology(cluster, placement)).seconds)
        report, _ = run_report(cfg, show_progress=False)
        if report["errors"]:
            print(f"{model}: failed {report['errors']}", file=sys.stderr)
            return 1
        measured = report["backends"]["reshard"]["median_s"]
        print(
            f"| {model} | {train} → {infer} | {relay} | {measured * 1e3:.0f} ms "
            f"| {predictions[0] * 1e3:.0f} ms ({predictions[0] / measured:.2f}x) "
            f"| {predictions[1] * 1e3:.0f} ms ({predictions[1] / measured:.2f}x) |"
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
