"""``simulate --delta-density D``: the plan's delta refit predicted beside its dense one
(``plan/analysis/delta.py``: the size and cost model)."""

from __future__ import annotations

import argparse

from ..plan import Prediction, RefitPlan, Topology
from ..plan.analysis.delta import DeltaPrediction, baseline_memory, predict_delta
from .progress import Progress


def add_delta_prediction_arguments(p: argparse.ArgumentParser) -> None:
    """``--delta-density`` and ``--hbm-gbps`` of ``simulate``."""
    p.add_argument(
        "--delta-density",
        type=float,
        default=None,
        help="also predict the delta refit (docs/delta.md) at this fraction of changed "
        "units per message, e.g. 0.03",
    )
    p.add_argument(
        "--hbm-gbps",
        type=float,
        default=3350.0,
        help="GPU memory bandwidth, GB/s, for the delta's compare/encode/apply "
        "(default: H100 SXM's 3350)",
    )


def simulate_delta(
    args: argparse.Namespace,
    plan: RefitPlan,
    topology: Topology,
    dense: Prediction,
    progress: Progress,
) -> DeltaPrediction | None:
    """The delta prediction ``--delta-density`` asks for; ``None`` without it."""
    if args.delta_density is None:
        return None
    with progress.step(f"the delta refit at density {args.delta_density:g}"):
        return predict_delta(plan, topology, args.delta_density, args.hbm_gbps, dense=dense)


def print_delta(d: DeltaPrediction) -> None:
    """Dense and delta figures side by side, after ``simulate``'s table."""
    width = 31
    title = f"delta refit at density {d.density:g}"
    print(f"  {title:{width}} {'dense':>17} {'delta':>17}")
    rows = [
        ("bytes per step", mib(d.dense_bytes), mib(d.delta_bytes)),
        ("bytes through the busiest rank", mib(d.dense_busiest_bytes), mib(d.delta_busiest_bytes)),
        ("predicted refit", ms(d.dense_seconds), ms(d.delta_seconds)),
        ("  of it on the wire", "", ms(d.wire_seconds)),
        ("  of it memory work (HBM)", "", ms(d.memory_seconds)),
        ("delta / dense", "", "-" if d.ratio is None else f"{d.ratio:.3f}x"),
        ("baseline memory per rank, max", mib(0), mib(max(d.baseline_bytes, default=0))),
    ]
    for name, dense, delta in rows:
        print(f"  {name:{width}} {dense:>17} {delta:>17}")
    print(
        f"  ({d.messages} messages, each a 32-byte header + its smallest form; "
        f"memory work at {d.hbm_gbps:g} GB/s HBM)"
    )


def mib(n: float) -> str:
    """Bytes in MiB (as ``plan``'s tables print them)."""
    return f"{n / 2**20:,.1f} MiB"


def ms(seconds: float) -> str:
    """Seconds as milliseconds, to the microsecond."""
    return f"{seconds * 1e3:.3f} ms"


def delta_memory_row(summary: dict) -> str:
    """``plan --delta``'s row: the baselines a delta refit of the plan keeps per rank
    (training ranks on the device or pinned host memory; forwarding inference ranks in
    host memory)."""
    held, sources = summary["delta_baseline_bytes"], summary["sources"]
    text = f"up to {mib(max(held[:sources], default=0))} per training rank"
    forwarding = max(held[sources:], default=0)
    if forwarding:
        text += f", {mib(forwarding)} host memory per forwarding inference rank"
    return text


__all__ = ["baseline_memory", "delta_memory_row", "print_delta", "simulate_delta"]
