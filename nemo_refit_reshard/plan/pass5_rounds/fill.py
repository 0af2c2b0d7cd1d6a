"""The fill behind ``timed.py``: round after round, every sender fills its links
with the pairs whose receivers have the most work left, within one round budget.

:func:`fill` takes a pair's bytes in whole transfers and whole rows. Without ``placed``
it only counts them, to price a budget (``budget.py``), and logs its placements;
:func:`replay` takes them again with the transfers built: the schedule of the budget
that wins.

Its steps: a round (:func:`_fill_round`) gives every sender a turn (:func:`_turn`): the
pairs it served last round first (:func:`_continue_served`), then its other pairs by
priority (:func:`_serve_by_priority`), each placement :func:`_place`. What they share
and how a placement changes it: ``fill_steps.py``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from heapq import heappop, heappush, heappushpop
from itertools import accumulate

from ..base import Transfer, cut_rows, in_message_order, legs, rows_that_fit, sizes_of
from .fill_setup import FillSetup
from .fill_steps import (
    Entry,
    FillState,
    full,
    nothing_fits,
    priority,
    record_placement,
    requeue,
    reset_pairs,
    start_fill,
    stuck,
)
from .pair_loads import Pair, RoundLoads, TooSmall


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
    reset_pairs(pairs, rounds, setup)
    st = start_fill(pairs, rounds, placed, totals, log, setup)
    horizon = setup.horizon
    spent = 0.0  # rounds before r, summed as ``RoundLoads.seconds`` sums them
    before = idle = 0  # placements before this round; empty rounds in a row
    r = 0
    while any(st.left.values()):
        _fill_round(st, r, horizon)
        if st.later is not None:
            # round r is final: later placements go to rounds after it
            spent += rounds.round_seconds(r)
            yield spent, st.later.finish(rounds.busy[r])
        r += 1
        # Once more than ``horizon`` rounds in a row took nothing, every later round is as
        # empty as the last of them: a pair it did not take (a row bigger than any
        # round's room) never goes.
        idle = idle + 1 if st.placements == before else 0
        if idle > horizon + 1:
            raise TooSmall
        before = st.placements


def _fill_round(st: FillState, r: int, horizon: int) -> None:
    """Round ``r``: every sender with pairs left takes its turn, the one with the most
    link time left first (ties: the lower rank), so the busiest links never wait. Rounds
    up to ``r + horizon`` are open: a placement's later legs and staging land there."""
    placed = st.placed
    if placed is not None:
        while len(placed) <= r + 1:
            placed.append([])
    st.rounds.open(r + horizon)
    left, send_left = st.left, st.send_left
    for s in sorted((x for x in left if left[x]), key=lambda x: (-send_left[x], x)):
        _turn(st, s, r)


def _turn(st: FillState, s: int, r: int) -> None:
    """Sender ``s``'s turn in round ``r``: first the pairs it served last round (no new
    peer), then its other pairs by priority, until its own links are full or nothing
    more fits. What it served becomes the next round's first pairs."""
    served, is_full = _continue_served(st, s, r)
    if st.heaps[s] and not is_full:
        if nothing_fits(st, s, r):
            # the priority pass would pop every pair and put the live ones back with
            # their current keys, placing nothing: do just that
            requeue(st, s)
        else:
            _serve_by_priority(st, s, r, served)
    st.active[s] = served
    st.stamp += 1


def _continue_served(st: FillState, s: int, r: int) -> tuple[list[Pair], bool]:
    """Place what fits of the pairs ``s`` served in the previous round (a pair that
    continues costs no new peer), and stamp them so the priority pass skips them: those
    it placed again, and whether its own links are full now. Within a round only the
    sender's own placements fill its own keys, so whether it is full changes only when it
    places something."""
    active = st.active[s]
    is_full = full(st, s, r)
    served = []
    for p in active:
        if p.left > 0 and not is_full and _place(st, s, p, r):
            served.append(p)
            is_full = full(st, s, r)
    stamp = st.stamp
    for p in active:
        p.stamp = stamp  # served last round: tried above already
    return served, is_full


def _serve_by_priority(st: FillState, s: int, r: int, served: list[Pair]) -> None:
    """Pop ``s``'s pairs by priority (:func:`_pop_current`) and place what fits of each
    into round ``r``, appending those placed to ``served``; stop once its own links are
    full, or nothing more of it fits them (then every live pair goes back with its current
    key, :func:`requeue`). The pairs popped and still live go back in its heap."""
    heap, examined = st.heaps[s], []
    full_time, full_stage = st.rounds.full_time, st.rounds.full_stage
    ft, fs = full_time[r], full_stage[r]
    stamp = st.stamp
    p = _pop_current(st, heap, heappop(heap))
    while p is not None:
        examined.append(p)
        # (a receiver with no room left: ``rounds.blocked``'s first test)
        if not (p.stamp == stamp or p.gate_mask & ft or p.sgate_mask & fs):
            if _place(st, s, p, r):
                served.append(p)
                if full(st, s, r):
                    break
                if stuck(st, s, r):
                    # the rest of the turn would place nothing: every pair popped, the
                    # live ones back with their current keys
                    examined = []
                    requeue(st, s)
                    break
                ft, fs = full_time[r], full_stage[r]
        p = _pop_current(st, heap, heappop(heap) if heap else None)
    ranks_of = st.ranks_of
    for p in examined:
        if p.left > 0:
            now = ranks_of[p.receiver_set]
            heappush(heap, (-(priority(st, p.receiver_set) if now is None else now), p.rank_in, p))


def _pop_current(st: FillState, heap: list[Entry], entry: Entry | None) -> Pair | None:
    """From the popped ``entry`` on, the first pair popped that has bytes left and whose
    key is still current, or at least ranks it above the rest of the heap; ``None``
    once the heap is empty. Keys only overstate (work left only shrinks): a stale pair
    goes back in with its current key, and the next is popped (lazy re-ranking)."""
    ranks_of = st.ranks_of
    while entry is not None:
        key, rk, p = entry
        if p.left > 0:
            now = ranks_of[p.receiver_set]
            if now is None:
                now = priority(st, p.receiver_set)
            now = -now
            if now > key and heap and now > heap[0][0]:
                entry = heappushpop(heap, (now, rk, p))
                continue
            return p
        entry = heappop(heap) if heap else None
    return None


def _place(st: FillState, s: int, p: Pair, r: int) -> bool:
    """Put what fits of sender ``s``'s pair ``p`` into round ``r``; whether anything
    went. It asks for at least ``min(left, chunk)`` bytes of room (a pair never goes in
    slivers), takes whole transfers and rows within the room (:func:`take`), and
    accounts them (:func:`record_placement`)."""
    rounds = st.rounds
    if rounds.blocked(p, r):
        return False
    need = min(p.left, p.chunk)
    room = rounds.room(p, r, need)
    if room < need:
        return False
    got = take(p, room, st.placed, r)
    if not got:
        return False
    rounds.add(p, r, got)
    record_placement(st, s, p, r, got, room)
    return True


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
