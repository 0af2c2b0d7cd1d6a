"""A plan per set of engines at frontier scale, on one core: derived vs planned again.

    python benchmarks/membership_plans.py            # DeepSeek-V3 256 -> 256, H100 cluster
    python benchmarks/membership_plans.py --quick    # Qwen3-30B-A3B 16 -> 16

One of 8 inference engines leaves (issue #44): the plan for the other 7 is derived
from the full plan (``plan/membership.py``) and, for comparison, planned again from
their layouts with the same settings (``plan_refit``, relay auto on the cluster's
links). Reported per leaving engine: seconds to derive, and for one of them the
seconds to plan again; bytes, rounds and the predicted refit time of both plans
(``predict_refit`` on the same topology). The process is pinned to one core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout, vllm_layout
from nemo_refit_reshard.plan import Cluster, Placement, Topology, plan_refit, predict_refit
from nemo_refit_reshard.plan.membership import MembershipPlans, narrowed_layouts
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec

UNEVEN = {"num_layers_in_first_pipeline_stage": 3, "num_layers_in_last_pipeline_stage": 2}
CASES = {
    "deepseek-v3": ("deepseek-v3", "pp=16,dp=16,ep=16", "tp=32,dp=8", UNEVEN),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", "pp=2,dp=8,ep=8", "tp=2,dp=8", {}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Qwen3-30B-A3B 16 -> 16 only")
    ap.add_argument("--leaving", default="0,7", help="engines to take out, one at a time")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    model, train, infer, mopts = CASES["qwen3-30b-a3b" if args.quick else "deepseek-v3"]
    spec = load_model_spec(model)
    tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
    src = [megatron_layout(spec, tp, r, MegatronOptions(**mopts)) for r in range(tp.world_size)]
    shards = [vllm_layout(spec, ip, r) for r in range(ip.engine_world_size)]
    n = ip.engine_world_size
    dst = [dataclasses.replace(shards[r % n], rank=r) for r in range(ip.world_size)]
    cluster = Cluster(gpus_per_node=8, nvlink_gbps=450, nic_gbps=50)
    links = Topology(cluster, Placement.packed(len(src), len(dst), cluster))
    engines = tuple(tuple(range(e * n, (e + 1) * n)) for e in range(ip.dp))
    t0 = time.perf_counter()
    # the full plan; a set derivation cannot express is planned again alike (how says)
    plans = MembershipPlans.build(spec, src, dst, engines, relay="auto", links=links)
    full = plans.plan
    full_s = time.perf_counter() - t0
    choice = full.relay_choice.chosen if full.relay_choice is not None else "none"
    rows = {
        "model": model,
        "train": train,
        "infer": infer,
        "relay": choice,
        "full_plan_s": round(full_s, 2),
        "full_total_bytes": full.stats.total_bytes,
        "full_predicted_s": round(predict_refit(full, links).seconds, 4),
        "leaving": [],
    }
    for k in (int(x) for x in args.leaving.split(",")):
        made = plans.for_engines(e for e in range(ip.dp) if e != k)
        s = len(src)
        nodes = links.placement.nodes
        kept_links = Topology(
            cluster,
            Placement(s, nodes[:s] + tuple(nodes[s + d] for d in made.destinations)),
        )
        row = {
            "engine": k,
            "how": made.how,
            "derive_s": round(made.seconds, 2),
            "total_bytes": made.plan.stats.total_bytes,
            "min_bytes": made.plan.stats.min_bytes,
            "rounds": made.plan.num_rounds,
            "predicted_s": round(predict_refit(made.plan, kept_links).seconds, 4),
        }
        if k == int(args.leaving.split(",")[-1]):
            t0 = time.perf_counter()
            fresh = plan_refit(
                spec, src, narrowed_layouts(dst, made.destinations), relay="auto",
                links=kept_links,
            )  # fmt: skip
            row["replan_s"] = round(time.perf_counter() - t0, 2)
            row["replan_total_bytes"] = fresh.stats.total_bytes
            row["replan_rounds"] = fresh.num_rounds
            row["replan_predicted_s"] = round(predict_refit(fresh, kept_links).seconds, 4)
        rows["leaving"].append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
