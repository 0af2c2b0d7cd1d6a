"""Host overhead of one refit step for DeepSeek-V3 (pp=16,dp=16,ep=16 -> tp=32,dp=8).

    python benchmarks/host_overhead.py [--repeats 20]

Tensors live on the ``meta`` device and the transport does nothing, so what
is timed is purely the host work of a replay: walking the compiled program and
dispatching its copies. Two programs are measured:

* a training rank of a middle pipeline stage (4 layers x 16 local experts),
  planned against all 256 inference ranks for the layers it holds;
* an inference rank (one TP=32 shard of all 61 layers), planned against all
  256 training ranks.

Each plan is restricted to what that rank takes part in, which is exactly the
program that rank would compile from the full plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from nemo_refit_reshard.engine.program import TORCH_DTYPES, RankProgram
from nemo_refit_reshard.layouts import MegatronOptions, RankLayout, megatron_layout, vllm_layout
from nemo_refit_reshard.layouts.megatron_grid import megatron_layer_chunks
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec


class NullTransport:
    def exchange(self, sends, recvs) -> None:
        pass


def meta_tensors(layout: RankLayout) -> dict[str, torch.Tensor]:
    return {
        t.name: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device="meta")
        for t in layout.tensors
    }


def time_replay(program: RankProgram, repeats: int) -> float:
    transport = NullTransport()
    program.replay(transport)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        program.replay(transport)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def only_layers(layout: RankLayout, layers: range) -> RankLayout:
    keep = tuple(
        t for t in layout.tensors if any(t.name.startswith(f"model.layers.{i}.") for i in layers)
    )
    return dataclasses.replace(layout, tensors=keep)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    spec = load_model_spec("deepseek-v3")
    tpar, ipar = TrainParallel(pp=16, dp=16, ep=16), InferParallel(tp=32, dp=8)
    mopts = MegatronOptions(
        num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=2
    )
    t0 = time.perf_counter()
    sources = [megatron_layout(spec, tpar, r, mopts) for r in range(tpar.world_size)]
    shards = [vllm_layout(spec, ipar, r) for r in range(ipar.tp)]
    destinations = [
        dataclasses.replace(shards[r % ipar.tp], rank=r) for r in range(ipar.world_size)
    ]
    print(f"layouts: {time.perf_counter() - t0:.1f} s")

    rows = []
    # Training rank 16: pipeline stage 1 (layers 3..6), data-parallel 0, expert-parallel 0.
    stage = megatron_layer_chunks(spec.arch.num_layers, tpar, 1, 3, 2)[0]
    layers = range(stage[0], stage[0] + stage[1])
    t0 = time.perf_counter()
    plan = plan_refit(spec, sources, [only_layers(d, layers) for d in destinations])
    built = time.perf_counter() - t0
    program = RankProgram(plan, 16, meta_tensors(sources[16]), device="meta")
    rows.append(
        ("training rank 16 (stage 1, 4 layers)", built, program, time_replay(program, args.repeats))
    )
    # Inference rank 0: TP shard 0 of replica 0, all layers.
    t0 = time.perf_counter()
    plan = plan_refit(spec, sources, destinations[:1])
    built = time.perf_counter() - t0
    program = RankProgram(plan, plan.num_sources, meta_tensors(destinations[0]), device="meta")
    rows.append(
        (
            "inference rank 0 (TP shard of 61 layers)",
            built,
            program,
            time_replay(program, args.repeats),
        )
    )

    print(
        "| rank | transfers | copies after merging | messages | rounds | replay (host) "
        "| plan build |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, built, program, seconds in rows:
        print(
            f"| {name} | {program.num_transfers:,} | {program.num_copies:,} "
            f"| {program.num_messages:,} | {len(program.rounds)} | {seconds * 1e3:.1f} ms "
            f"| {built:.1f} s |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
