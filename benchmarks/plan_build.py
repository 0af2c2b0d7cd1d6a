"""Plan build time, single core: every rank's plan from every rank's layout.

    python benchmarks/plan_build.py [--deepseek]

Times layouts and ``plan_refit`` separately, and reports plan size (JSON).
``--deepseek`` adds DeepSeek-V3 pp=16,dp=16,ep=16 -> tp=32,dp=8 (long: see
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout, vllm_layout
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec

CASES = [
    ("qwen3-30b-a3b", "pp=2,dp=8,ep=8", "tp=8,dp=2", {}),
]
DEEPSEEK = ("deepseek-v3", "pp=16,dp=16,ep=16", "tp=32,dp=8",
            {"num_layers_in_first_pipeline_stage": 3, "num_layers_in_last_pipeline_stage": 2})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deepseek", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = CASES + ([DEEPSEEK] if args.deepseek else [])
    print("| model | training | inference | ranks | layouts | plan | transfers | plan JSON |")
    print("|---|---|---|---|---|---|---|---|")
    for model, train, infer, mopts in cases:
        spec = load_model_spec(model)
        tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
        t0 = time.perf_counter()
        src = [megatron_layout(spec, tp, r, MegatronOptions(**mopts)) for r in range(tp.world_size)]
        # Inference replicas hold identical layouts: build one per engine rank, relabel the rest.
        shards = [vllm_layout(spec, ip, r) for r in range(ip.engine_world_size)]
        dst = [dataclasses.replace(shards[r % ip.engine_world_size], rank=r)
               for r in range(ip.world_size)]
        t1 = time.perf_counter()
        plan = plan_refit(spec, src, dst)
        t2 = time.perf_counter()
        size = len(plan.to_json())
        print(f"| {model} | {train} | {infer} | {tp.world_size} → {ip.world_size} "
              f"| {t1 - t0:.1f} s | {t2 - t1:.1f} s | {plan.stats.num_transfers:,} "
              f"| {size / 2**20:,.0f} MiB |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
