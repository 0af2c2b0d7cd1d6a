"""``nemo-refit-reshard simulate`` end to end on frontier configs, this checkout against an
earlier one, paired in one run, each command pinned to one core.

    python benchmarks/simulate_speed.py --before /path/to/earlier/checkout [--only deepseek-v3]

For each case the earlier checkout's command and this one's run one after the other
(``taskset -c 0`` where available), as a user types them, with ``--json``: every figure
``simulate`` reports — the plan's fingerprint, the predicted time and its rounds, the
floor and its terms, the timeline, the baseline's gather and broadcast times — must be
equal, else the script stops. This checkout's text command (which shows no fingerprint,
so computes none) is timed too, in wall and CPU seconds (user + system: on a shared
machine the wall time also holds whatever else ran), and its text compared with the
earlier one's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

CLUSTER = "gpus_per_node=8,nvlink_gbps=450,nic_gbps=50"
CASES = [
    ("deepseek-v3", "pp=16,dp=16,ep=16", "tp=32,dp=8"),
    ("kimi-k2", "pp=16,dp=16,ep=16", "tp=16,dp=8"),
]
HERE = Path(__file__).resolve().parents[1]


def simulate(
    checkout: Path, case: tuple[str, str, str], json_out: bool
) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (user + system: what the command itself cost, whatever
    else the machine ran meanwhile) and stdout of one ``simulate`` run of ``checkout``'s
    code."""
    model, train, infer = case
    cmd = [sys.executable, "-m", "nemo_refit_reshard.cli", "simulate", "--model", model]
    cmd += ["--train", train, "--infer", infer, "--cluster", CLUSTER]
    if json_out:
        cmd.append("--json")
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return seconds, cpu, done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="an earlier checkout of this project")
    parser.add_argument("--only", help="one model of the cases")
    args = parser.parse_args()
    before = Path(args.before).resolve()
    print(
        "| model | training → inference | before (--json) | after (--json) | after (text) "
        "| after (text), CPU | speedup (text vs before) | fingerprint | predicted | floor "
        "| baseline |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        if args.only and case[0] != args.only:
            continue
        t_before, _, out_before = simulate(before, case, json_out=True)
        t_after, _, out_after = simulate(HERE, case, json_out=True)
        t_text, cpu_text, text_after = simulate(HERE, case, json_out=False)
        want, got = json.loads(out_before), json.loads(out_after)
        if want != got:
            diff = sorted(k for k in want if want.get(k) != got.get(k))
            raise SystemExit(f"{case[0]}: simulate's figures differ: {diff}")
        _, _, text_before = simulate(before, case, json_out=False)
        if text_before != text_after:
            raise SystemExit(f"{case[0]}: simulate's text differs")
        print(
            f"| {case[0]} | {case[1]} → {case[2]} | {t_before:.0f} s | {t_after:.0f} s | "
            f"{t_text:.0f} s | {cpu_text:.0f} s | {t_before / t_text:.1f}x | {got['plan']} | "
            f"{got['predicted_s'] * 1e3:.3f} ms | {got['floor_s'] * 1e3:.3f} ms | "
            f"{got['baseline_s'] * 1e3:.3f} ms |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
