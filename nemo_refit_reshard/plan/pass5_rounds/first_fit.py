"""First-fit rounds (no topology, and ``relay="chain"``): what each rank stages per round.

Bucketing bounds what each rank stages per round: the bytes it sends and the
bytes it receives in a round each stay within ``bucket_bytes`` (a transfer
larger than that is cut first), so a rank's staging is at most twice the bucket.
Rounds are filled first-fit in a fixed order, so every rank computes the same
schedule. (Plans for a known topology without chains: ``timed.py``.)

:func:`schedule` cuts the transfers into parts and groups them (``first_fit_parts.py``),
holds relay hops back until what they forward arrives (:func:`_hold_relay_hops`), and
places each group whole or part by part (:func:`_place`): in the first round from its
earliest with room (:func:`_search`, :func:`_place_one`), then the hops it releases.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...layouts.base import Box
from ..base import Transfer
from ..cluster import LinkModel
from .first_fit_parts import cut, fan_out_groups, interleave


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


# A part's staging per (rank, "send" | "recv"), and its link time per (rank, link,
# direction), as (key, amount) lists.
Wanted = list[tuple[tuple[int, str], int]]
Timing = list[tuple[tuple, float]]


@dataclass(slots=True)
class _Schedule:
    """What the steps of one :func:`schedule` share."""

    bucket_bytes: int
    links: LinkModel | None
    members: Mapping[int, tuple[int, ...]]  # destination -> the replicas it stands for
    copies: dict[int, int]  # destination -> how many times its sender sends each part
    chained: bool  # relay hops given: chains pipeline (no interleaving, one part size)
    failed: FailedBefore
    # (src, dst) -> [(sender key, receiver key, seconds per byte)] over dst's replicas
    link_keys: dict[tuple[int, int], list[tuple[tuple, tuple, float]]] = field(default_factory=dict)
    tau: float = 0.0  # a round's time budget per (rank, link, direction); 0 without links
    cut_bytes: int = 0  # the part size every transfer is cut to (with links: tau's worth)
    slack: int = 0  # a rank with at most this much room left in a round counts it full
    # per round: staging per (rank, direction), link time per key, the parts placed
    used: list[dict[tuple[int, str], int]] = field(default_factory=list)
    timed: list[dict[tuple, float]] = field(default_factory=list)
    placed: list[list[Transfer]] = field(default_factory=list)
    # relay hops not placed yet, by the (rank, tensor, box) that must arrive first
    waiting: defaultdict[tuple[int, str, Box], list[Transfer]] = field(
        default_factory=lambda: defaultdict(list)
    )
    # per (rank, direction): full round -> a later round to try ("next free slot" forest)
    skip: dict[tuple[int, str], dict[int, int]] = field(default_factory=dict)


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
    st = _Schedule(bucket_bytes, links, members, copies, bool(forwarded), FailedBefore())
    _set_round_budget(st, transfers, forwarded or [])
    _hold_relay_hops(st, forwarded or [])
    # A round where a rank has at most ``slack`` bytes of room left in one direction is
    # full for it (``_place_one``): parts that fit in less then go to later rounds,
    # which costs at most 1/64 of a bucket.
    st.slack = min(st.cut_bytes, bucket_bytes // 64)
    groups = fan_out_groups(transfers, lambda t: _part_bytes(st, t), bucket_bytes)
    # Chains pipeline best when each sender's boxes go out in order (measured: taking
    # senders in turn slows qwen3-32b's chain plan by 30%), so only direct and domain
    # plans interleave their senders.
    for group in groups if st.chained else interleave(groups):
        for piece in _pieces(st, group):
            _place(st, piece, 0)
    if st.waiting:
        raise AssertionError(f"{len(st.waiting)} relay hops never received their data")
    return st.placed


def _keys(st: _Schedule, src: int, dst: int) -> list[tuple[tuple, tuple, float]]:
    """The links a transfer from ``src`` to ``dst`` uses, once per replica ``dst`` stands
    for: (sender key, receiver key, seconds per byte), cached per (src, dst)."""
    k = st.link_keys.get((src, dst))
    if k is None:
        assert st.links is not None
        k = []
        for d in st.members.get(dst, (dst,)):
            link, spb = st.links.link(src, d)
            k.append(((src, link, "out"), (d, link, "in"), spb))
        st.link_keys[(src, dst)] = k
    return k


def _set_round_budget(
    st: _Schedule, transfers: list[Transfer], forwarded: list[list[Transfer]]
) -> None:
    """The round's time budget ``tau`` and the part size ``cut_bytes``: without links, no
    time budget and parts of a bucket; with them, ``tau`` moves a whole bucket over the
    fastest link the plan uses, and a part is what its slowest link moves in ``tau``."""
    st.tau, st.cut_bytes = 0.0, st.bucket_bytes
    if st.links is None:
        return
    pairs = {(t.src, t.dst) for t in transfers}
    for level in forwarded:
        pairs |= {(t.src, t.dst) for t in level}
    speeds = {spb for src, dst in pairs for _, _, spb in _keys(st, src, dst)}
    if speeds:
        st.tau = st.bucket_bytes * min(speeds)
        st.cut_bytes = max(1, int(st.tau / max(speeds)))


def _hold_relay_hops(st: _Schedule, forwarded: list[list[Transfer]]) -> None:
    """Relay hops, cut to the one part size, wait for the part that brings their box to
    their sender; each is placed as soon as that part is (:func:`_release_hops`), so
    hops of one box follow each other round after round while the next boxes' first
    hops proceed: the chain pipelines."""
    for level in forwarded:
        for t in level:
            for part in cut(t, st.cut_bytes, st.bucket_bytes):
                st.waiting[(part.src, part.src_tensor, part.src_box)].append(part)


def _part_bytes(st: _Schedule, t: Transfer) -> int:
    """Largest part of ``t`` that fits one round: its sender stages it once per
    replica of the receiver, and with a topology its link time (summed over those
    replicas) must fit ``tau``. Relay hops must be cut exactly like the parts that
    feed them, so chains keep the one global size."""
    if st.chained:
        return st.cut_bytes
    limit = st.bucket_bytes // st.copies.get(t.dst, 1)
    if st.links is not None:
        limit = min(limit, int(st.tau / sum(spb for _, _, spb in _keys(st, t.src, t.dst))))
    return max(1, limit)


def _pieces(st: _Schedule, group: list[Transfer]) -> list[list[Transfer]]:
    """A fan-out group as it is placed: whole in one round if its sender's staging fits a
    bucket (and, with links, its link time fits ``tau``), else part by part."""
    copies = st.copies
    whole = sum(t.nbytes * copies.get(t.dst, 1) for t in group) <= st.bucket_bytes and (
        st.links is None or sum(_seconds(st, t) for t in group) <= st.tau
    )
    return [group] if whole else [[t] for t in group]


def _seconds(st: _Schedule, t: Transfer) -> float:
    """The link time of ``t``, summed over the replicas its receiver stands for."""
    return sum(t.nbytes * spb for _, _, spb in _keys(st, t.src, t.dst))


def _place(st: _Schedule, piece: list[Transfer], earliest: int) -> None:
    """Place ``piece`` whole in the first round from ``earliest`` with room for its
    staging (and link time), then the relay hops it releases one round later."""
    if len(piece) == 1 and st.links is None:
        r = _place_one(st, piece[0], earliest)
    else:
        wanted, timing = _staging(st, piece), _link_time(st, piece)
        r = _search(st, wanted, timing, earliest)
        _open_round(st, r)
        _load(st, r, wanted, timing)
        st.placed[r].extend(piece)
    _release_hops(st, piece, r)


def _release_hops(st: _Schedule, piece: list[Transfer], r: int) -> None:
    """The relay hops waiting for what ``piece`` delivers, each placed from round
    ``r + 1`` (a hop sends what arrived in an earlier round)."""
    if st.waiting:
        for t in piece:
            for hop in st.waiting.pop((t.dst, t.dst_tensor, t.dst_box), []):
                _place(st, [hop], r + 1)


def _staging(st: _Schedule, piece: list[Transfer]) -> Wanted:
    """What ``piece`` stages per (rank, direction): a sender stages a part once per
    replica of its receiver. Sends and receives have separate budgets, so a relay rank
    can receive one chunk while it forwards the previous one."""
    demand: dict[tuple[int, str], int] = {}
    for t in piece:
        k = (t.src, "send")
        demand[k] = demand.get(k, 0) + t.nbytes * st.copies.get(t.dst, 1)
        k = (t.dst, "recv")
        demand[k] = demand.get(k, 0) + t.nbytes
    return list(demand.items())


def _link_time(st: _Schedule, piece: list[Transfer]) -> Timing:
    """The seconds ``piece`` keeps each (rank, link, direction) busy; none without links."""
    if st.links is None:
        return []
    busy: dict[tuple, float] = defaultdict(float)
    for t in piece:
        for k_out, k_in, spb in _keys(st, t.src, t.dst):
            busy[k_out] += t.nbytes * spb
            busy[k_in] += t.nbytes * spb
    return list(busy.items())


def _load(st: _Schedule, r: int, wanted: Wanted, timing: Timing) -> None:
    """Add a piece's staging and link time to round ``r``, marking the round full for a
    key with at most ``slack`` bytes of room left (``skip``)."""
    load, times, full_above = st.used[r], st.timed[r], st.bucket_bytes - st.slack
    for k, b in wanted:
        load[k] = total = load.get(k, 0) + b
        if total > full_above:
            st.skip.setdefault(k, {})[r] = r + 1
    for k, x in timing:
        times[k] = times.get(k, 0.0) + x


def _open_round(st: _Schedule, r: int) -> None:
    """Rounds up to ``r`` exist (empty where new)."""
    while len(st.used) <= r:
        st.used.append({})
        st.placed.append([])
        st.timed.append({})


def _next_open(jumps: dict[int, int], r: int) -> int:
    """The first round from ``r`` not marked full in ``jumps``, compressing the path
    so the next search jumps there at once."""
    path = []
    while r in jumps:
        path.append(r)
        r = jumps[r]
    for p in path:
        jumps[p] = r
    return r


def _search(st: _Schedule, wanted: Wanted, timing: Timing, earliest: int) -> int:
    """First round from ``earliest`` with room for every (key, bytes) and time budget
    (a new round past the last if none): the scan starts where the last search on the
    same keys with no larger demands found no room (``FailedBefore``)."""
    limit = st.tau * (1 + 1e-9)
    keys = (*(k for k, _ in wanted), None, *(k for k, _ in timing))
    demands = (*(b for _, b in wanted), None, *(x for _, x in timing))
    n = len(st.used)
    found = _scan(st, st.failed.start(keys, demands, earliest), n, wanted, timing, limit)
    st.failed.record(keys, demands, earliest, found)
    return found if found < n else max(n, earliest)


def _scan(st: _Schedule, r: int, n: int, wanted: Wanted, timing: Timing, limit: float) -> int:
    """The first round from ``r`` below ``n`` with room, or ``n``. First-fit would test
    every round from 0 for every part: quadratic at DeepSeek-V3 scale (1.4 million
    parts, 128 rounds). ``skip`` jumps over rounds full for one of the part's keys, so
    the scan only tests rounds where every rank of the part still has room."""
    skip, used, timed, bucket_bytes = st.skip, st.used, st.timed, st.bucket_bytes
    while r < n:
        jumped = False
        for k, _ in wanted:
            jumps = skip.get(k)
            if jumps is not None and r in jumps:
                r, jumped = _next_open(jumps, r), True
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


def _place_one(st: _Schedule, t: Transfer, earliest: int) -> int:
    """:func:`_place` for a lone transfer without a time budget (most parts), spelled
    out for its two keys because it runs a million times at DeepSeek-V3 scale: its
    round."""
    bucket_bytes, used, skip = st.bucket_bytes, st.used, st.skip
    send_key, recv_key = (t.src, "send"), (t.dst, "recv")
    send = t.nbytes * st.copies.get(t.dst, 1)
    recv = t.nbytes
    send_skip, recv_skip = skip.setdefault(send_key, {}), skip.setdefault(recv_key, {})
    r, n = earliest, len(used)
    while r < n:
        if r in send_skip:
            r = _next_open(send_skip, r)
        elif r in recv_skip:
            r = _next_open(recv_skip, r)
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
        _open_round(st, r)
    full_above = bucket_bytes - st.slack
    load = used[r]
    load[send_key] = total = load.get(send_key, 0) + send
    if total > full_above:
        send_skip[r] = r + 1
    load[recv_key] = total = load.get(recv_key, 0) + recv
    if total > full_above:
        recv_skip[r] = r + 1
    st.placed[r].append(t)
    return r
