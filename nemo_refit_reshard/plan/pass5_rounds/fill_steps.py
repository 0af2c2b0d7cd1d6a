"""What a fill (``fill.py``) knows while it runs, and how a placement changes it: the
work every sender and receiver has left, each sender's pairs in a heap by their busiest
receiver's work left, and the tests that tell a sender's turn can place nothing more.

:func:`start_fill` builds a :class:`FillState` from the pairs and their
:class:`FillSetup`; ``fill.py`` runs the rounds and the senders' turns over it and
calls :func:`record_placement` after every placement.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, is_, neg

from ..base import Transfer
from .fill_setup import FillSetup
from .pair_loads import Pair, RoundLoads, TooSmall
from .price_limit import LaterBound, round_cap

rset_of, rank_in_of = attrgetter("receiver_set"), attrgetter("rank_in")

# A sender's heap entry: (-(its busiest receiver's work left), rotation, pair).
Entry = tuple[float, int, Pair]


class OwnGroup:
    """Pairs of one sender with the same costs on its own links and the same chunk."""

    __slots__ = ("terms", "chunk", "live", "tails")

    def __init__(self, terms: tuple[tuple[int, int, float, int], ...], chunk: float) -> None:
        self.terms = terms  # their ``now_time`` entries on the sender's out keys
        self.chunk = chunk
        self.live = 0  # pairs with bytes left
        self.tails: dict[Pair, float] = {}  # live pairs with fewer bytes left than a chunk


@dataclass(slots=True)
class FillState:
    """What the steps of one fill share (per sender ``s``, per time index ``idx``, per
    receiver set ``rset``: ``FillSetup`` numbers them)."""

    rounds: RoundLoads
    placed: list[list[Transfer]] | None  # where the transfers go (None: count bytes)
    log: list[tuple[int, Pair, float]] | None  # (round, pair, room) of every placement
    send_left: dict[int, float]  # sender's link time left
    recv_left: defaultdict[int, float]  # time index's receiving work left
    receiver_sets: list[tuple[int, ...]]  # rset -> its time indices
    sets_with: dict[int, list[int]]  # idx -> the receiver sets holding it
    # rset -> its busiest receiver's work left; None where a placement changed it
    ranks_of: list[float | None]
    heaps: dict[int, list[Entry]]  # sender's pairs, keys upper bounds (lazy re-ranking)
    left: dict[int, int]  # sender's pairs with bytes left
    shift: int  # time bits below it, staging bits above, in ``gates``
    gates: dict[int, dict[Pair, int]]  # sender's live pairs -> receivers' full bits
    groups: dict[int, list[OwnGroup]]  # sender's pairs by costs on its own links
    group_of: dict[Pair, OwnGroup]
    own: dict[int, tuple[int, int]]  # sender -> (its out keys, its staging bit)
    later: LaterBound | None = None  # the bound on rounds still to come (price fills)
    active: defaultdict[int, list[Pair]] = field(default_factory=lambda: defaultdict(list))
    stamp: int = 0  # marks the pairs a sender served in the previous round, per turn
    placements: int = 0


def reset_pairs(pairs: list[Pair], rounds: RoundLoads, setup: FillSetup) -> None:
    """Every pair back to its first byte, with its rank and receiver set from ``setup``.
    Raises :class:`TooSmall` if a round with nothing else in it cannot take a pair's
    least ask ``min(bytes, chunk)``: no round ever could."""
    at = pairs.__getitem__
    # what an empty round takes of a pair (the same for pairs with the same capacity terms)
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


def _first_heaps(pairs: list[Pair], setup: FillSetup) -> dict[int, list[Entry]]:
    """Each sender's pairs in a heap by (-(busiest receiver's work left), rotation).
    Work left only shrinks, so a stored key is an upper bound: a popped pair whose key
    has gone stale goes back in with its current one (lazy re-ranking instead of sorting
    every sender's pairs every round)."""
    at = pairs.__getitem__
    heaps = {s: [(key, rk, at(i)) for key, rk, i in es] for s, es in setup.heaps.items()}
    for heap in heaps.values():
        heapq.heapify(heap)
    return heaps


def _own_groups(
    pairs: list[Pair], setup: FillSetup
) -> tuple[dict[int, list[OwnGroup]], dict[Pair, OwnGroup]]:
    """Each sender's pairs grouped by what a byte of them costs its own links (their
    ``now_time`` terms on its out keys) and their chunk, and each pair's group: with the
    tails of the live ones whose bytes left are below it, a group's least ask
    ``min(left, chunk)``. A turn in which every group's least ask overflows one of those
    links places nothing (:func:`stuck`)."""
    at = pairs.__getitem__
    groups: dict[int, list[OwnGroup]] = {}
    group_of: dict[Pair, OwnGroup] = {}
    for src, setups in setup.groups.items():
        own_groups = groups[src] = []
        for terms, chunk, ids, tails in setups:
            g = OwnGroup(terms, chunk)
            g.live = len(ids)
            g.tails = {at(i): at(i).left for i in tails}
            group_of.update(zip(map(at, ids), repeat(g)))
            own_groups.append(g)
    return groups, group_of


def start_fill(
    pairs: list[Pair],
    rounds: RoundLoads,
    placed: list[list[Transfer]] | None,
    totals: list[float] | None,
    log: list[tuple[int, Pair, float]] | None,
    setup: FillSetup,
) -> FillState:
    """A fill's state before its first round (the pairs reset by :func:`reset_pairs`):
    all work left, the first heaps, every pair live. ``totals`` given (a price fill), a
    :class:`LaterBound` to tell the caller what the rounds still to come take at least."""
    at = pairs.__getitem__
    state = FillState(
        rounds=rounds,
        placed=placed,
        log=log,
        send_left=dict(setup.send_left),
        recv_left=defaultdict(float, setup.recv_left),
        receiver_sets=setup.receiver_sets,
        sets_with=setup.sets_with,
        ranks_of=list(setup.priorities),
        heaps=_first_heaps(pairs, setup),
        left={s: len(ids) for s, ids in setup.by_src.items()},
        shift=setup.shift,
        # each sender's live pairs -> their receivers' time and staging bits in one mask
        # (time bits below ``shift``): a turn where every one meets a full bit places nothing
        gates={
            s: dict(zip(map(at, ids), map(setup.gates.__getitem__, ids)))
            for s, ids in setup.by_src.items()
        },
        groups={},
        group_of={},
        own=setup.own,
    )
    state.groups, state.group_of = _own_groups(pairs, setup)
    for p in pairs:
        p.stamp = -1
    if totals is not None:
        caps = {k: round_cap(at(k), rounds) for k in setup.capacity_firsts}
        state.later = LaterBound(
            pairs, rounds, totals, list(map(caps.__getitem__, setup.same_capacity))
        )
    return state


def priority(st: FillState, rset: int) -> float:
    """Receiver set ``rset``'s busiest receiver's work left: cached per set, computed
    again where a placement dropped it (``record_placement``)."""
    x = st.ranks_of[rset]
    if x is None:
        x = st.ranks_of[rset] = max(st.recv_left[i] for i in st.receiver_sets[rset])
    return x


def full(st: FillState, s: int, r: int) -> bool:
    """Whether sender ``s``'s own links (or its send staging) have no room in ``r``: its
    turn then places nothing more."""
    keys, stage = st.own[s]
    rounds = st.rounds
    return bool(stage & rounds.full_stage[r]) or keys & rounds.full_time[r] == keys


def stuck(st: FillState, s: int, r: int) -> bool:
    """Whether no live pair of ``s`` fits on its own links in round ``r``: for each
    group, one of them leaves less than its least ask."""
    for g in st.groups[s]:
        if g.live:
            least = min(g.chunk, *g.tails.values()) if g.tails else g.chunk
            if not st.rounds.short(g.terms, r, least):
                return False
    return True


def nothing_fits(st: FillState, s: int, r: int) -> bool:
    """Whether sender ``s`` can place nothing in round ``r``: every live pair's receiver
    set has a full key, or no pair fits on the sender's own links (:func:`stuck`)."""
    mask = st.rounds.full_time[r] | st.rounds.full_stage[r] << st.shift
    return all(map(mask.__and__, st.gates[s].values())) or stuck(st, s, r)


def requeue(st: FillState, s: int) -> None:
    """Sender ``s``'s live pairs back in its heap with their current keys: what
    popping every pair would leave in a turn that places nothing more."""
    # (in C: every live pair's key is its receiver set's cached priority, computed
    # first where a placement dropped it)
    live = st.gates[s]
    ranks_of = st.ranks_of
    for rset in compress(
        rsets := list(map(rset_of, live)),
        map(is_, map(ranks_of.__getitem__, rsets), repeat(None)),
    ):
        priority(st, rset)
    heap = st.heaps[s]
    heap[:] = zip(map(neg, map(ranks_of.__getitem__, rsets)), map(rank_in_of, live), live)
    heapq.heapify(heap)


def record_placement(st: FillState, s: int, p: Pair, r: int, got: float, room: float) -> None:
    """Account ``got`` bytes of sender ``s``'s pair ``p`` placed in round ``r`` (taken
    with ``room``): the log and the later bound, the sender's and receivers' work left
    (dropping the cached priorities of the receiver sets it changes), and ``p``'s group
    and liveness."""
    st.placements += 1
    if st.log is not None:
        st.log.append((r, p, room))
    if st.later is not None:
        st.later.placed(p)
    st.send_left[s] -= got * p.send_cost
    recv_left, ranks_of, sets_with = st.recv_left, st.ranks_of, st.sets_with
    for idx, c in p.recv:
        recv_left[idx] -= got * c
        for rset in sets_with[idx]:
            ranks_of[rset] = None
    g = st.group_of[p]
    if p.left <= 0:
        st.left[s] -= 1
        del st.gates[s][p]
        g.live -= 1
        g.tails.pop(p, None)
    elif p.left < g.chunk:
        g.tails[p] = p.left
