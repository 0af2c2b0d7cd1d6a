"""Host overhead of one refit step for DeepSeek-V3 (pp=16,dp=16,ep=16 -> tp=32,dp=8).

    python benchmarks/host_overhead.py [--repeats 20]

Tensors live on the ``meta`` device and the transport does nothing, so what
is timed is purely the host work of a replay: walking the compiled program and
dispatching its copies. Two programs are measured:

* a training rank of a middle pipeline stage (4 layers x 16 local experts);
* an inference rank (one TP=32 shard of all 61 layers).

Both are compiled from their slice of the one full plan, as workers do.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time

import torch

from nemo_refit_reshard.engine.program import TORCH_DTYPES, RankProgram
from nemo_refit_reshard.layouts import MegatronOptions, RankLayout, megatron_layout, vllm_layout
from nemo_refit_reshard.plan import plan_refit, rank_plan
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec


class NullTransport:
    def start_exchange(self, sends, recvs, round_index=0) -> NullTransport:
        return self

    def exchange(self, sends, recvs, round_index=0) -> None:
        pass

    def wait(self) -> None:
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

    t0 = time.perf_counter()
    plan = plan_refit(spec, sources, destinations)
    built = time.perf_counter() - t0
    print(f"plan: {built:.1f} s")
    gc.freeze()  # the workers hold only their slices, not the driver's plan objects
    rows = []
    for name, rank, layout in (
        ("training rank 16 (stage 1, 4 layers)", 16, sources[16]),
        ("inference rank 0 (TP shard of 61 layers)", plan.num_sources, destinations[0]),
    ):
        program = RankProgram(rank_plan(plan, rank), rank, meta_tensors(layout), device="meta")
        rows.append((name, program, time_replay(program, args.repeats)))

    print("| rank | transfers | copies after merging | messages | rounds | replay (host) |")
    print("|---|---|---|---|---|---|")
    for name, program, seconds in rows:
        print(
            f"| {name} | {program.num_transfers:,} | {program.num_copies:,} "
            f"| {program.num_messages:,} | {len(program.rounds)} | {seconds * 1e3:.1f} ms |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
