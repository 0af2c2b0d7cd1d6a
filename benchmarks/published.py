"""Published refit configurations, re-planned and predicted on a matching cluster model.

    python benchmarks/published.py [--large]

For every run in ``shared/reference/published_runs.json`` that names its
parallelism: build our plans (direct, relay chain, relay domain), predict their time on a
cluster model of the publisher's hardware, compute the bandwidth floor and
the gather-broadcast baseline on the same model, and print a markdown row.
Ours are predictions; the publishers' numbers are measurements.

Hardware assumptions (per GPU, per direction): H100 — 8 GPUs/node, NVLink
450 GB/s, one 400 Gb/s NIC (50 GB/s); GB200 NVL72 (4 GPUs/node per the
publisher, but one NVLink domain of 72 GPUs) — modelled as 72 GPUs per NVLink
domain at 900 GB/s NVLink and 50 GB/s NIC between domains.

``--large`` adds the DeepSeek-V3 and Qwen3-235B runs (direct plans only; about
a minute each on one core here, most of it the baseline and the prediction).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from nemo_refit_reshard.plan import (
    Cluster,
    Placement,
    Topology,
    bandwidth_floor,
    plan_refit,
    predict_broadcast_layouts,
    predict_refit,
)
from nemo_refit_reshard.runner import RunConfig, build_layouts

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = os.path.join(HERE, "..", "..", "shared", "reference", "published_runs.json")
CLUSTERS = {
    "H100": Cluster(gpus_per_node=8, nvlink_gbps=450, nic_gbps=50),
    "GB200": Cluster(gpus_per_node=72, nvlink_gbps=900, nic_gbps=50),
}
# Megatron needs the first/last pipeline stage sizes when 61 layers do not split evenly.
UNEVEN = {
    ("deepseek-v3", 4): (16, 15),
    ("deepseek-v3", 16): (3, 2),
    ("qwen3-235b-a22b", 4): (23, 23),
}
LARGE = ("deepseek-v3", "qwen3-235b-a22b")


def cluster_for(hardware: str) -> tuple[str, Cluster]:
    key = "GB200" if "GB200" in hardware else "H100"
    return key, CLUSTERS[key]


def row(run: dict) -> str:
    model, train, infer = run["model"], run["train"], run["infer"]
    pp = next((int(kv.split("=")[1]) for kv in train.split(",") if kv.startswith("pp=")), 1)
    first, last = UNEVEN.get((model, pp), (None, None))
    cfg = RunConfig(
        model=model, train=train, infer=infer, first_stage_layers=first, last_stage_layers=last
    )
    name, cluster = cluster_for(run["hardware"])
    t0 = time.perf_counter()
    spec, src, dst = build_layouts(cfg)
    placement = Placement.packed(len(src), len(dst), cluster)
    links = Topology(cluster, placement)
    results = {}
    # A "chain" plan lists every replica's transfers separately (8-16x a direct plan's),
    # so the frontier-size runs build only the direct and the "domain" plans.
    for relay in ("none", "domain") if model in LARGE else ("none", "chain", "domain"):
        plan = plan_refit(spec, src, dst, relay=relay, links=links)
        results[relay] = predict_refit(plan, Topology(cluster, placement)).seconds
        if relay == "none":
            floor = bandwidth_floor(plan, src, dst, Topology(cluster, placement))
        del plan
    base = predict_broadcast_layouts(spec, src, dst, Topology(cluster, placement)).seconds
    best = min(results.values())
    chain = f"{results['chain']:.3f} s" if "chain" in results else "not built"
    theirs = run["seconds"]
    published = "; ".join(f"{k} {v}" for k, v in theirs.items()) if theirs else "—"
    return (
        f"| {model} | {run['as_published']} | {name} | {results['none']:.3f} s "
        f"| {chain} | {results['domain']:.3f} s | {floor.seconds:.3f} s ({floor.binding.key}) "
        f"| {best / floor.seconds:.2f}x | {base:.2f} s | {published} "
        f"| {time.perf_counter() - t0:.0f} s |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--large", action="store_true")
    parser.add_argument(
        "--max-ranks",
        type=int,
        default=10**9,
        help="skip runs with more training+inference ranks than this",
    )
    args = parser.parse_args()
    runs = [r for r in json.load(open(RUNS))["runs"] if r["train"] and r["infer"]]
    print(
        "| model | configuration (as published) | cluster | ours direct | ours relay chain "
        "| ours relay domain | floor (term) | best / floor | gather-broadcast | published (s) "
        "| planning |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        if run["model"] in LARGE and not args.large:
            print(
                f"| {run['model']} | {run['as_published']} | | not run (needs --large) "
                "| | | | | | | |"
            )
            continue
        print(row(run))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
