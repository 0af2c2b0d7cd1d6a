"""Refit into SGLang engines: ``reshard`` side by side with SGLang's own refit paths.

    python3 -m benchmarks.sglang_paths [MODEL ...]     # ~1 min for the Qwen3 cases

Pure planning (nothing transferred), bf16 both sides, Megatron layouts on the training
side (``runner.build_layouts``), SGLang 0.5.23's layouts on the inference side
(``layouts/sglang.py``, proven against SGLang's classes by ``tests/test_sglang_truth.py``).

**Separate pools** — SGLang's ``update_weights_from_distributed`` (after
``init_weights_update_group``): the trainer broadcasts every full tensor over one NCCL
group to every SGLang GPU, each keeps its shard. Its figures are the gather-broadcast
baseline's (``plan/analysis/baseline.py``) on the same layouts: each tensor gathered to
the training rank holding most of it, then broadcast in a pipelined chain to every
SGLang GPU. SGLang's path gathers everything to one rank (the trainer's rank 0), so
its gather is no faster than this: the baseline's time is a lower bound of it.
``reshard``: our plan from the Megatron shards, predicted with the same cluster model
(H100: 8 GPUs per node, NVLink 450 GB/s, one 50 GB/s NIC per GPU).

**Colocated** — SGLang's ``update_weights_from_tensor`` (veRL's and NeMo RL's colocated
SGLang routes): every training rank runs Megatron-Bridge's HF export (every GPU gathers
every full tensor, ``benchmarks/colocated/export.py``) and hands each full tensor to the
SGLang worker on its GPU through a CUDA IPC handle; the worker's ``load_weights`` keeps
its shard. ``reshard-colocated``: our colocated plan (``benchmarks/colocated/ours.py``).
Bytes only: no cluster model prices the device-local part.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

from benchmarks.colocated.common import Case, build_case
from benchmarks.colocated.export import export
from benchmarks.colocated.ours import ours_figures
from nemo_refit_reshard.plan import (
    DTYPE_BYTES,
    Cluster,
    Colocation,
    Placement,
    Topology,
    plan_refit,
    predict_broadcast_layouts,
    predict_refit,
)
from nemo_refit_reshard.runner import RunConfig, build_layouts

H100 = Cluster(gpus_per_node=8, nvlink_gbps=450, nic_gbps=50)
# (model, Megatron on its own GPUs, SGLang) and (model, Megatron, SGLang on the same GPUs)
SEPARATE = [
    ("qwen3-8b", "tp=4,pp=2,dp=2", "tp=2,dp=4"),
    ("qwen3-30b-a3b", "pp=2,dp=8,ep=8", "tp=8,dp=2"),
    ("deepseek-v3", "pp=16,dp=16,ep=16", "tp=32,dp=8"),
]
COLOCATED = [
    ("qwen3-8b", "tp=4,dp=2", "tp=2,dp=4"),
    ("qwen3-30b-a3b", "tp=2,ep=4,etp=1,dp=4", "tp=4,dp=2"),
]
UNEVEN = {("deepseek-v3", 16): (3, 2)}  # Megatron's first/last stage layers (61 layers)


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f}"


def separate_rows(model: str, train: str, infer: str) -> list[str]:
    """Bytes and predicted time, SGLang's broadcast against ``reshard``."""
    cfg = RunConfig(model=model, train=train, infer=infer, infer_engine="sglang")
    pp = cfg.parallel()[0].pp
    if (model, pp) in UNEVEN:
        first, last = UNEVEN[(model, pp)]
        cfg = replace(cfg, first_stage_layers=first, last_stage_layers=last)
    spec, sources, destinations = build_layouts(cfg)
    links = Topology(H100, Placement.packed(len(sources), len(destinations), H100))
    plan = plan_refit(spec, sources, destinations, bucket_mb=512, relay="none", links=links)
    ours = predict_refit(plan, links)
    base = predict_broadcast_layouts(spec, sources, destinations, links)
    # every SGLang GPU receives every tensor it reads whole
    readers = {
        p.canonical for d in destinations[:1] for t in d.tensors for p in t.pieces
    }  # one rank suffices: every rank reads every canonical tensor (a shard of it)
    whole = sum(t.numel * DTYPE_BYTES[t.dtype] for t in spec if t.name in readers)
    head = f"| {model} | {train} → SGLang {infer} ({len(sources)} → {len(destinations)})"
    s = plan.stats
    return [
        f"{head} | SGLang broadcast | {gib(whole * len(destinations))} | {gib(whole)} | "
        f"{base.seconds * 1e3:,.0f} ms (gather {base.gather_seconds * 1e3:,.0f}) |",
        f"| | reshard | {gib(s.total_bytes)} | {gib(max(s.bytes_received))} | "
        f"{ours.seconds * 1e3:,.0f} ms |",
    ]


def colocated_rows(model: str, train: str, infer: str) -> list[str]:
    """Interconnect bytes and full tensors built per GPU, SGLang's IPC against ours."""
    case = build_case(model, train, infer)
    cfg = replace(case.cfg, infer_engine="sglang")
    spec, sources, destinations = build_layouts(cfg)
    colocation = Colocation.same_index(len(sources), len(destinations))
    plan = plan_refit(spec, sources, destinations, 512, colocation=colocation)
    case = Case(cfg, spec, sources, destinations, plan, case.plan_seconds)
    exports = [export(case, g) for g in range(case.num_gpus)]
    ours = ours_figures(case)
    head = f"| {model} | {train} → SGLang {infer} ({case.num_gpus} GPUs)"
    return [
        f"{head} | SGLang IPC (`update_weights_from_tensor`) | "
        f"{gib(sum(e.received for e in exports))} | {gib(max(e.received for e in exports))} | "
        f"{gib(max(e.materialized for e in exports))} |",
        f"| | reshard-colocated | {gib(ours.net_total)} | {gib(ours.net_max)} | 0.00 |",
    ]


def main(argv: list[str]) -> None:
    which = set(argv) or {m for m, _, _ in SEPARATE}
    print("| model | training → inference | path | wire, all GPUs (GiB) | "
          "max per SGLang GPU (GiB) | predicted (H100) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for case in SEPARATE:
        if case[0] in which:
            t0 = time.perf_counter()
            print("\n".join(separate_rows(*case)), flush=True)
            print(f"<!-- {case[0]}: {time.perf_counter() - t0:.1f} s -->", flush=True)
    print()
    print("| model | training → inference | path | interconnect, all GPUs (GiB) | "
          "interconnect, max per GPU (GiB) | full tensors built, max per GPU (GiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for case in COLOCATED:
        if case[0] in which:
            print("\n".join(colocated_rows(*case)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
