"""The ``demo`` and ``bench`` commands: refit between local processes (every rank a
process on this machine), time each backend and check every destination bit for bit."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from ..plan import plan_broadcast
from ..runner import RunConfig, RunResult, run_colocated, run_local
from ..runner.colocated import BACKEND as COLOCATED
from ..runner.colocated import colocated_plan
from .delta_report import delta_row, delta_steps, print_delta_steps
from .plan import TimedPlan, engine_word, mib, plan_summary, timed_plan
from .run_args import run_config

# What ``report["config"]`` repeats of the run's configuration.
REPORTED_CONFIG = (
    "model", "train", "infer", "infer_engine", "steps", "bucket_mb", "transport", "relay",
)  # fmt: skip
# reported when --delta
DELTA_CONFIG = ("delta", "lr", "anchor_every", "delta_kernel", "delta_check")


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the refit for a few steps; print the backends side by side (or the report)."""
    return run_command(args)


def cmd_bench(args: argparse.Namespace) -> int:
    """``demo`` with more steps by default; ``--json`` for the figures."""
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Run the refit the arguments describe and print its report; the exit status."""
    # A progress bar only for a person watching, never into JSON or a log file.
    show_progress = sys.stderr.isatty() and not args.json
    report, _ = run_report(run_config(args), show_progress=show_progress)
    return finish(report, args.json)


def run_report(cfg: RunConfig, show_progress: bool) -> tuple[dict[str, Any], RunResult]:
    """Plan the refit, run it between local processes; the report (JSON) and the raw
    result of every rank."""
    timed = timed_plan(cfg)
    nbytes = backend_bytes(cfg, timed)
    result = run_local(
        cfg,
        timed.plan,
        join_timeout_s=cfg.timeout_s + 300,  # past the ranks' own timeouts: they report first
        progress=progress_bar if show_progress else None,
    )
    if show_progress:
        sys.stderr.write("\n")
    report = build_report(cfg, timed, result, nbytes)
    if cfg.colocated and not report["errors"]:
        add_colocated(report, cfg, show_progress)
    return report, result


def add_colocated(report: dict[str, Any], cfg: RunConfig, show_progress: bool) -> None:
    """Run the colocated refit (inference rank d on training rank d's GPU) and add its
    row: bytes over the interconnect, and those copied on the device."""
    plan = colocated_plan(cfg)
    result = run_colocated(
        cfg, plan, join_timeout_s=cfg.timeout_s + 300,
        progress=progress_bar if show_progress else None,
    )  # fmt: skip
    if show_progress:
        sys.stderr.write("\n")
    errors = {str(k): v for k, v in result.errors().items()}
    if errors:
        report["errors"].update({f"{k} (colocated)": v for k, v in errors.items()})
        return
    split = plan.colocated_bytes()
    report["backends"][COLOCATED] = {
        **step_stats(result, COLOCATED),
        "bytes": split.network,
        "local_bytes": split.local,
        "fingerprint": plan.fingerprint,
        **check(result, COLOCATED, plan.num_sources, cfg.verify),
    }
    if cfg.delta:  # the colocated refit sends deltas too (engine/delta/colocated.py)
        rows = delta_steps(result, COLOCATED, plan.num_sources)
        report["backends"][COLOCATED].update(delta_row(rows))
        if any(r["exact"] is False for r in rows):
            report["backends"][COLOCATED]["verified"] = False


def backend_bytes(cfg: RunConfig, timed: TimedPlan) -> dict[str, int]:
    """Bytes each backend the run times moves per refit."""
    nbytes = {"reshard": timed.plan.stats.total_bytes, "delta": timed.plan.stats.total_bytes}
    if "broadcast" in cfg.backends:
        bplan = plan_broadcast(timed.spec, timed.sources, timed.destinations, cfg.bucket_mb)
        nbytes["broadcast"] = bplan.total_bytes
    return nbytes


def progress_bar(done: int, total: int) -> None:
    """Redraw a one-line bar of rank-steps done on stderr."""
    width = 30
    filled = width * done // max(1, total)
    sys.stderr.write(f"\r  [{'#' * filled}{' ' * (width - filled)}] {done}/{total} rank-steps")
    sys.stderr.flush()


def build_report(
    cfg: RunConfig, timed: TimedPlan, result: RunResult, nbytes: dict[str, int]
) -> dict[str, Any]:
    """The run's report: its configuration, the plan's figures, any rank's error and,
    when no rank failed, each backend's times and check."""
    reported = REPORTED_CONFIG + (DELTA_CONFIG if cfg.delta else ())
    report: dict[str, Any] = {
        "config": {k: getattr(cfg, k) for k in reported},
        "plan": plan_summary(timed.plan, timed.seconds),
        "errors": {str(k): v for k, v in result.errors().items()},
        "backends": {},
    }
    if report["errors"]:
        return report
    for backend in cfg.backends:
        report["backends"][backend] = {
            **step_stats(result, backend),
            "bytes": nbytes[backend],
            **check(result, backend, timed.plan.num_sources, cfg.verify),
        }
        if backend == "delta":
            rows = delta_steps(result, backend, timed.plan.num_sources)
            report["backends"][backend].update(delta_row(rows))
            if any(r["exact"] is False for r in rows):  # every step, not only the last
                report["backends"][backend]["verified"] = False
    return report


def step_stats(result: RunResult, backend: str) -> dict[str, float]:
    """Per step, the slowest rank's time; then the median over steps. A colocated
    worker's own clock starts before its host's (``wall_is_host's``): its pair's step is
    the host's, which ends when the worker has unpacked; its own work still counts in
    the host column."""
    entries = [r["backends"][backend] for r in result.ranks]
    per_rank = [e["timings"] for e in entries]
    walls = [e["timings"] for e in entries if not e.get("wall_is_host's")]
    steps = len(per_rank[0])
    wall = [max(t[k][0] for t in walls) for k in range(steps)]
    host = [max(t[k][0] - t[k][1] for t in per_rank) for k in range(steps)]
    return {
        "median_s": statistics.median(wall),
        "min_s": min(wall),
        "median_host_s": statistics.median(host),
        "steps": steps,
    }


def check(result: RunResult, backend: str, num_sources: int, verify: bool) -> dict[str, Any]:
    """``verified`` and the ``mismatches`` per inference rank (by inference rank) that
    the inference ranks found after the backend's last step."""
    bad = {
        r["rank"] - num_sources: r["backends"][backend].get("mismatches")
        for r in result.ranks
        if r["rank"] >= num_sources and r["backends"][backend].get("mismatches")
    }
    return {"verified": verify and not bad, "mismatches": bad}


def finish(report: dict[str, Any], as_json: bool) -> int:
    """Print the report (JSON or text) and any rank's error; the exit status: 0 when
    every backend's result was checked bit-exact."""
    if as_json:
        print(json.dumps(report))
    if report["errors"]:
        for rank, err in sorted(report["errors"].items(), key=lambda kv: _rank_key(kv[0])):
            print(f"nemo-refit-reshard: rank {rank} failed: {err}", file=sys.stderr)
        return 1
    if not as_json:
        print_report(report)
    return 0 if all(b["verified"] for b in report["backends"].values()) else 1


def _rank_key(text: str) -> tuple[int, str]:
    number, _, rest = text.partition(" ")
    return int(number), rest


def print_report(report: dict[str, Any]) -> None:
    """The report as text: one line per backend, the broadcast the speedups' base."""
    cfg, plan = report["config"], report["plan"]
    print(
        f"refit {cfg['model']}: training {cfg['train']} ({plan['sources']} ranks) -> "
        f"{engine_word(cfg['infer_engine'])}inference {cfg['infer']} "
        f"({plan['destinations']} ranks), gloo on localhost, "
        f"{cfg['steps']} timed steps"
    )
    base = report["backends"].get("broadcast", {}).get("median_s")
    w = max(10, *(len(name) for name in report["backends"]))
    print(
        f"  {'backend':{w}} {'bytes moved':>14} {'median refit':>13} {'speedup':>8} "
        f"{'host overhead':>14}  check"
    )
    for name, b in report["backends"].items():
        speed = f"{base / b['median_s']:.2f}x" if base else "-"
        verdict = "bit-exact" if b["verified"] else f"MISMATCH {b['mismatches']}"
        print(
            f"  {name:{w}} {mib(b['bytes']):>14} {b['median_s'] * 1e3:>10.1f} ms {speed:>8} "
            f"{b['median_host_s'] * 1e3:>11.1f} ms  {verdict}"
        )
    colocated = report["backends"].get(COLOCATED)
    if colocated:
        print(
            f"  {COLOCATED}: inference rank d on training rank d's GPU; bytes moved = over "
            f"the interconnect, plus {mib(colocated['local_bytes'])} copied on the device "
            f"(never sent); plan {colocated['fingerprint']}"
        )
    for name, b in report["backends"].items():
        print_delta_steps(name, b.get("delta_steps", []), cfg.get("lr", 0.0))
    if plan.get("bytes_by_dtype"):  # a block-FP8 engine (layouts/fp8_wire.py)
        wire = ", ".join(f"{mib(n)} {d}" for d, n in sorted(plan["bytes_by_dtype"].items()))
        print(
            f"  block-FP8 engine, reshard on the wire: {wire} (e4m3 + scales quantized by "
            "the training ranks where they hold whole blocks)"
        )
    print(
        f"  minimum bytes {mib(plan['min_bytes'])}; plan {plan['fingerprint']}, "
        f"{plan['messages']} messages in {plan['rounds']} round(s), "
        f"built in {plan['build_seconds']:.2f} s"
    )
