"""Plan build time at 256 GPUs per side, this code against an earlier checkout, side by side.

    git worktree add /tmp/base b7de692    # the code before the planner passes (#15)
    python benchmarks/plan_speed.py --baseline /tmp/base [--cpu 0] [--quick]
                                    [--paired [--swap]] [--cluster none|H100|GB200 ...]
    python benchmarks/plan_speed.py --baseline CHECKOUT --mid [...]
    python benchmarks/plan_speed.py --baseline CHECKOUT --quick --paired \
        --cluster H100 --cluster GB200 --baseline-relay auto   # a move, same plans

``--mid``: instead, MoE models at 16 + 16 GPUs, where ``relay="auto"`` also schedules the
relay chain (it is a candidate below 2 million transfers), both codes with ``"auto"``
(the baseline must have it: ``plan_refit(relay="auto")``, since f09a13f).

Every row is one ``plan_refit`` over every rank of both sides, in a fresh process on
one core (``taskset``), this code and the baseline one after the other; with
``--paired`` both at the same time, on cores ``cpu`` and ``cpu + 1``, so a drift of the
machine's speed hits both alike (each then shares the machine with the other). With a cluster
this code plans with ``relay="auto"`` (it picks the relay mode, ``plan/relay_choice.py``)
and the baseline with ``relay="domain"``, the best mode it could build at this scale;
without one both plan with ``relay="none"``. Reported: seconds (wall and CPU), the
relay used, the predicted refit time on the cluster model, rounds, peak memory, and the
seconds of a fixed Python loop (3 million dictionary updates) run just before the plan:
this machine's speed drifts, and the loop shows how fast it was for that row.
Layouts are built before the clock starts (as in ``benchmarks/plan_build.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# (model, training, inference, Megatron's layers in its first and last pipeline stage)
CASES = [
    ("deepseek-v3", "pp=16,dp=16,ep=16", "tp=32,dp=8", "3,2"),
    ("kimi-k2", "pp=16,dp=16,ep=16", "tp=16,dp=8", "3,2"),
]
MID_CASES = [
    ("qwen3-30b-a3b", "pp=2,dp=8,ep=8", "tp=8,dp=2", ""),
    ("qwen3-235b-a22b", "pp=2,dp=8,ep=8", "tp=8,dp=2", ""),
]
CLUSTERS = {
    "none": None,
    "H100": "gpus_per_node=8,nvlink_gbps=450,nic_gbps=50",
    "GB200": "gpus_per_node=72,nvlink_gbps=900,nic_gbps=50",
}

CHILD = r"""
import dataclasses, json, os, resource, sys, time
import nemo_refit_reshard
from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout, vllm_layout
from nemo_refit_reshard.plan import plan_refit
try:  # since the plan/ move: one cluster model, predictions take the Topology
    from nemo_refit_reshard.plan import Cluster, Placement, Topology, predict_refit
    def predicted(plan, links):
        return predict_refit(plan, links).seconds
except ImportError:  # before it: plan/topology.py, predict_refit(plan, cluster, placement)
    from nemo_refit_reshard.plan.predict import predict_refit
    from nemo_refit_reshard.plan.topology import Cluster, Placement, Topology
    def predicted(plan, links):
        return predict_refit(plan, links.cluster, links.placement).seconds
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec

model, train, infer, cluster_text, relay, stages = sys.argv[1:7]
opts = MegatronOptions()
if stages:  # e.g. 61 layers over 16 stages: Megatron's first stage 3 layers, last 2
    first, last = map(int, stages.split(","))
    opts = MegatronOptions(
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last
    )
spec = load_model_spec(model)
tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
src = [megatron_layout(spec, tp, r, opts) for r in range(tp.world_size)]
shards = [vllm_layout(spec, ip, r) for r in range(ip.engine_world_size)]
dst = [dataclasses.replace(shards[r % ip.engine_world_size], rank=r) for r in range(ip.world_size)]
links = cluster = placement = None
if cluster_text != "none":
    cluster = Cluster.parse(cluster_text)
    placement = Placement.packed(len(src), len(dst), cluster)
    links = Topology(cluster, placement)
# How fast this core runs plain Python right now (machines here drift 1.5-2x): a fixed
# dictionary loop, timed just before the plan.
loop = time.perf_counter()
d = {}
for i in range(3_000_000):
    d[i & 4095] = d.get(i & 4095, 0) + i
loop = time.perf_counter() - loop
wall, cpu = time.perf_counter(), time.process_time()
plan = plan_refit(spec, src, dst, relay=relay, links=links)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
choice = getattr(plan, "relay_choice", None)
print(json.dumps({
    "package": os.path.dirname(os.path.dirname(os.path.abspath(nemo_refit_reshard.__file__))),
    "wall": wall,
    "cpu": cpu,
    "loop": loop,
    "relay": choice.chosen if choice is not None else relay,
    "predicted": predicted(plan, links) if cluster else None,
    "rounds": plan.num_rounds,
    "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
}))
"""


def start(src_root: str, args: list[str], cpu: int | None) -> subprocess.Popen:
    """One row's plan in a fresh process, pinned to ``cpu``."""
    cmd = [sys.executable, "-c", CHILD, *args]
    if cpu is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    # In the checkout's own directory: ``python -c`` puts the working directory first on
    # ``sys.path``, ahead of PYTHONPATH, so started from this repository the child would
    # import this code whatever ``src_root`` is. (Before this was fixed, every baseline
    # row of docs/benchmarks.md's planner-time tables ran this code.)
    env = dict(os.environ, PYTHONPATH=src_root)
    return subprocess.Popen(
        cmd, cwd=src_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def result(src_root: str, args: list[str], proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{src_root}: {' '.join(args)} failed:\n{err[-2000:]}")
    row = json.loads(out.strip().splitlines()[-1])
    if os.path.realpath(row["package"]) != os.path.realpath(src_root):
        raise SystemExit(f"the run for {src_root} imported the code in {row['package']}")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", required=True, help="a checkout of the earlier code")
    parser.add_argument("--cpu", type=int, default=0, help="core to pin every run to")
    parser.add_argument("--quick", action="store_true", help="the DeepSeek-V3 rows only")
    parser.add_argument(
        "--paired",
        action="store_true",
        help="run this code and the baseline at the same time on cores CPU and CPU+1",
    )
    parser.add_argument(
        "--swap", action="store_true", help="with --paired: the baseline on CPU, this on CPU+1"
    )
    parser.add_argument(
        "--cluster", action="append", choices=list(CLUSTERS), help="only these clusters' rows"
    )
    parser.add_argument(
        "--mid", action="store_true", help="the 16 + 16 GPU MoE rows, relay auto on both codes"
    )
    parser.add_argument(
        "--baseline-relay",
        default=None,
        help='the baseline\'s relay mode with a cluster (default "domain", with --mid "auto")',
    )
    args = parser.parse_args()
    print(
        "| model | training → inference | cluster | code | relay | plan (wall) | plan (CPU) "
        "| predicted refit | rounds | peak memory | reference loop | this / baseline |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cases = MID_CASES if args.mid else CASES[:1] if args.quick else CASES
    for model, train, infer, stages in cases:
        for name, cluster in CLUSTERS.items():
            if args.cluster and name not in args.cluster or args.mid and not cluster:
                continue
            base_relay = args.baseline_relay or ("auto" if args.mid else "domain")
            codes = (
                ("this", ROOT, "auto" if cluster else "none"),
                ("baseline", os.path.abspath(args.baseline), base_relay if cluster else "none"),
            )
            runs = {}
            if args.paired:  # both at once, one core each: the same machine for both
                procs = [
                    (code, root, argv, start(root, argv, args.cpu + i))
                    for i, (code, root, relay) in enumerate(codes[::-1] if args.swap else codes)
                    for argv in [[model, train, infer, cluster or "none", relay, stages]]
                ]
                for code, root, argv, proc in procs:
                    runs[code] = result(root, argv, proc)
            else:  # one after the other on one core
                for code, root, relay in codes:
                    argv = [model, train, infer, cluster or "none", relay, stages]
                    runs[code] = result(root, argv, start(root, argv, args.cpu))
            for code, r in runs.items():
                pred = f"{r['predicted']:.4f} s" if r["predicted"] is not None else "—"
                ratio = runs["this"]["cpu"] / runs["baseline"]["cpu"]
                print(
                    f"| {model} | {train} → {infer} | {name} | {code} | {r['relay']} "
                    f"| {r['wall']:.1f} s | {r['cpu']:.1f} s | {pred} | {r['rounds']} "
                    f"| {r['peak_gib']:.1f} GiB | {r['loop']:.2f} s "
                    f"| {f'{ratio:.2f}x' if code == 'this' else ''} |"
                )
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
