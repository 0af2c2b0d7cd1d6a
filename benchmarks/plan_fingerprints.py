"""Fingerprints of the plans behind docs/benchmarks.md's published table.

    python benchmarks/plan_fingerprints.py OUT.json [--large]

For every run of ``shared/reference/published_runs.json`` that names its parallelism
(the rows of ``benchmarks/published.py``), the plans that script builds (relay none,
chain where it is built, domain; on the publisher's cluster model) and the ``relay="auto"``
plan, each as ``{"fingerprint", "rounds"}``. Run it on two codes and compare the files
with ``python scripts/compare_fingerprints.py``: a change that keeps every plan gives
identical files. ``--large`` adds the DeepSeek-V3 and Qwen3-235B runs (a minute or more
each per relay mode).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from published import CLUSTERS, LARGE, RUNS, UNEVEN, cluster_for

from nemo_refit_reshard.plan import plan_refit

try:  # the cluster model's home since the plan/ move; before it, plan/topology.py
    from nemo_refit_reshard.plan import Placement, Topology
except ImportError:
    from nemo_refit_reshard.plan.topology import Placement, Topology
try:  # the runner's home since the CLI move; before it, integrations/spawn.py
    from nemo_refit_reshard.runner import RunConfig, build_layouts
except ImportError:
    from nemo_refit_reshard.integrations.spawn import RunConfig, build_layouts

assert CLUSTERS  # (the cluster models are published.py's)


def plans_of(run: dict) -> dict[str, dict]:
    # The run's config as published.py builds it, repeated here: this script runs on
    # older codes too, whose packages lack what published.py imports beyond CLUSTERS.
    model, train, infer = run["model"], run["train"], run["infer"]
    pp = next((int(kv.split("=")[1]) for kv in train.split(",") if kv.startswith("pp=")), 1)
    first, last = UNEVEN.get((model, pp), (None, None))
    cfg = RunConfig(
        model=model, train=train, infer=infer, first_stage_layers=first, last_stage_layers=last
    )
    _, cluster = cluster_for(run["hardware"])
    spec, src, dst = build_layouts(cfg)
    links = Topology(cluster, Placement.packed(len(src), len(dst), cluster))
    modes = ("none", "domain", "auto") if model in LARGE else ("none", "chain", "domain", "auto")
    out = {}
    for relay in modes:
        t0 = time.perf_counter()
        plan = plan_refit(spec, src, dst, relay=relay, links=links)
        out[relay] = {"fingerprint": plan.fingerprint, "rounds": plan.num_rounds}
        print(f"  {relay}: {plan.fingerprint} ({time.perf_counter() - t0:.0f} s)", flush=True)
        del plan
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--large", action="store_true")
    args = parser.parse_args()
    runs = [r for r in json.load(open(RUNS))["runs"] if r["train"] and r["infer"]]
    result = {}
    for run in runs:
        if run["model"] in LARGE and not args.large:
            continue
        key = (
            f"{run['model']} {run['train']} -> {run['infer']} on {cluster_for(run['hardware'])[0]}"
        )
        print(key, flush=True)
        for relay, value in plans_of(run).items():
            result[f"{key} relay={relay}"] = [value["fingerprint"], value["rounds"]]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
