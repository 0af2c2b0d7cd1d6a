"""Overlapped vs serial replay on CPU gloo, alternated in one run.

    python benchmarks/overlap_cpu.py [--steps 5] [--pairs 3] [--bucket-mb 16]

Each pair runs the same refit (reshard backend, every destination verified bit-exact)
once serially and once overlapped (``engine/pipeline.py``), on fresh processes, one
after the other; the table gives each run's median slowest-rank step and the ratio of
the medians over all pairs. A small bucket makes many rounds, which is where the
overlap can hide packing and unpacking behind the wire.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from nemo_refit_reshard.cli.run import run_report
from nemo_refit_reshard.runner import RunConfig

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [
    ("dense GQA 246M", "configs/dense-gqa-250m.json", "tp=2,pp=2", "tp=4,dp=2"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=16)
    args = parser.parse_args()
    print(
        "| model | training -> inference | rounds | serial median | overlapped median | "
        "overlapped / serial |"
    )
    print("|---|---|---|---|---|---|")
    for name, path, train, infer in CASES:
        times: dict[bool, list[float]] = {False: [], True: []}
        rounds = 0
        for _ in range(args.pairs):
            for overlap in (False, True):
                cfg = RunConfig(
                    model=os.path.join(HERE, path),
                    train=train,
                    infer=infer,
                    backends=("reshard",),
                    steps=args.steps,
                    bucket_mb=args.bucket_mb,
                    overlap=overlap,
                )
                report, _ = run_report(cfg, show_progress=False)
                if report["errors"]:
                    print(report["errors"], file=sys.stderr)
                    return 1
                entry = report["backends"]["reshard"]
                assert entry["verified"], entry["mismatches"]
                times[overlap].append(entry["median_s"])
                rounds = report["plan"]["rounds"]
        serial, overlapped = (statistics.median(times[k]) for k in (False, True))
        print(
            f"| {name} | {train} -> {infer} | {rounds} | {serial * 1e3:.0f} ms | "
            f"{overlapped * 1e3:.0f} ms | {overlapped / serial:.2f} |"
        )
        print(f"<!-- serial {times[False]}, overlapped {times[True]} -->")
    return 0


if __name__ == "__main__":
    sys.exit(main())
