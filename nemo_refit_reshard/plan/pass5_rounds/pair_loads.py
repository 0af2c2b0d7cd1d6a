"""What a topology-aware schedule prices: pairs and their per-byte effects, and the
per-round load of every (GPU, link) and (rank, direction) (``fill.py`` fills them).

Keys: a time key is a (rank, link) with a latency; ``2 * key + direction`` indexes a
round's busy seconds (direction 0 out, 1 in) and the key's message count is shared by
both directions, as in ``cluster.round_time``. A staging key ``2 * rank + direction``
indexes a round's staged bytes (0 send, 1 receive).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from ..base import Transfer, sizes_of
from ..cluster import LinkModel

# A round where a key has less than this fraction of its budget left (or less than a
# worthwhile chunk's time) counts as full for it: pairs skip it without pricing it.
FULL = 1 / 64
# A pair does not open a message for fewer bytes than take this many latencies to move
# (unless that is all it has left): a sliver of a round costs more than it carries.
MIN_CHUNK_LATENCIES = 4
# ``RoundLoads.short``'s margin: a key counts as too short only if the ask exceeds its
# room by more than rounding could account for
_SHORT = 1 - 1e-9


class Pair:
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
        "ends",
        "head",
        "head_taken",
        "rest",
        "cut",
        "now_time",
        "now_staging",
        "now_messages",
        "later_time",
        "later_staging",
        "later_messages",
        "gate",
        "sgate",
        "chunk",
        "send_cost",
        "recv",
        "rkey",
        "horizon",
        "gate_mask",
        "sgate_mask",
        "later_masks",
        "rank_in",
        "stamp",
        "receiver_set",
        "later_time_codes",
        "capacity_terms",
    )

    def __init__(self, src: int, dst: int, via: int, transfers: list[Transfer]) -> None:
        self.src, self.dst = src, dst
        self.via = via  # the rank that carries it (``pass4_routes/carry.py``), or -1
        self.transfers = transfers
        self.nbytes = sum(sizes_of(transfers))
        self.left = float(self.nbytes)  # bytes not yet placed
        # Its transfers in the order a fill takes them (``fill.queue_transfers``),
        # ``head`` the next one, of which ``head_taken`` bytes already went, cut at rows:
        # what is left of it is ``cut`` (a transfer) where the fill builds transfers,
        # else ``rest`` (its sizes); ``ends[i]`` the bytes of the first ``i`` of them.
        self.queue: list[Transfer] = []
        self.ends: list[int] = [0]
        self.head = 0
        self.head_taken = 0
        self.rest: tuple[int, ...] | None = None
        self.cut: Transfer | None = None
        # In the round the pair is placed in: (time index, key, seconds per byte, this
        # pair's messages on the key), (staging index, bytes per byte), and its
        # messages (code of (src, dst), src key, dst key). A pair is placed at most once
        # per round, so these messages are always new there.
        self.now_time: list[tuple[int, int, float, int]] = []
        self.now_staging: list[tuple[int, int]] = []
        self.now_messages: list[tuple[int, int, int]] = []
        # Relay hops and carried second legs, ``offset`` rounds later, summed per key:
        # (offset, time index, key, seconds per byte), (offset, staging index, bytes per
        # byte), and their messages (offset, code of (src, dst), src key, dst key).
        self.later_time: list[tuple[int, int, int, float]] = []
        self.later_staging: list[tuple[int, int, int]] = []
        self.later_messages: list[tuple[int, int, int, int]] = []
        self.gate: list[int] = []  # receivers' time indices: a full one blocks the pair
        self.sgate: list[int] = []  # receivers' staging indices
        self.chunk = 0.0  # smallest worthwhile message, bytes
        self.send_cost = 0.0  # sender link seconds per byte
        self.recv: list[tuple[int, float]] = []  # (members' time index, seconds per byte)
        self.rkey: tuple[int, ...] = ()  # those indices
        self.horizon = 0  # largest round offset of a hop
        # ``gate``, ``sgate`` and the later hops' indices as bit masks (``blocked``):
        # (offset, time mask, staging mask) per later round
        self.gate_mask = 0
        self.sgate_mask = 0
        self.later_masks: list[tuple[int, int, int]] = []
        self.rank_in = 0  # position in its sender's rotated order (ties in ``fill.py``)
        self.stamp = -1  # the fill's marker of the pairs a sender served last round
        self.receiver_set = -1  # the fill's number of its receiver set (``rkey``)
        self.later_time_codes: list[
            list[int]
        ] = []  # per ``later_time`` entry: codes of ``later_messages`` on its key
        # ``RoundLoads.capacity``'s terms, which no budget changes: (latency seconds,
        # seconds per byte) per time index, bytes per byte per staging index
        self.capacity_terms: tuple[list[tuple[float, float]], list[int]] | None = None

    def clone(self) -> Pair:
        """A pair with the same transfers and effects, for a fill that runs beside
        another one (a fill keeps its progress on the pairs)."""
        pair = Pair.__new__(Pair)
        for name in Pair.__slots__:
            setattr(pair, name, getattr(self, name))
        return pair


class RoundLoads:
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
        # [round] bit ``i`` set: time / staging index ``i`` has no room left (bit masks:
        # a pair's test against all of its receivers is one ``&``)
        self.full_time: list[int] = []
        self.full_stage: list[int] = []
        self.sent: set[int] = set()  # codes of (round, src, dst) with a message
        # A time key is full below this many seconds left (``FULL`` of the budget, or a
        # worthwhile chunk's latencies), a staging index below this many bytes.
        self.full_at = [max(FULL * tau, MIN_CHUNK_LATENCIES * lat) for lat in latency]
        self.stage_full_at = FULL * bucket

    def open(self, r: int) -> None:
        while len(self.busy) <= r:
            self.busy.append([0.0] * (2 * self.num_keys))
            self.count.append([0] * self.num_keys)
            self.staged.append([0] * (2 * self.num_ranks))
            self.full_time.append(0)
            self.full_stage.append(0)

    def blocked(self, p: Pair, r: int) -> bool:
        """Whether a receiving key of ``p`` has no room left in round ``r`` (a cheap
        test before :meth:`room`; the fill tests the sender's own keys itself)."""
        if p.gate_mask & self.full_time[r] or p.sgate_mask & self.full_stage[r]:
            return True
        ft, fs = self.full_time, self.full_stage
        for o, tmask, smask in p.later_masks:
            if tmask & ft[r + o] or smask & fs[r + o]:
                return True
        return False

    def room(self, p: Pair, r: int, need: float = 0.0) -> float:
        """Bytes of ``p`` that round ``r`` can still take (rounds up to ``r + horizon``
        must be open); where that is less than ``need``, possibly less still (the first
        key found short decides: the pair does not go in this round either way)."""
        tau, lat, bucket = self.tau, self.latency, self.bucket
        busy, count = self.busy[r], self.count[r]
        x = math.inf
        for idx, k, c, n in p.now_time:
            # A new message's latency counts on both directions of its link.
            spare = tau - lat[k] * (count[k] + n)
            left = spare - busy[idx]
            if left <= 0 or (n and spare <= busy[idx ^ 1]):
                return 0.0
            if left < x * c:
                x = left / c
        staged = self.staged[r]
        for idx, c in p.now_staging:
            left = bucket - staged[idx]
            if left <= 0:
                return 0.0
            if left < x * c:
                x = left / c
        if x < need:
            return x
        if p.later_time:
            sent, codes = self.sent, self.codes
            for (o, idx, k, c), on_key in zip(p.later_time, p.later_time_codes):
                rr = r + o
                base = rr * codes
                n = 0  # messages on key k in round rr that this pair would open
                for code in on_key:
                    if base + code not in sent:
                        n += 1
                spare = tau - lat[k] * (self.count[rr][k] + n)
                left = spare - self.busy[rr][idx]
                if left <= 0 or (n and spare <= self.busy[rr][idx ^ 1]):
                    return 0.0
                if left < x * c:
                    x = left / c
                    if x < need:
                        return x
            for o, idx, c in p.later_staging:
                left = bucket - self.staged[r + o][idx]
                if left <= 0:
                    return 0.0
                if left < x * c:
                    x = left / c
        return x

    def short(self, terms: Sequence[tuple[int, int, float, int]], r: int, least: float) -> bool:
        """Whether round ``r`` leaves less than ``least`` bytes on one of ``terms``
        (``now_time`` entries), counted as :meth:`room` counts them: then ``room`` is below the
        ask of every pair with these terms that asks for ``least`` or more. A margin
        keeps rounding from claiming a pair that ``room`` would take."""
        tau, lat = self.tau, self.latency
        busy, count = self.busy[r], self.count[r]
        for idx, k, c, n in terms:
            spare = tau - lat[k] * (count[k] + n)
            left = spare - busy[idx]
            if left <= 0 or (n and spare <= busy[idx ^ 1]) or left / c < least * _SHORT:
                return True
        return False

    def capacity(self, p: Pair) -> float:
        """Bytes of ``p`` a round with nothing else in it takes."""
        terms = capacity_terms(p, self.latency)
        tau, bucket = self.tau, self.bucket
        x = math.inf
        for wait, c in terms[0]:
            x = min(x, (tau - wait) / c)
        for c in terms[1]:
            x = min(x, bucket / c)
        return x

    def add(self, p: Pair, r: int, nbytes: float) -> None:
        tau, lat, full_at, stage_full_at = self.tau, self.latency, self.full_at, self.stage_full_at
        sent, codes = self.sent, self.codes
        count, busy, full = self.count[r], self.busy[r], self.full_time[r]
        base = r * codes
        for code, ka, kb in p.now_messages:
            sent.add(base + code)
            count[ka] += 1
            count[kb] += 1
        for idx, k, c, _ in p.now_time:
            b = busy[idx] = busy[idx] + nbytes * c
            if tau - b - lat[k] * count[k] < full_at[k]:
                full |= 1 << idx
        self.full_time[r] = full
        staged, sfull = self.staged[r], self.full_stage[r]
        ceil = math.ceil
        for idx, c in p.now_staging:
            b = staged[idx] = staged[idx] + ceil(nbytes * c)
            if self.bucket - b < stage_full_at:
                sfull |= 1 << idx
        self.full_stage[r] = sfull
        for o, code, ka, kb in p.later_messages:
            key = (r + o) * codes + code
            if key not in sent:
                sent.add(key)
                row = self.count[r + o]
                row[ka] += 1
                row[kb] += 1
        for o, idx, k, c in p.later_time:
            rr = r + o
            row = self.busy[rr]
            b = row[idx] = row[idx] + nbytes * c
            if tau - b - lat[k] * self.count[rr][k] < full_at[k]:
                self.full_time[rr] |= 1 << idx
        for o, idx, c in p.later_staging:
            row = self.staged[r + o]
            b = row[idx] = row[idx] + ceil(nbytes * c)
            if self.bucket - b < stage_full_at:
                self.full_stage[r + o] |= 1 << idx

    def round_seconds(self, r: int) -> float:
        """Round ``r``'s slowest key's time (``cluster.round_time``)."""
        busy, count = self.busy[r], self.count[r]
        worst = 0.0
        for k, lat in enumerate(self.latency):
            t = max(busy[2 * k], busy[2 * k + 1]) + lat * count[k]
            if t > worst:
                worst = t
        return worst

    def seconds(self) -> float:
        """Sum over rounds of the slowest key's time (``cluster.round_time``)."""
        total = 0.0
        for r in range(len(self.busy)):
            total += self.round_seconds(r)
        return total


class TooSmall(Exception):
    """An empty round cannot take a worthwhile chunk (the round budget is below latency),
    or a pair's next row (``fill.py``)."""


def capacity_terms(p: Pair, latency: list[float]) -> tuple[list[tuple[float, float]], list[int]]:
    """``p.capacity_terms``, computed on first use (every price fill asks for them)."""
    terms = p.capacity_terms
    if terms is None:
        later: dict[tuple[int, int], int] = defaultdict(int)
        for o, _, ka, kb in p.later_messages:
            later[(o, ka)] += 1
            later[(o, kb)] += 1
        times = [(latency[k] * n, c) for _, k, c, n in p.now_time]
        times += [(latency[k] * later[(o, k)], c) for o, _, k, c in p.later_time]
        terms = p.capacity_terms = (
            times,
            [c for _, c in p.now_staging] + [c for _, _, c in p.later_staging],
        )
    return terms


def least_budget(p: Pair, latency: list[float]) -> float:
    """Smallest round budget in which an empty round takes ``min(bytes, chunk)`` of
    ``p`` (``RoundLoads.capacity`` at least that)."""
    need = min(p.nbytes, p.chunk)
    return max(wait + c * need for wait, c in capacity_terms(p, latency)[0]) * (1 + 1e-9)


def build_pair(
    src: int,
    dst: int,
    via: int,
    transfers: list[Transfer],
    links: LinkModel,
    members: Mapping[int, tuple[int, ...]],
    position: Mapping[int, tuple[tuple[int, ...], int]],
    key: Callable[[int, str], int],
    num_ranks: int,
) -> Pair:
    """A pair and its effects: the sender's link once per member of ``dst``'s group,
    each member's link, and for a member in a relay run, every hop of the run. A
    carried pair (``via >= 0``) loads ``src -> via`` in its round and sends on from
    ``via`` one round later."""
    p = Pair(src, dst, via, transfers)
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
    p.later_time = [(o, idx, idx // 2, c) for (o, idx), c in sorted(later_t.items())]
    p.later_staging = [(o, idx, c) for (o, idx), c in sorted(later_s.items())]
    p.later_messages = [(o, code, ka, kb) for (o, code), (ka, kb) in sorted(later_m.items())]
    on_key: dict[tuple[int, int], list[int]] = defaultdict(list)
    for o, code, ka, kb in p.later_messages:
        on_key[(o, ka)].append(code)
        on_key[(o, kb)].append(code)
    p.later_time_codes = [on_key.get((o, k), []) for o, _, k, _ in p.later_time]
    p.now_time = [(idx, idx // 2, c, msgs[idx // 2]) for idx, c in sorted(times.items())]
    p.recv = [(idx, times[idx]) for idx in p.gate]
    p.rkey = tuple(idx for idx, _ in p.recv)
    p.now_staging = sorted(stages.items())
    p.now_messages = m0
    p.gate_mask = sum(1 << idx for idx in set(p.gate))
    p.sgate_mask = sum(1 << idx for idx in set(p.sgate))
    later: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for o, idx, _, _ in p.later_time:
        later[o][0] |= 1 << idx
    for o, idx, _ in p.later_staging:
        later[o][1] |= 1 << idx
    p.later_masks = [(o, t, m) for o, (t, m) in sorted(later.items())]
    return p
