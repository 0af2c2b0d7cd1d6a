"""``demo --delta`` / ``bench --delta``: per step, what changed and what the delta sent.

Each training rank reports its step's figures (``engine.delta.DeltaStats``): units
compared and changed, the bytes it sent (payloads and 32-byte headers) and what the same
messages weigh dense; each inference rank whether its tensors are bit-exact after that
step. A step's row sums the training ranks (a colocated run: the hosts).
"""

from __future__ import annotations

import statistics
from typing import Any

from ..runner import RunResult
from .plan import mib


def delta_steps(result: RunResult, backend: str, num_sources: int) -> list[dict[str, Any]]:
    """Per timed step: ``changed`` (fraction of units compared), ``sent_bytes``,
    ``dense_bytes``, ``seconds`` (the slowest rank), ``exact`` (every inference rank
    bit-exact; None when not checked) and the largest ``baseline_bytes`` of a rank."""
    entries = {r["rank"]: r["backends"][backend] for r in result.ranks}
    senders = [e["delta"] for rank, e in entries.items() if rank < num_sources and "delta" in e]
    checks = [e["delta"] for rank, e in entries.items() if rank >= num_sources and "delta" in e]
    rows = []
    for k in range(len(senders[0]) if senders else 0):
        units = sum(s[k]["units"] for s in senders)
        checked = [c[k]["mismatches"] for c in checks if "mismatches" in c[k]]
        rows.append(
            {
                "changed": sum(s[k]["changed"] for s in senders) / units if units else 0.0,
                "sent_bytes": sum(s[k]["sent_bytes"] for s in senders),
                "dense_bytes": sum(s[k]["dense_bytes"] for s in senders),
                "seconds": max(e["timings"][k][0] for e in entries.values()),
                "exact": (not any(checked)) if checked else None,
                "baseline_bytes": max(s[k]["baseline_bytes"] for s in senders),
            }
        )
    return rows


def delta_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The backend row's figures: median bytes sent per step, and the steps."""
    return {
        "bytes": int(statistics.median(r["sent_bytes"] for r in rows)) if rows else 0,
        "delta_steps": rows,
    }


def print_delta_steps(name: str, rows: list[dict[str, Any]], lr: float) -> None:
    """One line per step of backend ``name``."""
    if not rows:
        return
    print(f"  {name} per step (Adam, lr {lr:g}; bytes summed over the training ranks):")
    print(
        f"    {'step':>4} {'changed':>8} {'dense bytes':>13} {'delta bytes':>13} {'ratio':>6} "
        f"{'refit':>10}  check"
    )
    for k, r in enumerate(rows, 1):
        ratio = r["sent_bytes"] / r["dense_bytes"] if r["dense_bytes"] else 0.0
        check = {True: "bit-exact", False: "MISMATCH", None: "-"}[r["exact"]]
        print(
            f"    {k:>4} {r['changed'] * 100:>7.2f}% {mib(r['dense_bytes']):>13} "
            f"{mib(r['sent_bytes']):>13} {ratio:>6.3f} {r['seconds'] * 1e3:>7.1f} ms  {check}"
        )
    print(f"    sender baselines: up to {mib(rows[-1]['baseline_bytes'])} per training rank")
