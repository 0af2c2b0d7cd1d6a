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
3. **Fill.** Pairs are poured in turn (senders interleaved, each starting at a different
   receiver) into the earliest rounds with room: a round takes the bytes that fit every
   effect, after one message latency on each key where the pair is new in that round.
   A pair spans few rounds, so it costs few messages.
4. **Choice.** Several ``R`` are filled with pairs as divisible amounts and priced by
   the formula above (relay hops and message counts included); the cheapest is filled
   again with the real transfers, cut at row boundaries where a round's room ends.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

from ..layouts.base import Box
from .balance import LinkModel, Transfer
from .schedule import Message, message_order

# A round where a key has less than this fraction of its budget left (or less than a
# worthwhile chunk's time) counts as full for it: pairs skip it without pricing it.
FULL = 1 / 64
# A pair does not open a message for fewer bytes than take this many latencies to move
# (unless that is all it has left): a sliver of a round costs more than it carries.
MIN_CHUNK_LATENCIES = 4


class _Pair:
    """One (sender, stored receiver) pair: its transfers and what a byte of it costs."""

    __slots__ = (
        "src",
        "dst",
        "transfers",
        "nbytes",
        "left",
        "queue",
        "times",
        "stages",
        "messages",
        "chunk",
        "send_cost",
        "recv_cost",
        "horizon",
        "t0",
        "s0",
        "m0",
        "th",
        "sh",
        "mh",
        "gate",
        "sgate",
    )

    def __init__(self, src: int, dst: int, transfers: list[Transfer]) -> None:
        self.src, self.dst = src, dst
        self.transfers = transfers
        self.nbytes = sum(t.nbytes for t in transfers)
        self.left = float(self.nbytes)  # bytes not yet placed
        self.queue: list[Transfer] = []  # transfers not yet placed, last one next
        # (round offset, time key, direction 0=out/1=in, seconds per byte)
        self.times: list[tuple[int, int, int, float]] = []
        # (round offset, rank, direction 0=send/1=recv, staged bytes per byte)
        self.stages: list[tuple[int, int, int, int]] = []
        # (round offset, src, dst, src's time key, dst's time key)
        self.messages: list[tuple[int, int, int, int, int]] = []
        self.chunk = 0.0  # smallest worthwhile message, bytes
        self.send_cost = 0.0  # sender link seconds per byte
        self.recv_cost = 0.0  # a member's link seconds per byte (the largest)
        self.horizon = 0  # largest round offset of an effect (relay hops)
        # The effects compiled for pricing (``compile``): offset 0 and relay hops apart.
        self.t0: list[tuple[int, int, float, int]] = []  # (2k+d, k, coef, own new messages)
        self.s0: list[tuple[int, int]] = []  # (2*rank+d, coef)
        self.m0: list[tuple[int, int, int, int]] = []  # (src, dst, src key, dst key)
        self.th: list[tuple[int, int, int, float]] = []  # (offset, 2k+d, k, coef)
        self.sh: list[tuple[int, int, int]] = []  # (offset, 2*rank+d, coef)
        self.mh: list[tuple[int, int, int, int, int]] = []  # (offset, src, dst, keys)
        self.gate: list[int] = []  # receivers' time keys: full ones block the pair
        self.sgate: list[int] = []  # receivers' staging keys

    def compile(self) -> None:
        """Split the effects into the forms ``_Rounds`` prices fastest. A pair is placed
        at most once per round, so its own offset-0 messages are always new there."""
        own: dict[int, int] = defaultdict(int)
        for o, _, _, ks, kd in self.messages:
            if o == 0:
                own[ks] += 1
                own[kd] += 1
        self.t0 = [(2 * k + d, k, c, own[k]) for o, k, d, c in self.times if o == 0]
        self.s0 = [(2 * r + d, c) for o, r, d, c in self.stages if o == 0]
        self.m0 = [(a, b, ka, kb) for o, a, b, ka, kb in self.messages if o == 0]
        self.th = [(o, 2 * k + d, k, c) for o, k, d, c in self.times if o > 0]
        self.sh = [(o, 2 * r + d, c) for o, r, d, c in self.stages if o > 0]
        self.mh = [m for m in self.messages if m[0] > 0]
        self.gate = [2 * k + 1 for o, k, d, _ in self.times if o == 0 and d == 1]
        self.sgate = [2 * r + 1 for o, r, d, _ in self.stages if o == 0 and d == 1]


class _Rounds:
    """Per-round load of every key, and the pricing and filling of pairs into rounds."""

    def __init__(self, tau: float, bucket: int, latency: list[float], num_ranks: int) -> None:
        self.tau, self.bucket = tau, bucket
        self.latency = latency  # per time key
        self.num_keys = len(latency)
        self.num_ranks = num_ranks
        self.busy: list[list[float]] = []  # [round][2 * key + direction] seconds
        self.count: list[list[int]] = []  # [round][key] messages sent + received
        self.staged: list[list[int]] = []  # [round][2 * rank + direction] bytes
        self.full_time: list[set[int]] = []  # [round] {2 * key + direction} with no room
        self.full_stage: list[set[int]] = []  # [round] {2 * rank + direction} with no room
        self.sent: set[tuple[int, int, int]] = set()  # (round, src, dst) with a message

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
        for o, idx, _, _ in p.th:
            if idx in self.full_time[r + o]:
                return True
        for o, idx, _ in p.sh:
            if idx in self.full_stage[r + o]:
                return True
        return False

    def room(self, p: _Pair, r: int) -> float:
        """Bytes of ``p`` that round ``r`` can still take (rounds up to ``r + horizon``
        must be open)."""
        tau, lat = self.tau, self.latency
        busy, count = self.busy[r], self.count[r]
        x = math.inf
        for idx, k, c, n in p.t0:
            left = tau - busy[idx] - lat[k] * (count[k] + n)
            if left <= 0:
                return 0.0
            v = left / c
            if v < x:
                x = v
        staged, bucket = self.staged[r], self.bucket
        for idx, c in p.s0:
            left = bucket - staged[idx]
            if left <= 0:
                return 0.0
            v = left / c
            if v < x:
                x = v
        if p.th:
            new: dict[tuple[int, int], int] = defaultdict(int)
            for o, a, b, ka, kb in p.mh:
                if (r + o, a, b) not in self.sent:
                    new[(o, ka)] += 1
                    new[(o, kb)] += 1
            for o, idx, k, c in p.th:
                rr = r + o
                left = tau - self.busy[rr][idx] - lat[k] * (self.count[rr][k] + new[(o, k)])
                if left <= 0:
                    return 0.0
                v = left / c
                if v < x:
                    x = v
            for o, idx, c in p.sh:
                left = bucket - self.staged[r + o][idx]
                if left <= 0:
                    return 0.0
                v = left / c
                if v < x:
                    x = v
        return x

    def capacity(self, p: _Pair) -> float:
        """Bytes of ``p`` a round with nothing else in it takes."""
        x = math.inf
        counts: dict[tuple[int, int], int] = defaultdict(int)
        for o, _, _, ks, kd in p.messages:
            counts[(o, ks)] += 1
            counts[(o, kd)] += 1
        for o, k, _, c in p.times:
            x = min(x, (self.tau - self.latency[k] * counts[(o, k)]) / c)
        for _, _, _, c in p.stages:
            x = min(x, self.bucket / c)
        return x

    def add(self, p: _Pair, r: int, nbytes: float) -> None:
        tau, lat, bucket = self.tau, self.latency, self.bucket
        count = self.count[r]
        sent = self.sent
        for a, b, ka, kb in p.m0:
            sent.add((r, a, b))
            count[ka] += 1
            count[kb] += 1
        for o, a, b, ka, kb in p.mh:
            key = (r + o, a, b)
            if key not in sent:
                sent.add(key)
                self.count[r + o][ka] += 1
                self.count[r + o][kb] += 1
        busy, full = self.busy[r], self.full_time[r]
        for idx, k, c, _ in p.t0:
            busy[idx] += nbytes * c
            if tau - busy[idx] - lat[k] * count[k] < max(FULL * tau, MIN_CHUNK_LATENCIES * lat[k]):
                full.add(idx)
        staged, sfull = self.staged[r], self.full_stage[r]
        for idx, c in p.s0:
            staged[idx] += math.ceil(nbytes * c)
            if bucket - staged[idx] < FULL * bucket:
                sfull.add(idx)
        for o, idx, k, c in p.th:
            rr = r + o
            row = self.busy[rr]
            row[idx] += nbytes * c
            left = tau - row[idx] - lat[k] * self.count[rr][k]
            if left < max(FULL * tau, MIN_CHUNK_LATENCIES * lat[k]):
                self.full_time[rr].add(idx)
        for o, idx, c in p.sh:
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


def _split_rows(t: Transfer, nbytes: float) -> tuple[Transfer, Transfer] | None:
    """``t`` cut after as many whole rows of its lead dim as fit ``nbytes``; None if
    not one row fits."""
    sizes = t.canonical_box.sizes
    lead = next((d for d, s in enumerate(sizes) if s != 1), None)
    if lead is None:
        return None
    rows = sizes[lead]
    take = min(rows - 1, int(nbytes // (t.nbytes // rows)))
    if take < 1:
        return None
    box = t.canonical_box
    head_sizes = list(box.sizes)
    head_sizes[lead] = take
    tail_offsets, tail_sizes = list(box.offsets), list(box.sizes)
    tail_offsets[lead] += take
    tail_sizes[lead] -= take
    head = t.part(Box(box.offsets, tuple(head_sizes)))
    tail = t.part(Box(tuple(tail_offsets), tuple(tail_sizes)))
    return head, tail


def _take(p: _Pair, room: float, placed: list[Transfer] | None) -> float:
    """Take up to ``room`` bytes off ``p``: a divisible amount, or (``placed`` given)
    whole transfers and whole rows of the next one, appended to ``placed``."""
    if placed is None:
        x = min(room, p.left)
        p.left -= x
        return x
    queue, nbytes = p.queue, 0
    while queue and nbytes + queue[-1].nbytes <= room:
        t = queue.pop()
        placed.append(t)
        nbytes += t.nbytes
    if queue and room > nbytes:
        cut = _split_rows(queue[-1], room - nbytes)
        if cut is not None:
            queue[-1] = cut[1]
            placed.append(cut[0])
            nbytes += cut[0].nbytes
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
    recv_left: dict[int, float] = defaultdict(float)
    for p in pairs:
        recv_left[p.dst] += p.left * p.recv_cost
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
        keys = sorted({2 * k for p in ps for o, k, d, _ in p.times if o == 0 and d == 0})
        own[src] = (keys, 2 * src)
    horizon = max(p.horizon for p in pairs)
    active: dict[int, list[_Pair]] = defaultdict(list)
    r = 0
    while by_src:
        if placed is not None:
            while len(placed) <= r:
                placed.append([])
        rounds.open(r + horizon)
        full_time, full_stage = rounds.full_time[r], rounds.full_stage[r]
        for s in sorted(by_src, key=lambda x: (-send_left[x], x)):
            keys, stage = own[s]
            served: list[_Pair] = []
            first = [p for p in active[s] if p.left > 0]
            for phase in (0, 1):
                if stage in full_stage or all(k in full_time for k in keys):
                    break
                if phase:
                    chosen = {id(p) for p in first}
                    todo = sorted(
                        (p for p in by_src[s] if p.left > 0 and id(p) not in chosen),
                        key=lambda p: (-recv_left[p.dst], rank_in[id(p)]),
                    )
                else:
                    todo = first
                for p in todo:
                    if rounds.blocked(p, r):
                        continue
                    room = rounds.room(p, r)
                    if room < min(p.left, p.chunk):
                        continue
                    got = _take(p, room, placed[r] if placed is not None else None)
                    if not got:
                        continue
                    rounds.add(p, r, got)
                    send_left[s] -= got * p.send_cost
                    recv_left[p.dst] -= got * p.recv_cost
                    served.append(p)
                    if stage in full_stage or all(k in full_time for k in keys):
                        break
            active[s] = served
            if served and any(p.left <= 0 for p in served):
                by_src[s] = [p for p in by_src[s] if p.left > 0]
                if not by_src[s]:
                    del by_src[s]
        r += 1
        if r > 64 * (len(rounds.busy) + 64):
            raise AssertionError("round filling made no progress")


def timed_schedule(
    transfers: list[Transfer],
    bucket_bytes: int,
    links: LinkModel,
    members: Mapping[int, tuple[int, ...]] | None = None,
    runs: Sequence[tuple[int, ...]] = (),
) -> list[list[Message]]:
    """Rounds of messages for a known topology (module docstring).

    ``members[dst]``: the receivers a transfer stored for ``dst`` reaches in the same
    round (replicas, or with ``relay="domain"`` every run's entry). ``runs``: relay runs
    (``relay="domain"``); what enters a run at position ``p`` in round ``r`` travels on,
    from position ``p+k-1`` to ``p+k`` in round ``r+k`` (``plan/expand.py``).
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket size must be positive")
    if not transfers:
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

    by_pair: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        by_pair[(t.src, t.dst)].append(t)
    pairs = [
        _pair(src, dst, ts, links, members, position, key)
        for (src, dst), ts in sorted(by_pair.items())
    ]
    ranks = 1 + max(r for p in pairs for _, r, _, _ in p.stages)
    for p in pairs:  # a chunk never needs more than a round's staging
        p.chunk = min(p.chunk, bucket_bytes / max(c for _, _, _, c in p.stages))

    # The busiest link's seconds, and the staging bound on the round count.
    busy: dict[tuple[int, int], float] = defaultdict(float)
    staged: dict[tuple[int, int], float] = defaultdict(float)
    for p in pairs:
        for _, k, d, c in p.times:
            busy[(k, d)] += p.nbytes * c
        for _, rank, d, c in p.stages:
            staged[(rank, d)] += p.nbytes * c
    longest = max(busy.values())
    least = max(1, math.ceil(max(staged.values()) / bucket_bytes))
    # No budget below what one message of every pair needs (its latencies, and its bytes
    # up to a worthwhile chunk): small plans are latency-bound whatever the budget.
    floor = max(_least_budget(p, latency) for p in pairs)

    # Price a few round counts from the staging bound up: more rounds cost more messages,
    # fewer leave less room to balance. Keep the cheapest.
    best: tuple[float, float] | None = None
    for num_rounds in sorted({least, -(-5 * least // 4), -(-3 * least // 2), 2 * least}):
        rounds = _Rounds(max(longest / num_rounds, floor), bucket_bytes, latency, ranks)
        try:
            _fill(pairs, rounds, None)
        except _TooSmall:
            continue
        seconds = rounds.seconds()
        if best is None or seconds < best[0]:
            best = (seconds, rounds.tau)
    if best is None:
        raise ValueError(
            "no round count gives a round budget above the message latency; raise bucket_mb"
        )
    placed: list[list[Transfer]] = []
    _fill(pairs, _Rounds(best[1], bucket_bytes, latency, ranks), placed)
    out: list[list[Message]] = []
    for r, ts in enumerate(placed):
        by_dst: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
        for t in ts:
            by_dst[(t.src, t.dst)].append(t)
        out.append(
            [
                Message(r, src, dst, tuple(sorted(parts, key=message_order)))
                for (src, dst), parts in sorted(by_dst.items())
            ]
        )
    while out and not out[-1]:
        out.pop()
    return out


def _least_budget(p: _Pair, latency: list[float]) -> float:
    """Smallest round budget in which an empty round takes ``min(bytes, chunk)`` of
    ``p`` (``_Rounds.capacity`` at least that)."""
    counts: dict[tuple[int, int], int] = defaultdict(int)
    for o, _, _, ks, kd in p.messages:
        counts[(o, ks)] += 1
        counts[(o, kd)] += 1
    need = min(p.nbytes, p.chunk)
    return max(latency[k] * counts[(o, k)] + c * need for o, k, _, c in p.times) * (1 + 1e-9)


def _pair(
    src: int,
    dst: int,
    transfers: list[Transfer],
    links: LinkModel,
    members: Mapping[int, tuple[int, ...]],
    position: Mapping[int, tuple[tuple[int, ...], int]],
    key,
) -> _Pair:
    p = _Pair(src, dst, transfers)
    times: dict[tuple[int, int, int], float] = defaultdict(float)
    stages: dict[tuple[int, int, int], int] = defaultdict(int)
    messages: set[tuple[int, int, int, int, int]] = set()
    chunk = 0.0
    for m in members.get(dst, (dst,)):
        link, spb = links.link(src, m)
        ks, km = key(src, link), key(m, link)
        times[(0, ks, 0)] += spb
        times[(0, km, 1)] += spb
        stages[(0, src, 0)] += 1
        stages[(0, m, 1)] += 1
        messages.add((0, src, m, ks, km))
        p.send_cost += spb
        p.recv_cost = max(p.recv_cost, spb)
        chunk = max(chunk, MIN_CHUNK_LATENCIES * links.latency(link) / spb)
        run, i = position.get(m, ((m,), 0))
        w = len(run)
        for hop in range(1, w):
            a, b = run[(i + hop - 1) % w], run[(i + hop) % w]
            link, spb = links.link(a, b)
            ka, kb = key(a, link), key(b, link)
            times[(hop, ka, 0)] += spb
            times[(hop, kb, 1)] += spb
            stages[(hop, a, 0)] += 1
            stages[(hop, b, 1)] += 1
            messages.add((hop, a, b, ka, kb))
    own = {k for (o, k, d) in times if o == 0 and d == 0}
    # The sender's own keys first: ``blocked`` then mostly answers at the first test.
    p.times = sorted(
        ((o, k, d, c) for (o, k, d), c in times.items()), key=lambda e: (e[1] not in own, e)
    )
    p.stages = sorted(
        ((o, r, d, c) for (o, r, d), c in stages.items()), key=lambda e: (e[1] != src, e)
    )
    p.horizon = max(o for o, _, _, _ in p.times)
    p.messages = sorted(messages)
    p.chunk = chunk
    p.compile()
    return p
