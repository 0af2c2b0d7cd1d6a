"""The round budget of a timed schedule (``timed.py``, step 4): a few budgets priced
by filling them (``fill.py``, counting bytes in whole transfers and rows, as the
schedule takes them), the cheapest kept with its fill's placements.

A budget's price is the cluster model's time of its fill: the plan it gives. Fills of
several budgets run side by side, one round at a time, the one whose lower bound
(``price_limit.py``) is lowest going next; once a fill is done, every fill whose
bound shows it cannot beat the best total stops. The cheapest budget is the one a fill
of each budget in turn would find, but the losing fills stop as early as their bounds
allow, whichever budget wins.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import NamedTuple

from .fill import fill
from .fill_setup import FillSetup
from .pair_loads import Pair, RoundLoads, TooSmall, least_budget
from .price_limit import Limit


class _PriceFill:
    """One budget's price fill in progress: its state, its steps, and where it stands
    (``spent + ahead``: a lower bound on its total)."""

    def __init__(
        self,
        tau: float,
        entries: list[tuple[int, int]],
        pairs: list[Pair],
        state: RoundLoads,
        totals: list[float] | None,
        setup: FillSetup,
    ) -> None:
        self.tau = tau
        self.entries = entries  # (order, round count) of every count whose budget this is
        self.order = entries[0][0]  # the first of them: ties rank by it
        self.pairs = pairs  # its own pairs (a fill keeps its progress on them)
        self.state = state
        self.log: list[tuple[int, Pair, float]] = []  # its placements (``fill.replay``)
        self.steps = fill(pairs, state, None, totals, self.log, setup)
        self.spent = 0.0
        self.ahead = 0.0

    def placements(self) -> list[tuple[int, int, float]]:
        """Its placements as ``(round, index of the pair, room)``."""
        index = {p: i for i, p in enumerate(self.pairs)}
        return [(r, index[p], room) for r, p, room in self.log]


class Priced(NamedTuple):
    """The cheapest budget: its fill's predicted seconds, the budget, the round count it
    was derived from, and the fill's placements (``fill.replay`` builds its transfers)."""

    seconds: float
    budget: float
    count: int
    placements: list[tuple[int, int, float]]


def choose_budget(
    pairs: list[Pair],
    bucket_bytes: int,
    latency: list[float],
    ranks: int,
    rounds: int | None = None,
    stop_at: float | None = None,
) -> Priced | None:
    """The cheapest of a few budgets (None if no budget lets every pair place a
    worthwhile chunk; ``stop_at``: none priced below it).

    ``R`` runs from the staging bound ``max staged / bucket`` up (``rounds`` given: that
    one only, as it is), the budget being the busiest link's seconds over ``R``; more
    rounds cost more messages, fewer leave less room to balance. Then the best count's
    budget is raised to hold what spilled past its rounds (latency, packing): a third of
    a round spilled costs a whole one. Ties go to the fewest rounds.
    """
    busy = [0.0] * (2 * len(latency))
    staged: dict[int, float] = defaultdict(float)
    for p in pairs:
        for idx, _, c, _ in p.now_time:
            busy[idx] += p.nbytes * c
        for idx, c in p.now_staging:
            staged[idx] += p.nbytes * c
        for _, idx, _, c in p.later_time:
            busy[idx] += p.nbytes * c
        for _, idx, c in p.later_staging:
            staged[idx] += p.nbytes * c
    longest = max(busy)
    least = max(1, math.ceil(max(staged.values()) / bucket_bytes))
    # No budget below what one message of every pair needs (its latencies, and its bytes
    # up to a worthwhile chunk): small plans are latency-bound whatever the budget.
    floor = max(least_budget(p, latency) for p in pairs)
    # (seconds, order, budget, round count): ``order`` ranks equal seconds
    best: tuple[float, int, float, int] | None = None
    totals: dict[float, float | None] = {}  # budget -> its fill's total (None: too small)
    logs: dict[float, list[tuple[int, int, float]]] = {}  # budget -> its fill's placements
    setup = FillSetup(pairs, latency)  # what every budget's fill shares

    def settle(tau: float, entries: list[tuple[int, int]]) -> None:
        nonlocal best
        seconds = totals[tau]
        for order, num_rounds in entries:
            if seconds is not None and (best is None or (seconds, order) < best[:2]):
                best = (seconds, order, tau, num_rounds)

    def beaten(f: _PriceFill) -> bool:
        if best is not None:
            limit = Limit(best[0], f.order < best[1], busy)
        elif stop_at is not None:
            limit = Limit(stop_at, False, busy)
        else:
            return False
        return limit.beaten_by(f.spent, f.ahead)

    def price(budgets: list[tuple[float, int, int]]) -> None:
        """Fill the budgets ``(tau, round count, order)`` side by side (module docstring);
        a budget filled before is not filled again (two counts may share one)."""
        entries: dict[float, list[tuple[int, int]]] = defaultdict(list)
        for tau, num_rounds, order in budgets:
            tau = max(tau, floor)
            if tau in totals:
                settle(tau, [(order, num_rounds)])
            else:
                entries[tau].append((order, num_rounds))
        # bounds only where a fill can lose before it ends
        bounded = len(entries) > 1 or best is not None or stop_at is not None
        live = []
        for i, (tau, counts) in enumerate(entries.items()):
            own = pairs if i == 0 else [p.clone() for p in pairs]
            state = RoundLoads(tau, bucket_bytes, latency, ranks)
            live.append(_PriceFill(tau, counts, own, state, busy if bounded else None, setup))
        while live:
            f = min(live, key=lambda x: (x.spent + x.ahead, x.order))
            try:
                f.spent, f.ahead = next(f.steps)
            except TooSmall:
                totals[f.tau] = None
                live.remove(f)
            except StopIteration:
                totals[f.tau] = f.state.seconds()
                logs[f.tau] = f.placements()
                settle(f.tau, f.entries)
                live.remove(f)
            # (a fill stopped here is not kept: under another limit it may finish)
            live = [x for x in live if not beaten(x)]

    if rounds is None:
        counts = sorted({least, -(-5 * least // 4), -(-3 * least // 2), 2 * least})
    else:
        counts = [max(rounds, least)]
    price([(longest / num_rounds, num_rounds, order) for order, num_rounds in enumerate(counts)])
    if best is not None and rounds is None:
        price([(best[0] / best[3], best[3], len(counts))])
    return None if best is None else Priced(best[0], best[2], best[3], logs[best[2]])
