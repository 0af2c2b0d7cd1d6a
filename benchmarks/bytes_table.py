"""Bytes per refit: reshard vs the minimum and vs gather-broadcast, for several configs.

    python benchmarks/bytes_table.py

Pure planning (no processes): for each configuration the plan's total bytes,
the minimum any refit must move (the sum of what every inference rank
stores), and the bytes the gather-broadcast baseline moves on the same layouts.
"""

from __future__ import annotations

import os
import sys
import time

from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout, vllm_layout
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [
    ("qwen3-0.6b", "tp=2,pp=2", "tp=4,dp=2", {}),
    ("qwen3-8b", "tp=4,pp=2,dp=2", "tp=2,dp=4", {}),
    ("llama-3.1-8b", "tp=8", "tp=1,dp=8", {}),
    ("qwen2.5-7b", "tp=4,dp=2", "tp=4,pp=2", {}),
    ("qwen3-32b", "tp=8,pp=4", "tp=4,dp=4", {}),
    ("qwen3-30b-a3b", "tp=4,pp=2,dp=2,ep=8,etp=1", "tp=8,dp=2", {}),
    ("qwen3-30b-a3b", "pp=2,dp=8,ep=8", "tp=4,engine_dp=2,ep=8", {}),
    (os.path.join(HERE, "configs/dense-gqa-250m.json"), "tp=2,pp=2", "tp=4,dp=2", {}),
    (os.path.join(HERE, "configs/moe-280m.json"), "ep=4,pp=2,dp=4", "tp=2,dp=2", {}),
]


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def main() -> int:
    print(
        "| model | training | inference | reshard | minimum | gather-broadcast | baseline/reshard "
        "| plan build |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model, train, infer, mopts in CASES:
        spec = load_model_spec(model)
        tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
        t0 = time.perf_counter()
        src = [megatron_layout(spec, tp, r, MegatronOptions(**mopts)) for r in range(tp.world_size)]
        dst = [vllm_layout(spec, ip, r) for r in range(ip.world_size)]
        plan = plan_refit(spec, src, dst)
        seconds = time.perf_counter() - t0
        s = plan.stats
        assert s.total_bytes == s.min_bytes, model
        name = os.path.basename(model).removesuffix(".json")
        print(
            f"| {name} | {train} | {infer} | {gib(s.total_bytes)} | {gib(s.min_bytes)} "
            f"| {gib(s.baseline_bytes)} | {s.baseline_bytes / s.total_bytes:.2f}x "
            f"| {seconds:.1f} s |"
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
