"""Rounds for a known topology: one time budget per round, filled pair by pair.

The cluster model (``plan/predict.py::round_time``) prices a round at its slowest
(GPU, link) and a refit at the sum over rounds::

    t_r(g, L) = max(out_rL(g), in_rL(g)) / bw_L + lat_L * n_rL(g),   T = sum_r max_{g,L} t_r(g, L)

``T`` equals the busiest link's total time only if that link is equally busy in every
round and every other link stays below it; first-fit packing of fixed-size parts fills
the early rounds and leaves a tail of half-empty ones, and many small parts cost many
messages. Here:

1. **Pairs.** Transfers are grouped by (sender, stored receiver). A pair's bytes load
   fixed keys with fixed coefficients (its *effects*): the sender's link once per member
   of the receiver's replica group (``members``), each member's link, and with relay
   runs (``relay="domain"``) the link of every run member that forwards it, ``k``
   rounds later for the ``k``-th hop; staging likewise, in bytes.
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
   the formula above (relay hops and message counts included); the cheapest is filled
   again with the real transfers, cut at row boundaries where a round's room ends.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from .balance import LinkModel, Transfer, cut_rows
from .carry import legs
from .schedule import Message, message_order, round_messages

# A round where a key has less than this fraction of its budget left (or less than a
# worthwhile chunk's time) counts as full for it: pairs skip it without pricing it.
FULL = 1 / 64
# A pair does not open a message for fewer bytes than take this many latencies to move
# (unless that is all it has left): a sliver of a round costs more than it carries.
MIN_CHUNK_LATENCIES = 4


class TimedRounds(NamedTuple):
    """The rounds, the time budget every (GPU, link) kept to in each of them, and the
    refit time the scheduler predicts for them (``predict.predict_refit`` of the plan)."""

    rounds: list[list[Message]]
    budget: float
    seconds: float


class _Pair:
    """One (sender, stored receiver) pair: its transfers and what a byte of it costs.

    Effects on keys: time keys are ``2 * key + direction`` indices into a round's busy
    seconds (``key`` a (rank, link), direction 0 out / 1 in), staging keys
    ``2 * rank + direction`` indices into its staged bytes (0 send / 1 receive).
    """

    __slots__ = (
        "src",
        "dst",
        "via",
        "transfers",
        "nbytes",
        "left",
        "queue",
        "t0",
        "s0",
        "m0",
        "tl",
        "sl",
        "ml",
        "gate",
        "sgate",
        "chunk",
        "send_cost",
        "recv",
        "rkey",
        "horizon",
    )

    def __init__(self, src: int, dst: int, via: int, transfers: list[Transfer]) -> None:
        self.src, self.dst = src, dst
        self.via = via  # the rank that carries it (``plan/carry.py``), or -1
        self.transfers = transfers
        self.nbytes = sum(t.nbytes for t in transfers)
        self.left = float(self.nbytes)  # bytes not yet placed
        self.queue: list[Transfer] = []  # transfers not yet placed, last one next
        # In the round the pair is placed in: (time index, key, seconds per byte, this
        # pair's messages on the key), (staging index, bytes per byte), and its
        # messages (code of (src, dst), src key, dst key). A pair is placed at most once
        # per round, so these messages are always new there.
        self.t0: list[tuple[int, int, float, int]] = []
        self.s0: list[tuple[int, int]] = []
        self.m0: list[tuple[int, int, int]] = []
        # Relay hops and carried second legs, ``offset`` rounds later, summed per key:
        # (offset, time index, key, seconds per byte), (offset, staging index, bytes per
        # byte), and their messages (offset, code of (src, dst), src key, dst key).
        self.tl: list[tuple[int, int, int, float]] = []
        self.sl: list[tuple[int, int, int]] = []
        self.ml: list[tuple[int, int, int, int]] = []
        self.gate: list[int] = []  # receivers' time indices: a full one blocks the pair
        self.sgate: list[int] = []  # receivers' staging indices
        self.chunk = 0.0  # smallest worthwhile message, bytes
        self.send_cost = 0.0  # sender link seconds per byte
        self.recv: list[tuple[int, float]] = []  # (members' time index, seconds per byte)
        self.rkey: tuple[int, ...] = ()  # those indices
        self.horizon = 0  # largest round offset of a hop


class _Rounds:
    """Per-round load of every key, and the pricing and adding of pairs in rounds."""

    def __init__(self, tau: float, bucket: int, latency: list[float], num_ranks: int) -> None:
        self.tau, self.bucket = tau, bucket
        self.latency = latency  # per time key
        self.num_keys = len(latency)
        self.num_ranks = num_ranks
        self.codes = num_ranks * num_ranks  # message code = round * codes + src * ranks + dst
        self.busy: list[list[float]] = []  # [round][2 * key + direction] seconds
        self.count: list[list[int]] = []  # [round][key] messages sent + received
        self.staged: list[list[int]] = []  # [round][2 * rank + direction] bytes
        self.full_time: list[set[int]] = []  # [round] time indices with no room left
        self.full_stage: list[set[int]] = []  # [round] staging indices with no room left
        self.sent: set[int] = set()  # codes of (round, src, dst) with a message

    def open(self, r: int) -> None:
        while len(self.busy) <= r:
            self.busy.append([0.0] * (2 * self.num_keys))
            self.count.append([0] * self.num_keys)
            self.staged.append([0] * (2 * self.num_ranks))
            self.full_time.append(set())
            self.full_stage.append(set())

    def blocked(self, p: _Pair, r: int) -> bool:
        """Whether a receiving key of ``p`` has no room left in round ``r`` (a cheap
        test before :meth:`room`; ``_fill`` tests the sender's own keys itself)."""
        full = self.full_time[r]
        for idx in p.gate:
            if idx in full:
                return True
        full = self.full_stage[r]
        for idx in p.sgate:
            if idx in full:
                return True
        ft, fs = self.full_time, self.full_stage
        for o, idx, _, _ in p.tl:
            if idx in ft[r + o]:
                return True
        for o, idx, _ in p.sl:
            if idx in fs[r + o]:
                return True
        return False

    def room(self, p: _Pair, r: int) -> float:
        """Bytes of ``p`` that round ``r`` can still take (rounds up to ``r + horizon``
        must be open)."""
        tau, lat, bucket = self.tau, self.latency, self.bucket
        busy, count = self.busy[r], self.count[r]
        x = math.inf
        for idx, k, c, n in p.t0:
            # A new message's latency counts on both directions of its link.
            spare = tau - lat[k] * (count[k] + n)
            left = spare - busy[idx]
            if left <= 0 or (n and spare <= busy[idx ^ 1]):
                return 0.0
            if left < x * c:
                x = left / c
        staged = self.staged[r]
        for idx, c in p.s0:
            left = bucket - staged[idx]
            if left <= 0:
                return 0.0
            if left < x * c:
                x = left / c
        if p.tl:
            sent, codes = self.sent, self.codes
            new: dict[tuple[int, int], int] = defaultdict(int)
            for o, code, ka, kb in p.ml:
                if (r + o) * codes + code not in sent:
                    new[(o, ka)] += 1
                    new[(o, kb)] += 1
            for o, idx, k, c in p.tl:
                rr = r + o
                n = new[(o, k)]
                spare = tau - lat[k] * (self.count[rr][k] + n)
                left = spare - self.busy[rr][idx]
                if left <= 0 or (n and spare <= self.busy[rr][idx ^ 1]):
                    return 0.0
                if left < x * c:
                    x = left / c
            for o, idx, c in p.sl:
                left = bucket - self.staged[r + o][idx]
                if left <= 0:
                    return 0.0
                if left < x * c:
                    x = left / c
        return x

    def capacity(self, p: _Pair) -> float:
        """Bytes of ``p`` a round with nothing else in it takes."""
        x = math.inf
        for _, k, c, n in p.t0:
            x = min(x, (self.tau - self.latency[k] * n) / c)
        for _, c in p.s0:
            x = min(x, self.bucket / c)
        later: dict[tuple[int, int], int] = defaultdict(int)
        for o, _, ka, kb in p.ml:
            later[(o, ka)] += 1
            later[(o, kb)] += 1
        for o, _, k, c in p.tl:
            x = min(x, (self.tau - self.latency[k] * later[(o, k)]) / c)
        for _, _, c in p.sl:
            x = min(x, self.bucket / c)
        return x

    def add(self, p: _Pair, r: int, nbytes: float) -> None:
        tau, lat, bucket = self.tau, self.latency, self.bucket
        sent, codes = self.sent, self.codes
        count, busy, full = self.count[r], self.busy[r], self.full_time[r]
        base = r * codes
        for code, ka, kb in p.m0:
            sent.add(base + code)
            count[ka] += 1
            count[kb] += 1
        for idx, k, c, _ in p.t0:
            busy[idx] += nbytes * c
            if tau - busy[idx] - lat[k] * count[k] < max(FULL * tau, MIN_CHUNK_LATENCIES * lat[k]):
                full.add(idx)
        staged, sfull = self.staged[r], self.full_stage[r]
        for idx, c in p.s0:
            staged[idx] += math.ceil(nbytes * c)
            if bucket - staged[idx] < FULL * bucket:
                sfull.add(idx)
        for o, code, ka, kb in p.ml:
            key = (r + o) * codes + code
            if key not in sent:
                sent.add(key)
                self.count[r + o][ka] += 1
                self.count[r + o][kb] += 1
        for o, idx, k, c in p.tl:
            rr = r + o
            row = self.busy[rr]
            row[idx] += nbytes * c
            left = tau - row[idx] - lat[k] * self.count[rr][k]
            if left < max(FULL * tau, MIN_CHUNK_LATENCIES * lat[k]):
                self.full_time[rr].add(idx)
        for o, idx, c in p.sl:
            row = self.staged[r + o]
            row[idx] += math.ceil(nbytes * c)
            if bucket - row[idx] < FULL * bucket:
                self.full_stage[r + o].add(idx)

    def seconds(self) -> float:
        """Sum over rounds of the slowest key's time (``predict.round_time``)."""
        total = 0.0
        for busy, count in zip(self.busy, self.count):
            worst = 0.0
            for k, lat in enumerate(self.latency):
                t = max(busy[2 * k], busy[2 * k + 1]) + lat * count[k]
                if t > worst:
                    worst = t
            total += worst
        return total


class _TooSmall(Exception):
    """An empty round cannot take a worthwhile chunk: the round budget is below latency."""


def _take(p: _Pair, room: float, placed: list[list[Transfer]] | None, r: int) -> float:
    """Take up to ``room`` bytes off ``p``: a divisible amount, or (``placed`` given)
    whole transfers and whole rows of the next one, appended to ``placed[r]`` (a
    carried pair: leg 1 to ``placed[r]``, leg 2 to ``placed[r + 1]``)."""
    if placed is None:
        x = min(room, p.left)
        p.left -= x
        return x
    queue, nbytes, taken = p.queue, 0, []
    while queue and nbytes + queue[-1].nbytes <= room:
        t = queue.pop()
        taken.append(t)
        nbytes += t.nbytes
    if queue and room > nbytes:
        cut = cut_rows(queue[-1], room - nbytes)
        if cut is not None:
            queue[-1] = cut[1]
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


def _fill(pairs: list[_Pair], rounds: _Rounds, placed: list[list[Transfer]] | None) -> None:
    """Round after round, every sender fills its links: first the pairs it served in the
    previous round (a pair that continues costs no new peer), then the pairs whose
    receivers have the most work left. Senders with the most work left go first, so
    the busiest links never wait while others finish early (longest remaining first).

    ``placed`` given: real transfers, cut at rows, are appended to ``placed[r]``;
    otherwise pairs are divisible amounts (to price a round budget)."""
    by_src: dict[int, list[_Pair]] = defaultdict(list)
    for p in pairs:
        if placed is not None:
            p.queue = sorted(p.transfers, key=message_order, reverse=True)
        p.left = float(p.nbytes)
        if rounds.capacity(p) < min(p.left, p.chunk):
            raise _TooSmall
        by_src[p.src].append(p)
    send_left = {s: sum(p.left * p.send_cost for p in ps) for s, ps in by_src.items()}
    # Work left per receiving link (time index): a pair ranks by its busiest receiver,
    # so members that several stored receivers share are seen as the sum of them all.
    recv_left: dict[int, float] = defaultdict(float)
    for p in pairs:
        for idx, c in p.recv:
            recv_left[idx] += p.left * c
    # Each sender's pairs in turn from a different receiver: the order between equals.
    rank_in = {}
    for i, src in enumerate(sorted(by_src)):
        ps = by_src[src]
        k = i * len(ps) // len(by_src)
        for j, p in enumerate(ps[k:] + ps[:k]):
            rank_in[id(p)] = j
    # A sender whose own links (or send staging) are full this round is skipped whole.
    own: dict[int, tuple[list[int], int]] = {}
    for src, ps in by_src.items():
        keys = sorted({idx for p in ps for idx, _, _, _ in p.t0 if idx % 2 == 0})
        own[src] = (keys, 2 * src)
    horizon = max(p.horizon for p in pairs)
    active: dict[int, list[_Pair]] = defaultdict(list)
    # A pair's receivers' work left, the busiest of them: cached per round and receiver
    # set (many pairs share one), dropped whenever a placement changes it.
    ranks_of: dict[tuple[int, ...], float] = {}

    def priority(rkey: tuple[int, ...]) -> float:
        x = ranks_of.get(rkey)
        if x is None:
            x = ranks_of[rkey] = max(recv_left[i] for i in rkey)
        return x

    # Each sender's pairs in a heap by (-(busiest receiver's work left), rotation). Work
    # left only shrinks, so a stored key is an upper bound: a popped pair whose key has
    # gone stale goes back in with its current one (lazy re-ranking instead of sorting
    # every sender's pairs every round).
    heaps = {s: [(-priority(p.rkey), rank_in[id(p)], p) for p in ps] for s, ps in by_src.items()}
    for heap in heaps.values():
        heapq.heapify(heap)
    left = {s: len(ps) for s, ps in by_src.items()}  # pairs with bytes left

    def place(s: int, p: _Pair, r: int) -> bool:
        """Put what fits of ``p`` into round ``r``; whether anything went."""
        if rounds.blocked(p, r):
            return False
        room = rounds.room(p, r)
        if room < min(p.left, p.chunk):
            return False
        got = _take(p, room, placed, r)
        if not got:
            return False
        rounds.add(p, r, got)
        send_left[s] -= got * p.send_cost
        for idx, c in p.recv:
            recv_left[idx] -= got * c
        ranks_of.clear()
        if p.left <= 0:
            left[s] -= 1
        return True

    def full(s: int, r: int) -> bool:
        """Whether sender ``s``'s own links (or its send staging) have no room in ``r``."""
        keys, stage = own[s]
        full_time = rounds.full_time[r]
        return stage in rounds.full_stage[r] or all(k in full_time for k in keys)

    r = 0
    while any(left.values()):
        if placed is not None:
            while len(placed) <= r + 1:
                placed.append([])
        rounds.open(r + horizon)
        for s in sorted((x for x in left if left[x]), key=lambda x: (-send_left[x], x)):
            # first the pairs it served last round (no new peer), then by priority
            served = [p for p in active[s] if p.left > 0 and not full(s, r) and place(s, p, r)]
            heap, examined = heaps[s], []
            chosen = {id(p) for p in active[s]}
            while heap and not full(s, r):
                key, rk, p = heapq.heappop(heap)
                if p.left <= 0:
                    continue
                now = -priority(p.rkey)
                if now > key and heap and now > heap[0][0]:
                    heapq.heappush(heap, (now, rk, p))
                    continue
                examined.append(p)
                if id(p) not in chosen and place(s, p, r):
                    served.append(p)
            for p in examined:
                if p.left > 0:
                    heapq.heappush(heap, (-priority(p.rkey), rank_in[id(p)], p))
            active[s] = served
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
        return []
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
        [t.src for t in transfers]
        + [m for g in members.values() for m in g]
        + [t.dst for t in transfers]
        + [m for run in runs for m in run]
        + [via for _, via in carried]
        + [t.src for t, _ in carried]
    )

    def pairs_of(direct: list[Transfer], through: Sequence[tuple[Transfer, int]]) -> list[_Pair]:
        by_pair: dict[tuple[int, int, int], list[Transfer]] = defaultdict(list)
        for t in direct:
            by_pair[(t.src, t.dst, -1)].append(t)
        for t, via in through:
            by_pair[(t.src, t.dst, via)].append(t)
        out = [
            _pair(src, dst, via, ts, links, members, position, key, ranks)
            for (src, dst, via), ts in sorted(by_pair.items())
        ]
        for p in out:  # a chunk never needs more than a round's staging
            p.chunk = min(p.chunk, bucket_bytes / max(c for _, c in p.s0))
        return out

    pairs = pairs_of(transfers, carried)
    best = _choose(pairs, bucket_bytes, latency, ranks)
    if carried:
        # Carrying pays in NIC time but costs a round of lag and more staging; where the
        # staging bound or latency rules, sending everything directly can come out ahead.
        plain = pairs_of(transfers + [t for t, _ in carried], ())
        alternative = _choose(plain, bucket_bytes, latency, ranks, rounds=best and best[2])
        if alternative is not None and (best is None or alternative[0] < best[0]):
            pairs, best = plain, alternative
    if best is None:
        raise ValueError(
            "no round count gives a round budget above the message latency; raise bucket_mb"
        )
    placed: list[list[Transfer]] = []
    final = _Rounds(best[1], bucket_bytes, latency, ranks)
    _fill(pairs, final, placed)
    out = [round_messages(r, ts) for r, ts in enumerate(placed)]
    while out and not out[-1]:
        out.pop()
    return TimedRounds(out, final.tau, final.seconds())


def _choose(
    pairs: list[_Pair],
    bucket_bytes: int,
    latency: list[float],
    ranks: int,
    rounds: int | None = None,
) -> tuple[float, float, int] | None:
    """(predicted seconds, round budget, round count) of the cheapest of a few budgets
    (None if no budget lets every pair place a worthwhile chunk).

    ``R`` runs from the staging bound ``max staged / bucket`` up (``rounds`` given: that
    one only, as it is), the budget being the busiest link's seconds over ``R``; more
    rounds cost more messages, fewer leave less room to balance. Then the best count's
    budget is raised to hold what spilled past its rounds (latency, packing): a third of
    a round spilled costs a whole one.
    """
    busy: dict[int, float] = defaultdict(float)
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
    longest = max(busy.values())
    least = max(1, math.ceil(max(staged.values()) / bucket_bytes))
    # No budget below what one message of every pair needs (its latencies, and its bytes
    # up to a worthwhile chunk): small plans are latency-bound whatever the budget.
    floor = max(_least_budget(p, latency) for p in pairs)
    best: tuple[float, float, int] | None = None

    def price(tau: float, num_rounds: int) -> None:
        nonlocal best
        state = _Rounds(max(tau, floor), bucket_bytes, latency, ranks)
        try:
            _fill(pairs, state, None)
        except _TooSmall:
            return
        seconds = state.seconds()
        if best is None or seconds < best[0]:
            best = (seconds, state.tau, num_rounds)

    counts = {least, -(-5 * least // 4), -(-3 * least // 2), 2 * least}
    for num_rounds in sorted(counts) if rounds is None else [max(rounds, least)]:
        price(longest / num_rounds, num_rounds)
    if best is not None and rounds is None:
        price(best[0] / best[2], best[2])
    return best


def _least_budget(p: _Pair, latency: list[float]) -> float:
    """Smallest round budget in which an empty round takes ``min(bytes, chunk)`` of
    ``p`` (``_Rounds.capacity`` at least that)."""
    need = min(p.nbytes, p.chunk)
    budget = max(latency[k] * n + c * need for _, k, c, n in p.t0)
    later: dict[tuple[int, int], int] = defaultdict(int)
    for o, _, ka, kb in p.ml:
        later[(o, ka)] += 1
        later[(o, kb)] += 1
    for o, _, k, c in p.tl:
        budget = max(budget, latency[k] * later[(o, k)] + c * need)
    return budget * (1 + 1e-9)


def _pair(
    src: int,
    dst: int,
    via: int,
    transfers: list[Transfer],
    links: LinkModel,
    members: Mapping[int, tuple[int, ...]],
    position: Mapping[int, tuple[tuple[int, ...], int]],
    key: Callable[[int, str], int],
    num_ranks: int,
) -> _Pair:
    """A pair and its effects: the sender's link once per member of ``dst``'s group,
    each member's link, and for a member in a relay run, every hop of the run. A
    carried pair (``via >= 0``) loads ``src -> via`` in its round and sends on from
    ``via`` one round later."""
    p = _Pair(src, dst, via, transfers)
    times: dict[int, float] = defaultdict(float)  # time index -> seconds per byte
    msgs: dict[int, int] = defaultdict(int)  # key -> this pair's messages on it
    stages: dict[int, int] = defaultdict(int)  # staging index -> bytes per byte
    m0 = []

    def direct(a: int, b: int) -> None:
        link, spb = links.link(a, b)
        ka, kb = key(a, link), key(b, link)
        times[2 * ka] += spb
        times[2 * kb + 1] += spb
        msgs[ka] += 1
        msgs[kb] += 1
        stages[2 * a] += 1
        stages[2 * b + 1] += 1
        m0.append((a * num_ranks + b, ka, kb))
        p.send_cost += spb
        p.gate.append(2 * kb + 1)
        p.sgate.append(2 * b + 1)

    later_t: dict[tuple[int, int], float] = defaultdict(float)  # (offset, index) -> s/byte
    later_s: dict[tuple[int, int], int] = defaultdict(int)
    later_m: dict[tuple[int, int], tuple[int, int]] = {}  # (offset, code) -> keys

    def hop(offset: int, a: int, b: int) -> None:
        link, spb = links.link(a, b)
        ka, kb = key(a, link), key(b, link)
        later_t[(offset, 2 * ka)] += spb
        later_t[(offset, 2 * kb + 1)] += spb
        later_s[(offset, 2 * a)] += 1
        later_s[(offset, 2 * b + 1)] += 1
        later_m[(offset, a * num_ranks + b)] = (ka, kb)
        p.horizon = max(p.horizon, offset)

    lag = 0
    if via >= 0:
        direct(src, via)
        lag = 1
    for m in members.get(dst, (dst,)):
        sender = src if via < 0 else via
        link, spb = links.link(sender, m)
        p.chunk = max(p.chunk, MIN_CHUNK_LATENCIES * links.latency(link) / spb)
        if via < 0:
            direct(src, m)
        else:
            hop(1, via, m)
        run, i = position.get(m, ((m,), 0))
        w = len(run)
        for k in range(1, w):
            hop(lag + k, run[(i + k - 1) % w], run[(i + k) % w])
    p.tl = [(o, idx, idx // 2, c) for (o, idx), c in sorted(later_t.items())]
    p.sl = [(o, idx, c) for (o, idx), c in sorted(later_s.items())]
    p.ml = [(o, code, ka, kb) for (o, code), (ka, kb) in sorted(later_m.items())]
    p.t0 = [(idx, idx // 2, c, msgs[idx // 2]) for idx, c in sorted(times.items())]
    p.recv = [(idx, times[idx]) for idx in p.gate]
    p.rkey = tuple(idx for idx, _ in p.recv)
    p.s0 = sorted(stages.items())
    p.m0 = m0
    return p
