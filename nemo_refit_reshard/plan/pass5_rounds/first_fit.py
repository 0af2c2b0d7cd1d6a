"""First-fit rounds (no topology, and ``relay="chain"``): what each rank stages per round.

Bucketing bounds what each rank stages per round: the bytes it sends and the
bytes it receives in a round each stay within ``bucket_bytes`` (a transfer
larger than that is cut first), so a rank's staging is at most twice the bucket.
Rounds are filled first-fit in a fixed order, so every rank computes the same
schedule. (Plans for a known topology without chains: ``timed.py``.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping

from ...layouts.base import Box
from ..base import Transfer, split_box
from ..cluster import LinkModel


def _lead_dim(box: Box) -> int | None:
    for d, s in enumerate(box.sizes):
        if s != 1:
            return d
    return None


def _cut(t: Transfer, max_bytes: int, bucket_bytes: int) -> list[Transfer]:
    """Cut a transfer into parts of at most ``max_bytes`` along the lead canonical dim.

    ``max_bytes`` may be below the bucket (what the slowest link moves in a round's time
    budget, when :func:`schedule` has ``links``); a single row larger
    than it stays whole, but a row larger than the bucket is an error."""
    if t.nbytes <= max_bytes:
        return [t]
    parts = -(-t.nbytes // max_bytes)
    lead = _lead_dim(t.canonical_box)
    if lead is None:
        return [t]
    rows = t.canonical_box.sizes[lead]
    if rows < parts:
        if -(-t.nbytes // rows) > bucket_bytes:
            raise ValueError(
                f"bucket of {bucket_bytes} bytes cannot hold one row of {t.canonical} "
                f"({t.nbytes // rows} bytes); raise bucket_mb"
            )
        parts = rows
    return [t.part(box) for box in split_box(t.canonical_box, parts)]


def _fan_out_groups(
    transfers: list[Transfer], cut_bytes: Callable[[Transfer], int], bucket_bytes: int
) -> list[list[Transfer]]:
    """Bucket-sized parts, grouped by the source box they read.

    Parts reading the same source box (one slice for several inference replicas) form
    a fan-out group that goes into one round whole: the replicas' messages then hold
    the same boxes in the same order, and the engine packs them once. The sender is
    still charged per message, so the bucket bound holds even when nothing is shared.
    Groups bound for the same receivers sit next to each other, so a round serves few
    receivers with large messages rather than every receiver with a small one.
    """
    by_box: dict[tuple, list[Transfer]] = {}
    for t in transfers:
        for p in _cut(t, cut_bytes(t), bucket_bytes):
            key = (p.src, p.src_tensor, p.src_box.offsets, p.src_box.sizes, p.dtype)
            group = by_box.get(key)
            if group is None:
                by_box[key] = [p]
            else:
                group.append(p)
    groups = list(by_box.values())
    for g in groups:
        if len(g) > 1:
            g.sort(key=lambda t: (t.dst, t.dst_tensor, t.dst_box.offsets))
    # Stable sort: groups with equal keys keep the (deterministic) order of ``transfers``.
    groups.sort(key=lambda g: (g[0].src, tuple(t.dst for t in g)))
    return groups


def _interleave(groups: list[list[Transfer]]) -> list[list[Transfer]]:
    """Take the senders' groups in turn, each sender starting at a different receiver.

    First-fit placement in sender order would give the first senders the early
    rounds and leave the last ones a tail of late rounds (their receivers' early
    rounds already full): rounds then run far below the busiest sender's link.
    Taking one group per sender in turn fills every round from every sender;
    rotating each sender's list by its index spreads their first receivers.
    """
    by_src: dict[int, list[list[Transfer]]] = defaultdict(list)
    for g in groups:
        by_src[g[0].src].append(g)
    queues = []
    for i, src in enumerate(sorted(by_src)):
        gs = by_src[src]
        k = i * len(gs) // len(by_src)
        queues.append(gs[k:] + gs[:k])
    out = []
    for depth in range(max((len(q) for q in queues), default=0)):
        out += [q[depth] for q in queues if depth < len(q)]
    return out


class FailedBefore:
    """Where a first-fit search may start (``schedule``). Rounds only fill up (loads and
    times grow, full marks stay), so a round that had no room for some demands on some
    keys never has room for as much or more on them again. Per set of keys it keeps the
    last search's earliest round, demands and the first round it did not find full: a
    part like the last one on the same keys (parts of one group, the next hop) resumes
    there instead of at its own earliest round."""

    def __init__(self) -> None:
        self._last: dict[tuple, tuple[int, tuple, int]] = {}

    def start(self, keys: tuple, demands: tuple, earliest: int) -> int:
        last = self._last.get(keys)
        if last is None or last[0] > earliest:
            return earliest
        # (demands compared key by key; the ``None`` between bytes and seconds is equal)
        if all(a is None or a >= b for a, b in zip(demands, last[1])):
            return max(earliest, last[2])
        return earliest

    def record(self, keys: tuple, demands: tuple, earliest: int, found: int) -> None:
        """Rounds from ``earliest`` up to ``found`` have no room for ``demands``."""
        self._last[keys] = (earliest, demands, found)


def schedule(
    transfers: list[Transfer],
    bucket_bytes: int,
    forwarded: list[list[Transfer]] | None = None,
    links: LinkModel | None = None,
    members: Mapping[int, tuple[int, ...]] | None = None,
) -> list[list[Transfer]]:
    """Rounds of transfers; per round each rank stages at most ``bucket_bytes``.

    ``forwarded[k]`` are relay hops at level ``k + 1``: each is placed at least one
    round after the part that delivered its source box to its sender.
    ``members[dst]`` lists the replicas a destination stands for: its sender sends
    (and stages) every transfer to it once per member. (Direct and ``relay="domain"``
    plans with a topology are scheduled by ``timed.py``.)

    With ``links`` every round also gets a time budget ``tau`` — the time to move a
    whole bucket over the fastest link — per (rank, link, direction), and parts are
    cut to what the slowest link moves in ``tau``. A round then carries a bucket over
    NVLink *and* a NIC's worth in the same time, instead of rounds that wait on one
    large NIC message while NVLink idles.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket size must be positive")
    members = members or {}
    copies = {dst: len(g) for dst, g in members.items()}
    # (src, dst) -> [(sender key, receiver key, seconds per byte)] over dst's replicas
    link_keys: dict[tuple[int, int], list[tuple[tuple, tuple, float]]] = {}

    def keys(src: int, dst: int) -> list[tuple[tuple, tuple, float]]:
        k = link_keys.get((src, dst))
        if k is None:
            assert links is not None
            k = []
            for d in members.get(dst, (dst,)):
                link, spb = links.link(src, d)
                k.append(((src, link, "out"), (d, link, "in"), spb))
            link_keys[(src, dst)] = k
        return k

    tau, cut_bytes = 0.0, bucket_bytes
    if links is not None:
        pairs = {(t.src, t.dst) for t in transfers}
        for level in forwarded or []:
            pairs |= {(t.src, t.dst) for t in level}
        speeds = {spb for src, dst in pairs for _, _, spb in keys(src, dst)}
        if speeds:
            tau = bucket_bytes * min(speeds)
            cut_bytes = max(1, int(tau / max(speeds)))
    timed: list[dict[tuple, float]] = []

    def seconds(t: Transfer) -> float:
        return sum(t.nbytes * spb for _, _, spb in keys(t.src, t.dst))

    # Staging per round, per rank and direction: sends and receives have separate
    # budgets, so a relay rank can receive one chunk while it forwards the previous one.
    used: list[dict[tuple[int, str], int]] = []
    placed: list[list[Transfer]] = []

    # Relay hops wait for the part that brings their box to their sender; each is placed
    # as soon as that part is, so hops of one box follow each other round after round
    # while the next boxes' first hops proceed: the chain pipelines.
    waiting: dict[tuple[int, str, Box], list[Transfer]] = defaultdict(list)
    for level in forwarded or []:
        for t in level:
            for part in _cut(t, cut_bytes, bucket_bytes):
                waiting[(part.src, part.src_tensor, part.src_box)].append(part)

    # First-fit would test every round from 0 for every part: quadratic at DeepSeek-V3
    # scale (1.4 million parts, 128 rounds). A round where a rank has at most ``slack``
    # bytes of room left in one direction is *full* for it, and ``skip[key][r]`` jumps
    # over full rounds (a "next free slot" forest with path compression), so the scan
    # only tests rounds where every rank of the part still has room. Parts that fit in
    # less than ``slack`` then go to later rounds, which costs at most 1/64 of a bucket.
    slack = min(cut_bytes, bucket_bytes // 64)
    skip: dict[tuple[int, str], dict[int, int]] = {}

    def next_open(jumps: dict[int, int], r: int) -> int:
        path = []
        while r in jumps:
            path.append(r)
            r = jumps[r]
        for p in path:
            jumps[p] = r
        return r

    failed = FailedBefore()

    def search(
        wanted: list[tuple[tuple[int, str], int]], timing: list[tuple[tuple, float]], earliest: int
    ) -> int:
        """First round from ``earliest`` with room for every (key, bytes) and time budget."""
        limit = tau * (1 + 1e-9)
        keys = (*(k for k, _ in wanted), None, *(k for k, _ in timing))
        demands = (*(b for _, b in wanted), None, *(x for _, x in timing))
        n = len(used)
        found = scan(failed.start(keys, demands, earliest), n, wanted, timing, limit)
        failed.record(keys, demands, earliest, found)
        return found if found < n else max(n, earliest)

    def scan(
        r: int,
        n: int,
        wanted: list[tuple[tuple[int, str], int]],
        timing: list[tuple[tuple, float]],
        limit: float,
    ) -> int:
        """The first round from ``r`` below ``n`` with room, or ``n``."""
        while r < n:
            jumped = False
            for k, _ in wanted:
                jumps = skip.get(k)
                if jumps is not None and r in jumps:
                    r, jumped = next_open(jumps, r), True
                    break
            if jumped:
                continue
            load = used[r]
            if all(load.get(k, 0) + b <= bucket_bytes for k, b in wanted):
                times = timed[r]
                if all(times.get(k, 0.0) + x <= limit for k, x in timing):
                    return r
            r += 1
        return n

    def open_round(r: int) -> None:
        while len(used) <= r:
            used.append({})
            placed.append([])
            timed.append({})

    def place_one(t: Transfer, earliest: int) -> int:
        """``place`` for a lone transfer without a time budget (most parts), spelled
        out for its two keys because it runs a million times at DeepSeek-V3 scale."""
        send_key, recv_key = (t.src, "send"), (t.dst, "recv")
        send = t.nbytes * copies.get(t.dst, 1)
        recv = t.nbytes
        send_skip, recv_skip = skip.setdefault(send_key, {}), skip.setdefault(recv_key, {})
        r, n = earliest, len(used)
        while r < n:
            if r in send_skip:
                r = next_open(send_skip, r)
            elif r in recv_skip:
                r = next_open(recv_skip, r)
            else:
                load = used[r]
                if (
                    load.get(send_key, 0) + send <= bucket_bytes
                    and load.get(recv_key, 0) + recv <= bucket_bytes
                ):
                    break
                r += 1
        else:
            r = max(n, earliest)
            open_round(r)
        load = used[r]
        load[send_key] = total = load.get(send_key, 0) + send
        if total > bucket_bytes - slack:
            send_skip[r] = r + 1
        load[recv_key] = total = load.get(recv_key, 0) + recv
        if total > bucket_bytes - slack:
            recv_skip[r] = r + 1
        placed[r].append(t)
        return r

    def place(piece: list[Transfer], earliest: int) -> None:
        if len(piece) == 1 and links is None:
            r = place_one(piece[0], earliest)
            t = piece[0]
            if waiting:
                for hop in waiting.pop((t.dst, t.dst_tensor, t.dst_box), []):
                    place([hop], r + 1)
            return
        demand: dict[tuple[int, str], int] = {}  # staging bytes per (rank, direction)
        for t in piece:
            k = (t.src, "send")
            demand[k] = demand.get(k, 0) + t.nbytes * copies.get(t.dst, 1)
            k = (t.dst, "recv")
            demand[k] = demand.get(k, 0) + t.nbytes
        wanted = list(demand.items())
        timing: list[tuple[tuple, float]] = []
        if links is not None:
            busy: dict[tuple, float] = defaultdict(float)
            for t in piece:
                for k_out, k_in, spb in keys(t.src, t.dst):
                    busy[k_out] += t.nbytes * spb
                    busy[k_in] += t.nbytes * spb
            timing = list(busy.items())
        r = search(wanted, timing, earliest)
        open_round(r)
        load, times = used[r], timed[r]
        for k, b in wanted:
            load[k] = total = load.get(k, 0) + b
            if total > bucket_bytes - slack:
                skip.setdefault(k, {})[r] = r + 1
        for k, x in timing:
            times[k] = times.get(k, 0.0) + x
        placed[r].extend(piece)
        for t in piece:
            for hop in waiting.pop((t.dst, t.dst_tensor, t.dst_box), []):
                place([hop], r + 1)

    def part_bytes(t: Transfer) -> int:
        """Largest part of ``t`` that fits one round: its sender stages it once per
        replica of the receiver, and with a topology its link time (summed over those
        replicas) must fit ``tau``. Relay hops must be cut exactly like the parts that
        feed them, so chains keep the one global size."""
        if forwarded:
            return cut_bytes
        limit = bucket_bytes // copies.get(t.dst, 1)
        if links is not None:
            limit = min(limit, int(tau / sum(spb for _, _, spb in keys(t.src, t.dst))))
        return max(1, limit)

    groups = _fan_out_groups(transfers, part_bytes, bucket_bytes)
    # Chains pipeline best when each sender's boxes go out in order (measured: taking
    # senders in turn slows qwen3-32b's chain plan by 30%), so only direct and domain
    # plans interleave their senders.
    for group in groups if forwarded else _interleave(groups):
        # A group too big to go whole is placed part by part.
        whole = sum(t.nbytes * copies.get(t.dst, 1) for t in group) <= bucket_bytes and (
            links is None or sum(seconds(t) for t in group) <= tau
        )
        pieces = [group] if whole else [[t] for t in group]
        for piece in pieces:
            place(piece, 0)
    if waiting:
        raise AssertionError(f"{len(waiting)} relay hops never received their data")
    return placed
