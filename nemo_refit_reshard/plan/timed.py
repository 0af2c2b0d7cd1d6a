"""Rounds for a known topology: one time budget per round, filled pair by pair.

The cluster model (``plan/predict.py::round_time``) prices a round at its slowest
(GPU, link) and a refit at the sum over rounds::

    t_r(g, L) = max(out_rL(g), in_rL(g)) / bw_L + lat_L * n_rL(g),   T = sum_r max_{g,L} t_r(g, L)

``T`` equals the busiest link's total time only if that link is equally busy in every
round and every other link stays below it; first-fit packing of fixed-size parts fills
the early rounds and leaves a tail of half-empty ones, and many small parts cost many
messages. Here:

1. **Pairs** (``plan/round_loads.py``). Transfers are grouped by (sender, stored
   receiver, carrier). A pair's bytes load fixed keys with fixed coefficients (its
   *effects*): the sender's link once per member of the receiver's replica group
   (``members``), each member's link, with relay runs (``relay="domain"``) the link of
   every run member that forwards it, ``k`` rounds later for the ``k``-th hop, and for a
   carried pair (``plan/carry.py``) the hop to the carrier first, everything else one
   round later; staging likewise, in bytes.
2. **Budget.** With ``R`` rounds every (GPU, link) may be busy ``tau = B / R`` seconds
   per round, ``B`` the busiest link's total time, and every (rank, direction) may stage
   ``bucket`` bytes. ``R`` starts at the staging bound ``max_k staged_k / bucket``.
3. **Fill.** Round after round, senders with the most work left first, each sender fills
   its links: first with the pairs it served in the previous round, then with those
   whose receivers have the most work left. A pair takes the bytes that fit every effect
   after one message latency on each key where it is new in the round. Longest
   remaining first keeps the busiest links busy to the end; continuing pairs keep the
   number of peers, and so of message latencies, low.
4. **Choice.** Several ``R`` are filled with pairs as divisible amounts and priced by
   the formula above (relay hops and message counts included), with and without the
   carried legs; the cheapest is filled again with the real transfers, cut at row
   boundaries where a round's room ends.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from itertools import compress, groupby, repeat
from operator import attrgetter, is_, itemgetter, neg
from typing import NamedTuple

from .carry import legs
from .messages import in_message_order
from .price_limit import LaterBound, Limit
from .round_loads import Outpriced, Pair, RoundLoads, TooSmall, build_pair, least_budget
from .transfer import LinkModel, Transfer, cut_rows, sizes_of

_SRC, _DST, _ENDS = itemgetter(0), itemgetter(1), itemgetter(0, 1)  # of a transfer


class TimedRounds(NamedTuple):
    """The rounds, the time budget every (GPU, link) kept to in each of them, and the
    refit time the scheduler predicts for them (``predict.predict_refit`` of the plan)."""

    rounds: list[list[Transfer]]
    budget: float
    seconds: float


def _take(p: Pair, room: float, placed: list[list[Transfer]] | None, r: int) -> float:
    """Take up to ``room`` bytes off ``p``: a divisible amount, or (``placed`` given)
    whole transfers and whole rows of the next one, appended to ``placed[r]`` (a
    carried pair: leg 1 to ``placed[r]``, leg 2 to ``placed[r + 1]``)."""
    if placed is None:
        x = min(room, p.left)
        p.left -= x
        return x
    queue, sizes, nbytes, taken = p.queue, p.sizes, 0, []
    while queue and nbytes + sizes[-1] <= room:
        taken.append(queue.pop())
        nbytes += sizes.pop()
    if queue and room > nbytes:
        cut = cut_rows(queue[-1], room - nbytes)
        if cut is not None:
            queue[-1] = cut[1]
            sizes[-1] = cut[1].nbytes
            taken.append(cut[0])
            nbytes += cut[0].nbytes
    if p.via < 0:
        placed[r].extend(taken)
    else:
        for t in taken:
            first, second = legs(t, p.via)
            placed[r].append(first)
            placed[r + 1].append(second)
    p.left -= nbytes
    return nbytes


def _fill(
    pairs: list[Pair],
    rounds: RoundLoads,
    placed: list[list[Transfer]] | None,
    limit: Limit | None = None,
) -> None:
    """Round after round, every sender fills its links: first the pairs it served in the
    previous round (a pair that continues costs no new peer), then the pairs whose
    receivers have the most work left. Senders with the most work left go first, so
    the busiest links never wait while others finish early (longest remaining first).

    ``placed`` given: real transfers, cut at rows, are appended to ``placed[r]``;
    otherwise pairs are divisible amounts (to price a round budget). ``limit``: raise
    :class:`Outpriced` as soon as the rounds no later placement can change (those before
    the current one) and what the rounds after them must still carry show that this
    budget cannot beat it."""
    by_src: dict[int, list[Pair]] = defaultdict(list)
    for p in pairs:
        if placed is not None:
            p.queue = in_message_order(p.transfers, reverse=True)
            p.sizes = list(sizes_of(p.queue))
        p.left = float(p.nbytes)
        if rounds.capacity(p) < min(p.left, p.chunk):
            raise TooSmall
        by_src[p.src].append(p)
    send_left = {s: sum(p.left * p.send_cost for p in ps) for s, ps in by_src.items()}
    # Work left per receiving link (time index): a pair ranks by its busiest receiver,
    # so members that several stored receivers share are seen as the sum of them all.
    recv_left: dict[int, float] = defaultdict(float)
    for p in pairs:
        for idx, c in p.recv:
            recv_left[idx] += p.left * c
    # Each sender's pairs in turn from a different receiver: the order between equals.
    for i, src in enumerate(sorted(by_src)):
        ps = by_src[src]
        k = i * len(ps) // len(by_src)
        for j, p in enumerate(ps[k:] + ps[:k]):
            p.rank_in = j
    # A sender whose own links (or send staging) are full this round is skipped whole.
    own: dict[int, tuple[int, int]] = {}  # sender -> (mask of its out keys, its staging bit)
    for src, ps in by_src.items():
        keys = {idx for p in ps for idx, _, _, _ in p.t0 if idx % 2 == 0}
        own[src] = (sum(1 << k for k in keys), 1 << (2 * src))
    horizon = max(p.horizon for p in pairs)
    active: dict[int, list[Pair]] = defaultdict(list)
    # A pair's receivers' work left, the busiest of them: cached per receiver set (many
    # pairs share one; ``p.rset`` numbers them), dropped for the sets a placement changes.
    set_id: dict[tuple[int, ...], int] = {}
    for p in pairs:
        p.rset = set_id.setdefault(p.rkey, len(set_id))
    receiver_sets = list(set_id)
    ranks_of: list[float | None] = [None] * len(receiver_sets)
    sets_with: dict[int, list[int]] = defaultdict(list)  # time index -> sets holding it
    for rset, rkey in enumerate(receiver_sets):
        for idx in set(rkey):
            sets_with[idx].append(rset)

    def priority(rset: int) -> float:
        x = ranks_of[rset]
        if x is None:
            x = ranks_of[rset] = max(recv_left[i] for i in receiver_sets[rset])
        return x

    # Each sender's pairs in a heap by (-(busiest receiver's work left), rotation). Work
    # left only shrinks, so a stored key is an upper bound: a popped pair whose key has
    # gone stale goes back in with its current one (lazy re-ranking instead of sorting
    # every sender's pairs every round).
    heaps = {s: [(-priority(p.rset), p.rank_in, p) for p in ps] for s, ps in by_src.items()}
    for heap in heaps.values():
        heapq.heapify(heap)
    left = {s: len(ps) for s, ps in by_src.items()}  # pairs with bytes left
    # Each sender's live pairs -> their receivers' time and staging bits in one mask (time
    # bits below ``shift``): a turn where every one meets a full bit places nothing.
    shift = 2 * rounds.num_keys
    gates = {s: {p: p.gate_mask | p.sgate_mask << shift for p in ps} for s, ps in by_src.items()}

    def place(s: int, p: Pair, r: int) -> bool:
        """Put what fits of ``p`` into round ``r``; whether anything went."""
        if rounds.blocked(p, r):
            return False
        need = min(p.left, p.chunk)
        room = rounds.room(p, r, need)
        if room < need:
            return False
        got = _take(p, room, placed, r)
        if not got:
            return False
        rounds.add(p, r, got)
        if later is not None:
            later.placed(p)
        send_left[s] -= got * p.send_cost
        for idx, c in p.recv:
            recv_left[idx] -= got * c
            for rset in sets_with[idx]:
                ranks_of[rset] = None
        if p.left <= 0:
            left[s] -= 1
            del gates[s][p]
        return True

    def full(s: int, r: int) -> bool:
        """Whether sender ``s``'s own links (or its send staging) have no room in ``r``."""
        keys, stage = own[s]
        return bool(stage & rounds.full_stage[r]) or keys & rounds.full_time[r] == keys

    heappop, heappush, heappushpop = heapq.heappop, heapq.heappush, heapq.heappushpop
    rset_of, rank_in_of = attrgetter("rset"), attrgetter("rank_in")
    stamp = 0  # marks the pairs a sender served in the previous round, per turn
    for p in pairs:
        p.stamp = -1
    spent = 0.0  # rounds before r, summed as ``RoundLoads.seconds`` sums them
    later = None if limit is None else LaterBound(pairs, rounds, limit.totals)
    r = 0
    while any(left.values()):
        if placed is not None:
            while len(placed) <= r + 1:
                placed.append([])
        rounds.open(r + horizon)
        full_time, full_stage = rounds.full_time, rounds.full_stage
        for s in sorted((x for x in left if left[x]), key=lambda x: (-send_left[x], x)):
            # first the pairs it served last round (no new peer), then by priority.
            # Within a round only the sender's own placements fill its own keys, so
            # whether it is full changes only when it places something.
            is_full = full(s, r)
            served = []
            for p in active[s]:
                if p.left > 0 and not is_full and place(s, p, r):
                    served.append(p)
                    is_full = full(s, r)
            heap, examined = heaps[s], []
            for p in active[s]:
                p.stamp = stamp  # served last round: tried above already
            ft, fs = full_time[r], full_stage[r]
            if heap and not is_full and all(map((ft | fs << shift).__and__, gates[s].values())):
                # Every receiver set has a full key, so nothing can be placed: the loop
                # below would pop every pair and put the live ones back with their
                # current keys. Do just that.
                # (in C: every live pair's key is its receiver set's cached priority,
                # computed first where a placement dropped it)
                live = gates[s]
                for rset in compress(
                    rsets := list(map(rset_of, live)),
                    map(is_, map(ranks_of.__getitem__, rsets), repeat(None)),
                ):
                    priority(rset)
                heap[:] = zip(
                    map(neg, map(ranks_of.__getitem__, rsets)), map(rank_in_of, live), live
                )
                heapq.heapify(heap)
                active[s] = served
                stamp += 1
                continue
            entry = heappop(heap) if heap and not is_full else None
            while entry is not None:
                key, rk, p = entry
                if p.left > 0:
                    now = ranks_of[p.rset]
                    if now is None:
                        now = priority(p.rset)
                    now = -now
                    if now > key and heap and now > heap[0][0]:
                        # stale: back in with its current key, and on to the next
                        entry = heappushpop(heap, (now, rk, p))
                        continue
                    examined.append(p)
                    # (a receiver with no room left: ``rounds.blocked``'s first test)
                    if not (p.stamp == stamp or p.gate_mask & ft or p.sgate_mask & fs):
                        if place(s, p, r):
                            served.append(p)
                            if full(s, r):
                                break
                            ft, fs = full_time[r], full_stage[r]
                entry = heappop(heap) if heap else None
            for p in examined:
                if p.left > 0:
                    now = ranks_of[p.rset]
                    heappush(heap, (-(priority(p.rset) if now is None else now), p.rank_in, p))
            active[s] = served
            stamp += 1
        if limit is not None:
            # round r is final: later placements go to rounds after it
            assert later is not None
            spent += rounds.round_seconds(r)
            if limit.beaten_by(spent, later.finish(rounds.busy[r])):
                raise Outpriced
        r += 1
        if r > 64 * (len(rounds.busy) + 64):
            raise AssertionError("round filling made no progress")


def timed_schedule(
    transfers: list[Transfer],
    bucket_bytes: int,
    links: LinkModel,
    members: Mapping[int, tuple[int, ...]] | None = None,
    runs: Sequence[tuple[int, ...]] = (),
    carried: Sequence[tuple[Transfer, int]] = (),
) -> TimedRounds:
    """Rounds of messages for a known topology (module docstring).

    ``members[dst]``: the receivers a transfer stored for ``dst`` reaches in the same
    round (replicas, or with ``relay="domain"`` every run's entry). ``runs``: relay runs
    (``relay="domain"``); what enters a run at position ``p`` in round ``r`` travels on,
    from position ``p+k-1`` to ``p+k`` in round ``r+k`` (``plan/expand.py``).
    ``carried``: ``(transfer, via)``, sent through ``via``'s relay buffer
    (``plan/carry.py``): leg 1 in some round, leg 2 (and what follows it) one later.
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

    def pairs_of(direct: list[Transfer], through: Sequence[tuple[Transfer, int]]) -> list[Pair]:
        by_pair: dict[tuple[int, int, int], list[Transfer]] = defaultdict(list)
        for (src, dst), ts in groupby(sorted(direct, key=_ENDS), key=_ENDS):  # (stable)
            by_pair[(src, dst, -1)] = list(ts)
        for t, via in through:
            by_pair[(t.src, t.dst, via)].append(t)
        out = []
        for k, ts in sorted(by_pair.items()):
            p = built.get(k)
            if p is None or p.transfers != ts:  # (the same pair again: fills reset it)
                p = built[k] = build_pair(*k, ts, links, members, position, key, ranks)
                # a chunk never needs more than a round's staging
                p.chunk = min(p.chunk, bucket_bytes / max(c for _, c in p.s0))
            out.append(p)
        return out

    pairs = pairs_of(transfers, carried)
    best = _choose(pairs, bucket_bytes, latency, ranks)
    if carried:
        # Carrying pays in NIC time but costs a round of lag and more staging; where the
        # staging bound or latency rules, sending everything directly can come out ahead.
        plain = pairs_of(transfers + [t for t, _ in carried], ())
        alternative = _choose(
            plain, bucket_bytes, latency, ranks, rounds=best and best[2], stop_at=best and best[0]
        )
        if alternative is not None and (best is None or alternative[0] < best[0]):
            pairs, best = plain, alternative
    if best is None:
        raise ValueError(
            "no round count gives a round budget above the message latency; raise bucket_mb"
        )
    placed: list[list[Transfer]] = []
    final = RoundLoads(best[1], bucket_bytes, latency, ranks)
    _fill(pairs, final, placed)
    while placed and not placed[-1]:
        placed.pop()
    return TimedRounds(placed, final.tau, final.seconds())


def _choose(
    pairs: list[Pair],
    bucket_bytes: int,
    latency: list[float],
    ranks: int,
    rounds: int | None = None,
    stop_at: float | None = None,
) -> tuple[float, float, int] | None:
    """(predicted seconds, round budget, round count) of the cheapest of a few budgets
    (None if no budget lets every pair place a worthwhile chunk; ``stop_at``: none
    priced below it).

    ``R`` runs from the staging bound ``max staged / bucket`` up (``rounds`` given: that
    one only, as it is), the budget being the busiest link's seconds over ``R``; more
    rounds cost more messages, fewer leave less room to balance. Then the best count's
    budget is raised to hold what spilled past its rounds (latency, packing): a third of
    a round spilled costs a whole one. Ties go to the fewest rounds.

    Which count wins does not depend on the order they are priced in, but the cost does:
    a fill stops as soon as it cannot beat the best so far (:class:`Limit`), so the most
    rounds, which win at scale, are priced first.
    """
    busy = [0.0] * (2 * len(latency))
    staged: dict[int, float] = defaultdict(float)
    for p in pairs:
        for idx, _, c, _ in p.t0:
            busy[idx] += p.nbytes * c
        for idx, c in p.s0:
            staged[idx] += p.nbytes * c
        for _, idx, _, c in p.tl:
            busy[idx] += p.nbytes * c
        for _, idx, c in p.sl:
            staged[idx] += p.nbytes * c
    longest = max(busy)
    least = max(1, math.ceil(max(staged.values()) / bucket_bytes))
    # No budget below what one message of every pair needs (its latencies, and its bytes
    # up to a worthwhile chunk): small plans are latency-bound whatever the budget.
    floor = max(least_budget(p, latency) for p in pairs)
    # (seconds, order, budget, round count): ``order`` ranks equal seconds
    best: tuple[float, int, float, int] | None = None
    totals: dict[float, float | None] = {}  # budget -> its fill's total (None: too small)

    def price(tau: float, num_rounds: int, order: int) -> None:
        nonlocal best
        tau = max(tau, floor)
        if tau not in totals:
            if best is not None:
                limit = Limit(best[0], order < best[1], busy)
            else:
                limit = None if stop_at is None else Limit(stop_at, False, busy)
            state = RoundLoads(tau, bucket_bytes, latency, ranks)
            try:
                _fill(pairs, state, None, limit)
            except TooSmall:
                totals[tau] = None
            except Outpriced:
                return  # (not kept: under another limit it may finish)
            else:
                totals[tau] = state.seconds()
        seconds = totals[tau]  # the same fill again where the floor held two counts
        if seconds is not None and (best is None or (seconds, order) < best[:2]):
            best = (seconds, order, tau, num_rounds)

    if rounds is None:
        counts = sorted({least, -(-5 * least // 4), -(-3 * least // 2), 2 * least})
    else:
        counts = [max(rounds, least)]
    for order, num_rounds in sorted(enumerate(counts), key=lambda c: -c[1]):
        price(longest / num_rounds, num_rounds, order)
    if best is not None and rounds is None:
        price(best[0] / best[3], best[3], len(counts))
    return None if best is None else (best[0], best[2], best[3])
