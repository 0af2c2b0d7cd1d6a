"""``reshard``: our plan (``plan_refit``); staging from its per-round traffic."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from benchmarks.vllm_engines.common import Case, Figures

if TYPE_CHECKING:
    from nemo_refit_reshard.plan import RefitPlan


def reshard_staging(plan: RefitPlan, num_sources: int) -> tuple[int, int]:
    """Largest per-round (send + receive) bytes of one rank, workers and trainers apart:
    the staging one serial replay set holds (docs/plan_and_engine.md; overlapped: 2x)."""
    per: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    for r, msgs in enumerate(plan.traffic()):
        for src, dst, nbytes in msgs:
            per[(r, src)][0] += nbytes
            per[(r, dst)][1] += nbytes
    worker = trainer = 0
    for (_, rank), (sent, received) in per.items():
        if rank < num_sources:
            trainer = max(trainer, sent + received)
        else:
            worker = max(worker, sent + received)
    return worker, trainer


def reshard_figures(case: Case) -> Figures:
    """Each worker receives what the plan sends it (the floor, ``min_bytes``: what it
    stores); the trainer gathers nothing (every box goes from a rank holding it);
    staging: :func:`reshard_staging`."""
    stats = case.plan.stats
    received = stats.bytes_received[case.num_sources :]
    assert stats.total_bytes == stats.min_bytes, "reshard moves the floor"
    w_stage, t_stage = reshard_staging(case.plan, case.num_sources)
    return Figures(max(received), sum(received), 0, w_stage, t_stage)
