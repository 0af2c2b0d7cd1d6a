"""Refit into a block-FP8 engine: bytes on the wire with e4m3 + scales where training
ranks hold whole blocks, against the trained dtype everywhere (NeMo RL's own
generation-side quantization: BF16 out, quantized by each inference rank) and against
its gather-broadcast. Predicted times on a cluster for the frontier case.

    python benchmarks/fp8_bytes.py [--large]

Each model is its preset served block-FP8 (128x128, as DeepSeek-V3's, Kimi-K2's and
Qwen3's -FP8 checkpoints; ``ModelSpec.quantized``). Both plans are built from the same
layouts in one run (``refit_layouts(..., fp8_on_wire=True / False)``); ``--large`` adds
DeepSeek-V3 256 -> 256 on 8-GPU nodes (450 GB/s NVLink, 50 GB/s NIC), planned for
that cluster, with each plan's predicted time (``predict_refit``) and floor.
"""

from __future__ import annotations

import sys
import time

from nemo_refit_reshard.layouts import MegatronOptions, refit_layouts
from nemo_refit_reshard.plan import (
    Cluster,
    Placement,
    Topology,
    bandwidth_floor,
    plan_refit,
    predict_refit,
)
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec
from nemo_refit_reshard.spec.quantization import BlockFp8

CASES = [
    ("qwen3-8b", "tp=4,pp=2,dp=2", "tp=2,dp=4"),
    ("qwen3-30b-a3b", "pp=2,dp=8,ep=8", "tp=4,engine_dp=2,ep=8"),
    ("qwen3-235b-a22b", "tp=4,pp=2,dp=8,ep=16,etp=1", "tp=4,dp=16"),
]
# vLLM tp=32 would cut the dense MLP (18432 / 32 = 576 rows) off the blocks: tp=16.
LARGE = [("deepseek-v3", "pp=16,dp=16,ep=16", "tp=16,dp=16")]
# Uneven pipeline stages where the layer count needs them (as benchmarks/published.py).
STAGES = {("deepseek-v3", 16): (3, 2)}
CLUSTER = "gpus_per_node=8,nvlink_gbps=450,nic_gbps=50"


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def row(model: str, train: str, infer: str, cluster: Cluster | None) -> str:
    spec = load_model_spec(model).quantized(BlockFp8((128, 128)))
    tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
    plans, seconds = [], []
    for on_wire in (True, False):
        t0 = time.perf_counter()
        first, last = STAGES.get((model, tp.pp), (None, None))
        megatron = MegatronOptions(
            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last
        )
        src, dst = refit_layouts(spec, tp, ip, megatron, fp8_on_wire=on_wire)
        links = None
        if cluster is not None:
            links = Topology(cluster, Placement.packed(len(src), len(dst), cluster))
        plan = plan_refit(spec, src, dst, links=links)
        seconds.append(time.perf_counter() - t0)
        floor = bandwidth_floor(plan, src, dst, links).seconds if links else None
        predicted = predict_refit(plan, links).seconds if links else None
        plans.append((plan, predicted, floor))
    (fp8, t_fp8, f_fp8), (bf16, t_bf16, _) = plans
    by = dict(fp8.stats.bytes_by_dtype)
    e4m3, scales = by.get("float8_e4m3fn", 0), by.get("float32", 0)
    time_cols = (
        f" {t_fp8:.2f} s (floor {f_fp8:.2f} s) | {t_bf16:.2f} s |"
        if t_fp8 is not None
        else " — | — |"
    )
    return (
        f"| {model} | {train} → {infer} | {gib(fp8.stats.total_bytes)} "
        f"({gib(e4m3)} e4m3, {scales / 2**20:,.1f} MiB scales) | {gib(bf16.stats.total_bytes)} "
        f"| {bf16.stats.total_bytes / fp8.stats.total_bytes:.2f}x | "
        f"{gib(fp8.stats.baseline_bytes)} "
        f"| {fp8.stats.baseline_bytes / fp8.stats.total_bytes:.2f}x "
        f"|{time_cols} {seconds[0]:.1f} s |"
    )


def main(argv: list[str]) -> int:
    print(
        "| model (block FP8 engine) | training → inference | reshard, FP8 on the wire "
        "| reshard, BF16 on the wire | BF16/FP8 | gather-broadcast (BF16, NeMo RL's) "
        "| broadcast/FP8 | predicted, FP8 wire | predicted, BF16 wire | plan build |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        print(row(*case, None))
        sys.stdout.flush()
    if "--large" in argv:
        for case in LARGE:
            print(row(*case, Cluster.parse(CLUSTER)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
