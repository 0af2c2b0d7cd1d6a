"""Reshard vs gather-broadcast on CPU gloo, side by side in one run per model.

    python benchmarks/cpu_refit.py [--steps 5] [--json out.json]

Both backends run on the same processes, same plan inputs, one after the
other; the table reports the median over steps of the slowest rank's refit
time, and every destination is verified bit-exact after each backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nemo_refit_reshard.cli.run import run_report
from nemo_refit_reshard.runner import RunConfig

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [
    ("dense GQA 246M", "configs/dense-gqa-250m.json", "tp=2,pp=2", "tp=4,dp=2"),
    ("MoE 279M", "configs/moe-280m.json", "ep=4,pp=2,dp=4", "tp=2,dp=2"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write the full reports here")
    args = parser.parse_args()
    reports = []
    print(
        "| model | training → inference | backend | bytes moved | median refit | speedup "
        "| host overhead | check |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, config, train, infer in CASES:
        cfg = RunConfig(
            model=os.path.join(HERE, config),
            train=train,
            infer=infer,
            steps=args.steps,
            timeout_s=300,
        )
        report, _ = run_report(cfg, show_progress=False)
        if report["errors"]:
            print(f"{name}: failed: {report['errors']}", file=sys.stderr)
            return 1
        reports.append({"name": name, **report})
        base = report["backends"]["broadcast"]["median_s"]
        for backend, b in report["backends"].items():
            print(
                f"| {name} | {train} → {infer} | {backend} | {b['bytes'] / 2**20:,.0f} MiB "
                f"| {b['median_s'] * 1e3:,.0f} ms | {base / b['median_s']:.2f}x "
                f"| {b['median_host_s'] * 1e3:,.1f} ms "
                f"| {'bit-exact' if b['verified'] else 'MISMATCH'} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
