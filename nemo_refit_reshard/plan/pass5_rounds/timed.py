"""Rounds for a known topology: one time budget per round, filled pair by pair.

The cluster model (``cluster.round_time``) prices a round at its slowest
(GPU, link) and a refit at the sum over rounds::

    t_r(g, L) = max(out_rL(g), in_rL(g)) / bw_L + lat_L * n_rL(g),   T = sum_r max_{g,L} t_r(g, L)

``T`` equals the busiest link's total time only if that link is equally busy in every
round and every other link stays below it; first-fit packing of fixed-size parts fills
the early rounds and leaves a tail of half-empty ones, and many small parts cost many
messages. Here:

1. **Pairs** (``pair_loads.py``). Transfers are grouped by (sender, stored
   receiver, carrier). A pair's bytes load fixed keys with fixed coefficients (its
   *effects*): the sender's link once per member of the receiver's replica group
   (``members``), each member's link, with relay runs (``relay="domain"``) the link of
   every run member that forwards it, ``k`` rounds later for the ``k``-th hop, and for a
   carried pair (``pass4_routes/carry.py``) the hop to the carrier first, everything else one
   round later; staging likewise, in bytes.
2. **Budget.** With ``R`` rounds every (GPU, link) may be busy ``tau = B / R`` seconds
   per round, ``B`` the busiest link's total time, and every (rank, direction) may stage
   ``bucket`` bytes. ``R`` starts at the staging bound ``max_k staged_k / bucket``.
3. **Fill** (``fill.py``). Round after round, senders with the most work left
   first, each sender fills its links: first with the pairs it served in the previous
   round, then with those whose receivers have the most work left. A pair takes the
   bytes that fit every effect after one message latency on each key where it is new in
   the round. Longest remaining first keeps the busiest links busy to the end;
   continuing pairs keep the number of peers, and so of message latencies, low.
4. **Choice** (``budget.py``). Several ``R`` are filled, counting the bytes a
   pair takes in whole transfers and rows (cut where a round's room ends), and priced
   by the formula above (relay hops and message counts included), side by side, each
   stopped once it cannot win, with and without the carried legs; the cheapest fill's
   placements are taken again with the transfers built (``fill.replay``): its price is
   the plan's predicted time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from itertools import groupby
from operator import itemgetter
from typing import NamedTuple

from ..base import Transfer
from ..cluster import LinkModel
from .budget import choose_budget
from .fill import queue_transfers, replay
from .pair_loads import Pair, build_pair

_SRC, _DST, _ENDS = itemgetter(0), itemgetter(1), itemgetter(0, 1)  # of a transfer


class TimedRounds(NamedTuple):
    """The rounds, the time budget every (GPU, link) kept to in each of them, and the
    refit time the scheduler predicts for them (``predict.predict_refit`` of the plan)."""

    rounds: list[list[Transfer]]
    budget: float
    seconds: float


def timed_schedule(
    transfers: list[Transfer],
    bucket_bytes: int,
    links: LinkModel,
    members: Mapping[int, tuple[int, ...]] | None = None,
    runs: Sequence[tuple[int, ...]] = (),
    carried: Sequence[tuple[Transfer, int]] = (),
    direct_floor: float = 0.0,
) -> TimedRounds:
    """Rounds of messages for a known topology (module docstring).

    ``members[dst]``: the receivers a transfer stored for ``dst`` reaches in the same
    round (replicas, or with ``relay="domain"`` every run's entry). ``runs``: relay runs
    (``relay="domain"``); what enters a run at position ``p`` in round ``r`` travels on,
    from position ``p+k-1`` to ``p+k`` in round ``r+k`` (``result/expand.py``).
    ``carried``: ``(transfer, via)``, sent through ``via``'s relay buffer
    (``pass4_routes/carry.py``): leg 1 in some round, leg 2 (and what follows it) one later.
    ``direct_floor``: seconds no schedule that sends the carried transfers directly can
    beat (the busiest link's total, ``Routes.link_seconds``); where the carried schedule
    is already that fast, the direct one is not priced.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket size must be positive")
    if not transfers and not carried:
        return TimedRounds([], 0.0, 0.0)
    members = members or {}
    position = {m: (run, i) for run in runs for i, m in enumerate(run)}
    key_of: dict[tuple[int, str], int] = {}
    latency: list[float] = []

    def key(rank: int, link: str) -> int:
        k = key_of.get((rank, link))
        if k is None:
            k = key_of[(rank, link)] = len(latency)
            latency.append(links.latency(link))
        return k

    ranks = 1 + max(
        max(map(_SRC, transfers), default=0),
        max(map(_DST, transfers), default=0),
        *(m for g in members.values() for m in g),
        *(m for run in runs for m in run),
        *(via for _, via in carried),
        *(t.src for t, _ in carried),
    )

    built: dict[tuple[int, int, int], Pair] = {}

    def pairs_of(by_pair: Mapping[tuple[int, int, int], list[Transfer]]) -> list[Pair]:
        out = []
        for k, ts in sorted(by_pair.items()):
            p = built.get(k)
            if p is None or p.transfers != ts:  # (the same pair again: fills reset it)
                p = built[k] = build_pair(*k, ts, links, members, position, key, ranks)
                # a chunk never needs more than a round's staging
                p.chunk = min(p.chunk, bucket_bytes / max(c for _, c in p.now_staging))
                queue_transfers(p)
            out.append(p)
        return out

    # Each (sender, receiver)'s direct transfers in their order (one stable sort), then
    # its carried ones: one pair per carrier, or (sent directly) after the direct ones.
    direct = {
        (src, dst, -1): list(ts)
        for (src, dst), ts in groupby(sorted(transfers, key=_ENDS), key=_ENDS)
    }
    through: dict[tuple[int, int, int], list[Transfer]] = defaultdict(list, direct)
    for t, via in carried:
        through[(t.src, t.dst, via)].append(t)
    pairs = pairs_of(through)
    best = choose_budget(pairs, bucket_bytes, latency, ranks)
    # (the floor is summed in another order than a fill's total, hence the margin)
    if carried and (best is None or direct_floor * (1 - 1e-9) < best.seconds):
        # Carrying pays in NIC time but costs a round of lag and more staging; where the
        # staging bound or latency rules, sending everything directly can come out ahead.
        sent_directly = defaultdict(list, {k: list(ts) for k, ts in direct.items()})
        for t, _ in carried:
            sent_directly[(t.src, t.dst, -1)].append(t)
        plain = pairs_of(sent_directly)
        alternative = choose_budget(
            plain,
            bucket_bytes,
            latency,
            ranks,
            rounds=best and best.count,
            stop_at=best and best.seconds,
        )
        if alternative is not None and (best is None or alternative.seconds < best.seconds):
            pairs, best = plain, alternative
    if best is None:
        raise ValueError(
            "no round count gives a round budget that holds every pair's message (its "
            "latency, and its next whole row within the bucket); raise bucket_mb"
        )
    return TimedRounds(replay(pairs, best.placements), best.budget, best.seconds)
