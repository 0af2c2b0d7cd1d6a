"""Dense reshard vs delta reshard vs vLLM's ``sparse_nccl`` data path, CPU gloo, one run.

    python benchmarks/delta_cpu.py [--steps 5] [--lr 1e-6 3e-6] [--kernels numba numpy]
                                   [--checks on off] [--json out.json]

Per learning rate: the 246M dense model of ``benchmarks/cpu_refit.py`` (Megatron tp=2,pp=2
→ vLLM tp=4,dp=2) trained with Adam between refits (``runner/training.py``: BF16 weights,
FP32 masters), refit by the dense reshard and the delta reshard in the same processes
(``demo --delta``'s backends ``reshard`` and ``delta``; every step of both checked
bit-exact on every inference rank), then the same trained weights, step after step,
through ``benchmarks/sparse_nccl_path.py`` (vLLM 0.33's wire format from trainer rank 0 to
the 8 inference ranks; its own classes when vLLM imports here, else its format
reproduced). Reported per path: bytes per step (all ranks), bytes through the busiest
rank, median step time; and the changed fraction. The break-even density (where the
delta's step time meets the dense one on this machine) comes from the learning rates
run. ``--kernels``: the CPU ranks' delta path (``DeltaOptions.cpu_kernel``), each in a run
of its own with its own dense rows (numba: compiled kernels, no pack; numpy: pack, then
numpy's passes). ``--checks``: the per-step check of each delta's base against its
receiver (``engine/delta/check.py``) on and off, each in a run of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from nemo_refit_reshard.cli.run import run_report
from nemo_refit_reshard.runner import RunConfig
from nemo_refit_reshard.runner.training import AdamTrainedWeights
from nemo_refit_reshard.spec import load_model_spec

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
MODEL = os.path.join(HERE, "configs/dense-gqa-250m.json")


def reshard_rows(
    args: argparse.Namespace, lr: float, kernel: str, check: bool = True
) -> tuple[list[dict], float, dict]:
    """Dense and delta reshard in one run: their rows and the median changed fraction."""
    steps = args.steps
    cfg = RunConfig(
        model=args.model, train=args.train, infer=args.infer, steps=steps,
        backends=("reshard", "delta"), delta=True, lr=lr, timeout_s=900, delta_kernel=kernel,
        delta_check=check,
    )  # fmt: skip
    report, result = run_report(cfg, show_progress=False)
    if report["errors"]:
        raise SystemExit(f"lr {lr}: failed: {report['errors']}")
    sources = report["plan"]["sources"]
    dense, delta = report["backends"]["reshard"], report["backends"]["delta"]
    per_rank = [
        [s["sent_bytes"] for s in r["backends"]["delta"]["delta"]]
        for r in result.ranks
        if r["rank"] < sources
    ]
    busiest = [max(rank[k] for rank in per_rank) for k in range(steps)]
    sent = report["plan"].get("bytes_sent") or []
    rows = [
        {
            "path": "dense reshard",
            "bytes": dense["bytes"],
            "busiest_bytes": max(sent[:sources]) if sent else None,
            "median_s": dense["median_s"],
            "exact": dense["verified"],
        },
        {
            "path": f"delta reshard ({kernel}, {'checked' if check else 'unchecked'})",
            "bytes": delta["bytes"],
            "busiest_bytes": int(statistics.median(busiest)),
            "median_s": delta["median_s"],
            "exact": delta["verified"],
        },
    ]
    changed = statistics.median(s["changed"] for s in delta["delta_steps"])
    return rows, changed, report


def sparse_nccl_row(args: argparse.Namespace, lr: float) -> dict:
    """The same Adam trajectory through vLLM's sparse_nccl data path."""
    from sparse_nccl_path import run_sparse_nccl

    from nemo_refit_reshard.spec import InferParallel

    infer = InferParallel.parse(args.infer)
    trained = AdamTrainedWeights(load_model_spec(args.model).unquantized(), seed=0, lr=lr)
    snapshots = []
    for _ in range(args.steps + 1):
        snapshots.append({name: trained[name].clone() for name in trained})
        trained.advance()
    results = run_sparse_nccl(snapshots, infer.tp * infer.dp, inference_tp=infer.tp)
    return {
        "path": "vLLM sparse_nccl",
        "bytes": int(statistics.median(r.bytes_sent for r in results)),
        "busiest_bytes": int(statistics.median(r.busiest_rank_bytes for r in results)),
        "median_s": statistics.median(r.seconds for r in results),
        "exact": all(r.bit_exact for r in results),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--train", default="tp=2,pp=2")
    parser.add_argument("--infer", default="tp=4,dp=2")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6])
    parser.add_argument("--kernels", nargs="+", default=["numba"], choices=["numba", "numpy"])
    parser.add_argument(
        "--checks",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="the delta base check (DeltaOptions.check), each in a run of its own",
    )
    parser.add_argument("--no-sparse-nccl", action="store_true")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    print("| lr | changed | path | bytes / step | busiest rank | median step | vs dense | check |")
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for lr in args.lr:
        rows, base_of = [], []
        for kernel in args.kernels:  # each with the dense rows of its own run
            for check in args.checks:
                pair, changed, _ = reshard_rows(args, lr, kernel, check == "on")
                rows += pair
                base_of += [pair[0]["median_s"]] * 2
        if not args.no_sparse_nccl:
            rows.append(sparse_nccl_row(args, lr))
            base_of.append(rows[0]["median_s"])
        for row, base in zip(rows, base_of):
            busiest = row["busiest_bytes"]
            print(
                f"| {lr:g} | {changed * 100:.2f} % | {row['path']} | "
                f"{row['bytes'] / 2**20:,.1f} MiB | "
                f"{'-' if busiest is None else f'{busiest / 2**20:,.1f} MiB'} | "
                f"{row['median_s'] * 1e3:,.0f} ms | {row['median_s'] / base:.2f}x | "
                f"{'bit-exact' if row['exact'] else 'MISMATCH'} |"
            )
            out.append({"lr": lr, "changed": changed, **row})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
