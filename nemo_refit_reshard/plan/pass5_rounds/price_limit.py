"""When a price fill (``fill.py``, run by ``budget.py``) can stop: a lower
bound on the rounds it has not finished yet, and the best total it must beat.

A fill's total is ``T = sum_r max_{g,L} t_r(g, L)`` with
``t_r(g, L) = max(out, in) / bw + lat_L * n_r(g, L)`` (``cluster.round_time``). After
round ``r`` is final, the rounds after it take, for every time key ``k``, at least

    max(ahead_out(k), ahead_in(k)) + lat_k * m(k)

``ahead`` the busy seconds every pair still puts on the key, and ``m(k)`` the messages it
must still carry: a pair with ``left`` bytes goes in at least ``ceil(left / cap)`` more
rounds, ``cap`` the most one round's budget lets it take (:func:`round_cap`), and every
round it goes in opens its direct messages on their keys (``RoundLoads.add``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from .pair_loads import Pair, RoundLoads, capacity_terms


class Limit(NamedTuple):
    """What a price fill must beat to matter: ``seconds``, or equal them where it wins
    ties (it comes earlier in the order of budgets tried). ``totals[i]``: the busy
    seconds every pair puts on time index ``i`` over all rounds (a fill places all of
    them)."""

    seconds: float
    ties_win: bool
    totals: list[float]

    def beaten_by(self, spent: float, ahead: float) -> bool:
        """Whether a fill whose finished rounds take ``spent`` and whose later rounds
        take at least ``ahead`` (:class:`LaterBound`) cannot come in under the limit:
        its total is at least ``spent + ahead``. The bound is summed in another order
        than the total, hence the margin."""
        if spent > self.seconds or (spent == self.seconds and not self.ties_win):
            return True
        return spent + ahead > self.seconds * (1 + 1e-9)


def round_cap(p: Pair, rounds: RoundLoads) -> float:
    """Most bytes of ``p`` one round takes (``RoundLoads.room`` never exceeds it): its own
    messages' latencies and its bytes within the budget on every key it loads in the
    round, its staging within the bucket."""
    # ``RoundLoads.capacity``'s terms of the round itself (they come first), without the
    # later rounds' hops, whose messages may already be open there
    times, stages = capacity_terms(p, rounds.latency)
    tau, bucket = rounds.tau, rounds.bucket
    cap = math.inf
    for wait, c in times[: len(p.now_time)]:
        cap = min(cap, (tau - wait) / c)
    for c in stages[: len(p.now_staging)]:
        cap = min(cap, bucket / c)
    return cap


def _placements(left: float, cap: float) -> int:
    """Rounds a pair with ``left`` bytes still goes in, at least (the margin keeps a
    rounding error from counting one too many: the bound must stay a bound)."""
    return math.ceil(left / cap * (1 - 1e-9)) if left > 0 else 0


class LaterBound:
    """The lower bound of the module docstring, kept up to date as a fill places pairs."""

    def __init__(
        self,
        pairs: Sequence[Pair],
        rounds: RoundLoads,
        totals: list[float],
        caps: Sequence[float],
    ) -> None:
        """``caps``: :func:`round_cap` of every pair (the fill prices it once per class of
        pairs with equal capacity terms)."""
        self.latency = rounds.latency
        self.ahead = list(totals)
        self.messages = [0] * rounds.num_keys  # m(k)
        self.cap: dict[Pair, float] = dict(zip(pairs, caps))
        self.placements: dict[Pair, int] = {}
        for p, cap in zip(pairs, caps):
            n = self.placements[p] = _placements(p.left, cap)
            self._count(p, n)

    def _count(self, p: Pair, n: int) -> None:
        messages = self.messages
        for _, ka, kb in p.now_messages:
            messages[ka] += n
            messages[kb] += n

    def placed(self, p: Pair) -> None:
        """``p`` went in a round: it has fewer bytes left."""
        n = _placements(p.left, self.cap[p])
        fewer = n - self.placements[p]
        if fewer:
            self.placements[p] = n
            self._count(p, fewer)

    def finish(self, busy: list[float]) -> float:
        """A round whose busy seconds are ``busy`` is final: the bound on the rounds
        after it."""
        ahead = self.ahead = [a - b for a, b in zip(self.ahead, busy)]
        messages = self.messages
        return max(
            max(ahead[2 * k], ahead[2 * k + 1]) + lat * messages[k]
            for k, lat in enumerate(self.latency)
        )
