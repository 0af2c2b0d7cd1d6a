"""Plan bytes each vLLM worker receives at init, vLLM-native ``reshard`` backend.

    python benchmarks/plan_payload.py [--model deepseek-v3] [--train pp=16,dp=16,ep=16]
                                      [--infer tp=32]

One engine of ``--infer`` (the backend serves one engine per client) refitted from
``--train`` (DeepSeek-V3: NeMo RL's published PP16 x EP16, first/last stages 3 and 2
layers). vLLM's ``init_weight_transfer_engine`` is a ``collective_rpc``: every worker
receives the same arguments. Before, those carried every worker's plan slice (each
worker received all D slices); now they carry the endpoint, the fingerprint and the
store key, and each worker reads its own slice from the refit group's store after
joining (``transfer_trainer.py`` / ``transfer_worker.py``). Bytes are the JSON texts'
UTF-8 lengths (what the RPC carries as strings).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from nemo_refit_reshard.layouts import MegatronOptions, VllmOptions, megatron_layout, vllm_layouts
from nemo_refit_reshard.plan import plan_refit, rank_plan
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec

MIB = 1 << 20


def _parallel(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--train", default="pp=16,dp=16,ep=16")
    parser.add_argument("--infer", default="tp=32")
    parser.add_argument("--stages", default="3,2", help="first,last pipeline stage layers")
    args = parser.parse_args()
    spec = load_model_spec(args.model)
    tpar, ipar = TrainParallel(**_parallel(args.train)), InferParallel(**_parallel(args.infer))
    first, last = (int(x) for x in args.stages.split(","))
    mopts = MegatronOptions(
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last
    )
    t0 = time.perf_counter()
    sources = [megatron_layout(spec, tpar, r, mopts) for r in range(tpar.world_size)]
    destinations = vllm_layouts(spec, ipar, VllmOptions(vllm_version="0.33.0"))
    plan = plan_refit(spec, sources, destinations)
    print(f"plan: {time.perf_counter() - t0:.0f} s, fingerprint {plan.fingerprint}")
    s, d = plan.num_sources, plan.num_destinations
    slices = {str(r): rank_plan(plan, r).to_json() for r in range(s, s + d)}
    # The endpoint JSON as the trainer ships it (secret and address lengths as real).
    endpoint = json.dumps(
        {"host": "10.0.0.1", "port": 29500, "world_size": s + d, "group_rank": s,
         "transport": "cupy-nccl", "timeout_s": 600.0, "connect_timeout_s": None,
         "secret": "0" * 64}
    )  # fmt: skip
    common = {"endpoint": endpoint, "first_rank": s, "fingerprint": plan.fingerprint}
    before = len(json.dumps({**common, "plan": slices}).encode())
    rpc_after = len(json.dumps({**common, "plan": None, "plan_key": "reshard-plan"}).encode())
    own = [len(text.encode()) for text in slices.values()]
    after = [rpc_after + n for n in own]
    print(f"{args.model} {args.train} -> {args.infer}: {s} trainer ranks, {d} workers")
    print("| per worker | before (every slice) | after (RPC + own slice) |")
    print("|---|---|---|")
    print(f"| bytes, max | {before:,} ({before / MIB:.1f} MiB) | {max(after):,} "
          f"({max(after) / MIB:.2f} MiB) |")  # fmt: skip
    print(f"| bytes, mean | {before:,} | {statistics.mean(after):,.0f} |")
    print(f"| all workers together | {before * d:,} ({before * d / MIB:.0f} MiB) | "
          f"{sum(after):,} ({sum(after) / MIB:.0f} MiB) |")  # fmt: skip
    print(f"RPC arguments now: {rpc_after} bytes; own slice {min(own):,}..{max(own):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
