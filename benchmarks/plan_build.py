"""Plan build time, single core: every rank's plan from every rank's layout.

    python benchmarks/plan_build.py [--deepseek]

Times layouts and ``plan_refit`` separately, and reports plan size (JSON).

``--deepseek`` adds DeepSeek-V3 pp=16,dp=16,ep=16 -> tp=32,dp=8. One plan object
for it does not fit this machine's memory (about 12 million transfers), so it
is built as 16 plans, one per training pipeline stage, each covering every
rank of both sides for the tensors that stage holds; the layers of different
stages never share a transfer, so together they are the whole plan. The
script checks that the stages' destination tensors partition every inference
rank's tensors and reports the summed build time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout, vllm_layout
from nemo_refit_reshard.layouts.megatron_grid import megatron_layer_chunks
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec

CASES = [
    ("qwen3-30b-a3b", "pp=2,dp=8,ep=8", "tp=8,dp=2", {}),
]
DEEPSEEK = (
    "deepseek-v3",
    "pp=16,dp=16,ep=16",
    "tp=32,dp=8",
    {"num_layers_in_first_pipeline_stage": 3, "num_layers_in_last_pipeline_stage": 2},
)


def _build(model, train, infer, mopts):
    spec = load_model_spec(model)
    tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
    t0 = time.perf_counter()
    src = [megatron_layout(spec, tp, r, MegatronOptions(**mopts)) for r in range(tp.world_size)]
    # Inference replicas hold identical layouts: build one per engine rank, relabel the rest.
    shards = [vllm_layout(spec, ip, r) for r in range(ip.engine_world_size)]
    dst = [
        dataclasses.replace(shards[r % ip.engine_world_size], rank=r) for r in range(ip.world_size)
    ]
    return spec, tp, ip, src, dst, time.perf_counter() - t0


def _stage_tensors(spec, tp, mopts, stage: int) -> tuple[str, ...]:
    """Prefixes of the canonical tensors a training pipeline stage holds."""
    first, count = megatron_layer_chunks(
        spec.arch.num_layers,
        tp,
        stage,
        mopts.get("num_layers_in_first_pipeline_stage"),
        mopts.get("num_layers_in_last_pipeline_stage"),
    )[0]
    prefixes = [f"model.layers.{i}." for i in range(first, first + count)]
    if stage == 0:
        prefixes.append("model.embed_tokens.")
    if stage == tp.pp - 1:
        prefixes += ["model.norm.", "lm_head."]
    return tuple(prefixes)


def deepseek_row() -> str:
    model, train, infer, mopts = DEEPSEEK
    spec, tp, ip, src, dst, layout_s = _build(model, train, infer, mopts)
    plan_s, transfers, size = 0.0, 0, 0
    seen: dict[tuple[int, str], int] = {}
    for stage in range(tp.pp):
        prefixes = _stage_tensors(spec, tp, mopts, stage)
        part = [
            dataclasses.replace(
                d,
                tensors=tuple(
                    t for t in d.tensors if any(p.canonical.startswith(prefixes) for p in t.pieces)
                ),
            )
            for d in dst
        ]
        for d in part:
            for t in d.tensors:
                seen[(d.rank, t.name)] = seen.get((d.rank, t.name), 0) + 1
        t0 = time.perf_counter()
        plan = plan_refit(spec, src, part)
        plan_s += time.perf_counter() - t0
        transfers += plan.stats.num_transfers
        size += len(plan.to_json())
        print(
            f"  stage {stage}: {plan.stats.num_transfers:,} transfers, {plan_s:.0f} s so far",
            file=sys.stderr,
            flush=True,
        )
        del plan
    everything = {(d.rank, t.name) for d in dst for t in d.tensors}
    assert set(seen) == everything and set(seen.values()) == {1}, "stages must partition"
    return (
        f"| {model} | {train} | {infer} | {tp.world_size} → {ip.world_size} "
        f"| {layout_s:.1f} s | {plan_s:.0f} s (16 stage plans) | {transfers:,} "
        f"| {size / 2**20:,.0f} MiB |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deepseek", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | training | inference | ranks | layouts | plan | transfers | plan JSON |")
    print("|---|---|---|---|---|---|---|---|")
    for model, train, infer, mopts in CASES:
        spec, tp, ip, src, dst, layout_s = _build(model, train, infer, mopts)
        t0 = time.perf_counter()
        plan = plan_refit(spec, src, dst)
        plan_s = time.perf_counter() - t0
        print(
            f"| {model} | {train} | {infer} | {tp.world_size} → {ip.world_size} "
            f"| {layout_s:.1f} s | {plan_s:.1f} s | {plan.stats.num_transfers:,} "
            f"| {len(plan.to_json()) / 2**20:,.0f} MiB |"
        )
        sys.stdout.flush()
    if args.deepseek:
        print(deepseek_row())
    return 0


if __name__ == "__main__":
    sys.exit(main())
