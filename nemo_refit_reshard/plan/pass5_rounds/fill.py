"""The fill behind ``timed.py``: round after round, every sender fills its links
with the pairs whose receivers have the most work left, within one round budget.

:func:`fill` takes a pair's bytes in whole transfers and whole rows. Without ``placed``
it only counts them, to price a budget (``budget.py``), and logs its placements;
:func:`replay` takes them again with the transfers built: the schedule of the budget
that wins.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterator
from itertools import accumulate, compress, repeat
from operator import attrgetter, is_, neg

from ..base import Transfer, cut_rows, in_message_order, legs, rows_that_fit, sizes_of
from .fill_setup import FillSetup
from .pair_loads import Pair, RoundLoads, TooSmall
from .price_limit import LaterBound, round_cap


class _OwnGroup:
    """Pairs of one sender with the same costs on its own links and the same chunk."""

    __slots__ = ("terms", "chunk", "live", "tails")

    def __init__(self, terms: tuple[tuple[int, int, float, int], ...], chunk: float) -> None:
        self.terms = terms  # their ``now_time`` entries on the sender's out keys
        self.chunk = chunk
        self.live = 0  # pairs with bytes left
        self.tails: dict[Pair, float] = {}  # live pairs with fewer bytes left than a chunk


def queue_transfers(p: Pair) -> None:
    """Line ``p``'s transfers up for :func:`take`: in message order (``base.message_order``;
    equal keys in the order popping the end of the descending order gives), with their
    running byte ends."""
    p.queue = in_message_order(p.transfers, reverse=True)[::-1]
    p.ends = [0, *accumulate(sizes_of(p.queue))]
    p.head = p.head_taken = 0
    p.rest = p.cut = None


def take(p: Pair, room: float, placed: list[list[Transfer]] | None, r: int) -> float:
    """Take up to ``room`` bytes off ``p``: its next transfers (:func:`queue_transfers`)
    that fit whole, then whole rows of the one after (``cut_rows``). With ``placed``,
    they go to ``placed[r]`` (a carried pair: leg 1 to ``placed[r]``, leg 2 to
    ``placed[r + 1]``); without, only their bytes are counted (a price fill: the same
    bytes, no transfers built)."""
    queue, ends, head = p.queue, p.ends, p.head
    rest_of_head = p.cut
    # bytes before the next transfer, counting the rows already cut off it
    base = ends[head] + p.head_taken
    # the most whole transfers that fit: the last end within ``room``, found on
    # ``room + base`` (a float sum, which may round) and settled by the exact test
    # ``end - base <= room`` (int minus int against the float room, as summing them
    # one by one would)
    last = len(ends) - 1
    stop = bisect_right(ends, room + base, head + 1) - 1
    while stop < last and ends[stop + 1] - base <= room:
        stop += 1
    while stop > head and ends[stop] - base > room:
        stop -= 1
    nbytes = 0
    if stop > head:
        nbytes = ends[stop] - base
        p.head_taken = 0
        p.rest = p.cut = None
    cut = None
    if stop < last and room > nbytes:
        if placed is not None:
            cut = cut_rows(queue[stop] if p.cut is None else p.cut, room - nbytes)
            if cut is not None:
                p.cut = cut[1]
                p.head_taken += cut[0].nbytes
                nbytes += cut[0].nbytes
        else:
            # ``cut_rows``'s arithmetic on what is left of the transfer (``p.rest``: its
            # sizes once rows were cut off it)
            sizes = queue[stop].canonical_box.sizes if p.rest is None else p.rest
            total = ends[stop + 1] - ends[stop] - p.head_taken
            fit = rows_that_fit(sizes, total, room - nbytes)
            if fit is not None:
                lead, rows = fit
                row = total // sizes[lead]
                p.rest = (*sizes[:lead], sizes[lead] - rows, *sizes[lead + 1 :])
                p.head_taken += rows * row
                nbytes += rows * row
    if placed is not None:
        taken = queue[head:stop]
        if taken and rest_of_head is not None:
            taken[0] = rest_of_head
        if cut is not None:
            taken.append(cut[0])
        if p.via < 0:
            placed[r].extend(taken)
        else:
            for t in taken:
                first, second = legs(t, p.via)
                placed[r].append(first)
                placed[r + 1].append(second)
    p.head = stop
    p.left -= nbytes
    return nbytes


def fill(
    pairs: list[Pair],
    rounds: RoundLoads,
    placed: list[list[Transfer]] | None,
    totals: list[float] | None = None,
    log: list[tuple[int, Pair, float]] | None = None,
    setup: FillSetup | None = None,
) -> Iterator[tuple[float, float]]:
    """Round after round, every sender fills its links: first the pairs it served in the
    previous round (a pair that continues costs no new peer), then the pairs whose
    receivers have the most work left. Senders with the most work left go first, so
    the busiest links never wait while others finish early (longest remaining first).

    A pair's bytes go in whole transfers and whole rows (:func:`take`; the pairs' queues
    set up by :func:`queue_transfers`). ``placed`` given, the transfers are appended to
    ``placed[r]``; otherwise only bytes are counted (to price a round budget), and
    ``log`` gets ``(round, pair, room)`` of every placement: :func:`take` with those
    rooms, in that order, builds the transfers of the same fill (:func:`replay`).
    ``setup``: :class:`FillSetup` of ``pairs`` (or of the pairs they are clones of, in
    the same order), built here if not given.

    A generator: it fills a round per step. ``totals`` given (the busy seconds every pair
    puts on each time index over all rounds), each step yields, once the round is final
    (later placements go to rounds after it), ``(spent, ahead)``: the seconds of the
    rounds so far and a lower bound on those still to come (:class:`LaterBound`), so the
    caller can stop a fill that cannot beat another (``budget.py``). Raises
    :class:`TooSmall` on the first step if an empty round cannot take a pair's chunk, and
    once rounds stay empty while a pair has bytes left (its next row fits no round)."""
    if setup is None:
        setup = FillSetup(pairs, rounds.latency)
    at = pairs.__getitem__
    # what a round with nothing else in it takes of a pair (the same for pairs with the
    # same capacity terms)
    firsts = setup.capacity_firsts
    capacity = dict(zip(firsts, map(rounds.capacity, map(at, firsts))))
    for p, k in zip(pairs, setup.same_capacity):
        p.head = p.head_taken = 0
        p.rest = p.cut = None
        p.left = float(p.nbytes)
        if capacity[k] < min(p.left, p.chunk):
            raise TooSmall
    for p, j, rset in zip(pairs, setup.rank_in, setup.receiver_set):
        p.rank_in, p.receiver_set = j, rset
    send_left = dict(setup.send_left)
    recv_left: dict[int, float] = defaultdict(float, setup.recv_left)
    horizon = setup.horizon
    active: dict[int, list[Pair]] = defaultdict(list)
    # A pair's receivers' work left, the busiest of them: cached per receiver set,
    # dropped for the sets a placement changes.
    receiver_sets, sets_with = setup.receiver_sets, setup.sets_with
    ranks_of: list[float | None] = list(setup.priorities)

    def priority(rset: int) -> float:
        x = ranks_of[rset]
        if x is None:
            x = ranks_of[rset] = max(recv_left[i] for i in receiver_sets[rset])
        return x

    # Each sender's pairs in a heap by (-(busiest receiver's work left), rotation). Work
    # left only shrinks, so a stored key is an upper bound: a popped pair whose key has
    # gone stale goes back in with its current one (lazy re-ranking instead of sorting
    # every sender's pairs every round).
    heaps = {s: [(key, rk, at(i)) for key, rk, i in es] for s, es in setup.heaps.items()}
    for heap in heaps.values():
        heapq.heapify(heap)
    left = {s: len(ids) for s, ids in setup.by_src.items()}  # pairs with bytes left
    # Each sender's live pairs -> their receivers' time and staging bits in one mask (time
    # bits below ``shift``): a turn where every one meets a full bit places nothing.
    shift = setup.shift
    gates = {
        s: dict(zip(map(at, ids), map(setup.gates.__getitem__, ids)))
        for s, ids in setup.by_src.items()
    }

    # Each sender's pairs grouped by what a byte of them costs its own links (their
    # ``now_time`` terms on its out keys) and their chunk: with the tails of the live ones
    # whose bytes left are below it, a group's least ask ``min(left, chunk)``. A turn in
    # which every group's least ask overflows one of those links places nothing.
    groups: dict[int, list[_OwnGroup]] = {}
    group_of: dict[Pair, _OwnGroup] = {}
    for src, setups in setup.groups.items():
        own_groups = groups[src] = []
        for terms, chunk, ids, tails in setups:
            g = _OwnGroup(terms, chunk)
            g.live = len(ids)
            g.tails = {at(i): at(i).left for i in tails}
            group_of.update(zip(map(at, ids), repeat(g)))
            own_groups.append(g)
    # A sender whose own links (or send staging) are full this round is skipped whole.
    own = setup.own

    def stuck(s: int, r: int) -> bool:
        """Whether no live pair of ``s`` fits on its own links in round ``r``: for each
        group, one of them leaves less than its least ask."""
        for g in groups[s]:
            if g.live:
                least = min(g.chunk, *g.tails.values()) if g.tails else g.chunk
                if not rounds.short(g.terms, r, least):
                    return False
        return True

    def requeue(s: int) -> None:
        """Sender ``s``'s live pairs back in its heap with their current keys: what
        popping every pair would leave in a turn that places nothing more."""
        # (in C: every live pair's key is its receiver set's cached priority, computed
        # first where a placement dropped it)
        live = gates[s]
        for rset in compress(
            rsets := list(map(rset_of, live)),
            map(is_, map(ranks_of.__getitem__, rsets), repeat(None)),
        ):
            priority(rset)
        heap = heaps[s]
        heap[:] = zip(map(neg, map(ranks_of.__getitem__, rsets)), map(rank_in_of, live), live)
        heapq.heapify(heap)

    def place(s: int, p: Pair, r: int) -> bool:
        """Put what fits of ``p`` into round ``r``; whether anything went."""
        nonlocal placements
        if rounds.blocked(p, r):
            return False
        need = min(p.left, p.chunk)
        room = rounds.room(p, r, need)
        if room < need:
            return False
        got = take(p, room, placed, r)
        if not got:
            return False
        rounds.add(p, r, got)
        placements += 1
        if log is not None:
            log.append((r, p, room))
        if later is not None:
            later.placed(p)
        send_left[s] -= got * p.send_cost
        for idx, c in p.recv:
            recv_left[idx] -= got * c
            for rset in sets_with[idx]:
                ranks_of[rset] = None
        g = group_of[p]
        if p.left <= 0:
            left[s] -= 1
            del gates[s][p]
            g.live -= 1
            g.tails.pop(p, None)
        elif p.left < g.chunk:
            g.tails[p] = p.left
        return True

    def full(s: int, r: int) -> bool:
        """Whether sender ``s``'s own links (or its send staging) have no room in ``r``."""
        keys, stage = own[s]
        return bool(stage & rounds.full_stage[r]) or keys & rounds.full_time[r] == keys

    heappop, heappush, heappushpop = heapq.heappop, heapq.heappush, heapq.heappushpop
    rset_of, rank_in_of = attrgetter("receiver_set"), attrgetter("rank_in")
    stamp = 0  # marks the pairs a sender served in the previous round, per turn
    for p in pairs:
        p.stamp = -1
    spent = 0.0  # rounds before r, summed as ``RoundLoads.seconds`` sums them
    later = None
    if totals is not None:
        caps = {k: round_cap(at(k), rounds) for k in firsts}
        later = LaterBound(pairs, rounds, totals, list(map(caps.__getitem__, setup.same_capacity)))
    placements = before = idle = 0  # placements so far, before this round; empty rounds
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
            if (
                heap
                and not is_full
                and (all(map((ft | fs << shift).__and__, gates[s].values())) or stuck(s, r))
            ):
                # Every receiver set has a full key, or no pair fits on the sender's own
                # links: nothing can be placed, and the loop below would pop every pair
                # and put the live ones back with their current keys. Do just that.
                requeue(s)
                active[s] = served
                stamp += 1
                continue
            entry = heappop(heap) if heap and not is_full else None
            while entry is not None:
                key, rk, p = entry
                if p.left > 0:
                    now = ranks_of[p.receiver_set]
                    if now is None:
                        now = priority(p.receiver_set)
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
                            if stuck(s, r):
                                # the rest of the turn would place nothing: every pair
                                # popped, the live ones back with their current keys
                                examined = []
                                requeue(s)
                                break
                            ft, fs = full_time[r], full_stage[r]
                entry = heappop(heap) if heap else None
            for p in examined:
                if p.left > 0:
                    now = ranks_of[p.receiver_set]
                    heappush(
                        heap, (-(priority(p.receiver_set) if now is None else now), p.rank_in, p)
                    )
            active[s] = served
            stamp += 1
        if later is not None:
            # round r is final: later placements go to rounds after it
            spent += rounds.round_seconds(r)
            yield spent, later.finish(rounds.busy[r])
        r += 1
        # Once more than ``horizon`` rounds in a row took nothing, every later round is as
        # empty as the last of them: a pair it did not take (a row bigger than any
        # round's room) never goes.
        idle = idle + 1 if placements == before else 0
        if idle > horizon + 1:
            raise TooSmall
        before = placements


def replay(pairs: list[Pair], log: list[tuple[int, int, float]]) -> list[list[Transfer]]:
    """The transfers of a fill that only counted bytes: ``log`` its placements as
    ``(round, index in pairs, room)``, taken again in order with the transfers built.
    Each take cuts the same bytes as the fill's, as both start from the same queue."""
    placed: list[list[Transfer]] = []
    for p in pairs:
        p.head = p.head_taken = 0
        p.rest = p.cut = None
        p.left = float(p.nbytes)
    for r, i, room in log:
        while len(placed) <= r + 1:
            placed.append([])
        take(pairs[i], room, placed, r)
    while placed and not placed[-1]:
        placed.pop()
    return placed
