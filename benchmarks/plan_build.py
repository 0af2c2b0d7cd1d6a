"""Plan build at frontier scale, single core: layouts, plan, plan file, one rank's share.

    python benchmarks/plan_build.py            # + --quick for the Qwen3-30B row only

For each configuration: time to build every rank's layout, time for
``plan_refit`` over all ranks (one plan object), transfers (stored once per
inference replica group, and as every rank sees them), rounds, the full plan's
JSON (time and size), and one training rank's and one inference rank's share:
cutting the slice, its JSON size, parsing it and compiling the rank's program
from it (tensors on the ``meta`` device). Workers load only their slice.

Configurations:

* DeepSeek-V3, NeMo RL's published PP16xEP16 -> TP32xDP8 (256 -> 256 GPUs);
  Megatron first stage 3 layers, last stage 2 (61 layers over 16 stages).
* Kimi-K2 256 -> 128 GPUs (Perplexity's figure; parallelism not published):
  we assume PP16xEP16 training (24 experts per rank) -> TP16xDP8 inference,
  in bf16 on both sides (Perplexity serves FP8).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import resource
import subprocess
import sys
import time

import torch

from nemo_refit_reshard.engine.program import TORCH_DTYPES, RankProgram
from nemo_refit_reshard.layouts import MegatronOptions, RankLayout, megatron_layout, vllm_layout
from nemo_refit_reshard.plan import RankPlan, plan_refit, rank_plan
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec

UNEVEN = {"num_layers_in_first_pipeline_stage": 3, "num_layers_in_last_pipeline_stage": 2}
CASES = [
    ("qwen3-30b-a3b", "pp=2,dp=8,ep=8", "tp=8,dp=2", {}, 8),
    ("deepseek-v3", "pp=16,dp=16,ep=16", "tp=32,dp=8", UNEVEN, 16),
    ("kimi-k2", "pp=16,dp=16,ep=16", "tp=16,dp=8", UNEVEN, 16),
]


def build_layouts(model: str, train: str, infer: str, mopts: dict):
    spec = load_model_spec(model)
    tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
    src = [megatron_layout(spec, tp, r, MegatronOptions(**mopts)) for r in range(tp.world_size)]
    # Inference replicas hold identical layouts: build one per engine rank and relabel
    # (the plan groups them by their ``replicas`` either way).
    shards = [vllm_layout(spec, ip, r) for r in range(ip.engine_world_size)]
    dst = [
        dataclasses.replace(shards[r % ip.engine_world_size], rank=r) for r in range(ip.world_size)
    ]
    return spec, tp, ip, src, dst


def meta_tensors(layout: RankLayout) -> dict[str, torch.Tensor]:
    return {
        t.name: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device="meta")
        for t in layout.tensors
    }


def share(plan, group_rank: int, layout: RankLayout) -> tuple[float, int, float]:
    """Seconds to cut and serialise a rank's slice, its JSON size, seconds for the
    worker to parse it and compile its program."""
    t0 = time.perf_counter()
    text = rank_plan(plan, group_rank).to_json()
    cut = time.perf_counter() - t0
    t0 = time.perf_counter()
    RankProgram(RankPlan.from_json(text), group_rank, meta_tensors(layout), device="meta")
    return cut, len(text), time.perf_counter() - t0


def row(model: str, train: str, infer: str, mopts: dict, training_rank: int) -> str:
    t0 = time.perf_counter()
    spec, tp, ip, src, dst = build_layouts(model, train, infer, mopts)
    layouts_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = plan_refit(spec, src, dst)
    plan_s = time.perf_counter() - t0
    stored = sum(len(m.transfers) for msgs in plan.class_rounds for m in msgs)
    t0 = time.perf_counter()
    size = len(plan.to_json())
    json_s = time.perf_counter() - t0
    s = plan.num_sources
    # A worker's process holds its slice, not the driver's millions of plan objects:
    # keep the cyclic GC from rescanning those while timing the worker's side.
    gc.freeze()
    train_cut, train_size, train_compile = share(plan, training_rank, src[training_rank])
    infer_cut, infer_size, infer_compile = share(plan, s, dst[0])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return (
        f"| {model} | {train} → {infer} | {tp.world_size} → {ip.world_size} "
        f"| {layouts_s:.1f} s | **{plan_s:.1f} s** | {layouts_s + plan_s:.1f} s "
        f"| {stored:,} / {plan.stats.num_transfers:,} | {plan.num_rounds} "
        f"| {size / 2**20:,.0f} MiB in {json_s:.1f} s "
        f"| {train_size / 2**20:.1f} MiB, {train_cut:.1f} s, {train_compile:.2f} s "
        f"| {infer_size / 2**20:.1f} MiB, {infer_cut:.1f} s, {infer_compile:.2f} s "
        f"| {peak:.1f} GiB |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="only the Qwen3-30B row")
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.case is not None:
        print(row(*CASES[args.case]), flush=True)
        return 0
    print(
        "| model | training → inference | GPUs | layouts | plan | layouts + plan "
        "| transfers (stored / all ranks) | rounds | plan JSON "
        "| training rank's share: JSON, cut, load + compile "
        "| inference rank's share: JSON, cut, load + compile | peak memory |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    # One process per row, so peak memory is that configuration's own.
    for i in range(1 if args.quick else len(CASES)):
        subprocess.run([sys.executable, __file__, "--case", str(i)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
