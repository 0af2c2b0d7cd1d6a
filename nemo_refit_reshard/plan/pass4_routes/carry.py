"""Carried transfers: data a rank passes on without storing it.

A training rank whose pipeline stage holds more than its NVLink neighbours (the
first stage with the embedding, the last with the head) would otherwise push all
of it through its own NIC. Instead it can hand part of it over NVLink to a
neighbour with NIC time to spare, which sends it on one round later. The
neighbour keeps those bytes in a *relay buffer* between the two rounds, not in a
live tensor, so a carried transfer becomes two legs:

* leg 1, round ``r``: ``src -> via``, into the relay buffer under the name
  ``base.relay_tensor(dst, dst_tensor)`` and the destination box;
* leg 2, round ``r + 1``: ``via -> dst``, from that relay buffer entry into the
  destination tensor, like any other transfer to ``dst`` (so replicas of ``dst``
  and relay runs receive it as usual, ``result/expand.py``).

The relay buffer holds two rounds' worth (what arrives in round ``r`` is sent in
round ``r + 1``), allocated by the engine (``engine/program.py``); it is never a
live tensor the frameworks hand over.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Mapping
from functools import reduce
from itertools import groupby
from operator import add, itemgetter, mul

from ..base import Transfer, cut_rows, sizes_of
from ..cluster import LinkModel, nvlink_domains

# A rank carries for a neighbour only to save more than this many message latencies.
LATENCIES_WORTH = 16
_PAIR = itemgetter(0, 1)  # a transfer's (sender, receiver)
_SRC = itemgetter(0)


def choose_carriers(
    transfers: list[Transfer],
    links: LinkModel,
    members: Mapping[int, tuple[int, ...]],
    num_sources: int,
    worth: float = 0.03,
) -> tuple[list[Transfer], list[tuple[Transfer, int]]]:
    """Which transfers training ranks hand to an NVLink neighbour, and to which one.

    Per training rank ``s`` and link ``L`` its busy seconds ``E(s, L)`` (bytes times
    seconds per byte, once per member of the receiver's group). Inside one NVLink
    domain (ranks whose mutual link is ``nvlink``) the target is the mean ``T_L``; a rank
    more than ``worth`` above it (below that, the extra round a carried leg adds costs
    about what it saves) hands its largest transfers over ``L`` to the domain's ranks
    furthest below it (cutting the last one at a row), until it is within ``worth`` of
    ``T_L`` or they are. The carrier's NVLink pays once more for the hop in, which at NVLink speed
    is a small fraction of the NIC time it saves. Deterministic: ranks, transfers and
    carriers are taken in fixed orders.

    Returns the transfers still sent directly and the carried ``(transfer, via)``.
    """
    cost: dict[tuple[int, int], dict[str, float]] = {}  # (src, dst) -> link -> s/byte

    def spb(src: int, dst: int) -> dict[str, float]:
        c = cost.get((src, dst))
        if c is None:
            c = cost[(src, dst)] = {}
            for m in members.get(dst, (dst,)):
                link, x = links.link(src, m)
                c[link] = c.get(link, 0.0) + x
        return c

    sizes = list(sizes_of(transfers))
    by_src: dict[int, list[int]] = defaultdict(list)
    for i, src in enumerate(map(_SRC, transfers)):
        by_src[src].append(i)
    # Each (rank, link)'s busy seconds, summed in transfer order, one product per
    # transfer of the rank (0.0 on links it does not cross, which changes no sum).
    busy: dict[tuple[int, str], float] = defaultdict(float)
    for src, ids in by_src.items():
        if src >= num_sources:
            continue
        dsts = [transfers[i].dst for i in ids]
        nbytes = [sizes[i] for i in ids]
        per_dst = {d: spb(src, d) for d in dict.fromkeys(dsts)}
        for link in dict.fromkeys(lk for c in per_dst.values() for lk in c):
            cost = {d: c.get(link, 0.0) for d, c in per_dst.items()}
            busy[(src, link)] = reduce(add, map(mul, nbytes, map(cost.__getitem__, dsts)), 0.0)
    domains = nvlink_domains(list(range(num_sources)), links)
    record = _Moves()
    for domain in domains:
        if len(domain) < 2:
            continue
        for link in sorted({lk for (r, lk) in busy if r in domain} - {"nvlink"}):
            target = sum(busy[(r, link)] for r in domain) / len(domain)
            if target <= 0:
                continue
            room = _Carriers({r: target - busy[(r, link)] for r in domain})
            # Worth it only above ``worth`` of the target and above a few message
            # latencies (each carried piece costs two messages instead of one).
            floor = max(target * worth, LATENCIES_WORTH * links.latency(link))
            heavy = sorted(
                (r for r in domain if busy[(r, link)] > target + floor),
                key=lambda r: (-busy[(r, link)], r),
            )
            for s in heavy:
                excess = busy[(s, link)] - target
                order = sorted(
                    (
                        i
                        for i in by_src[s]
                        if i not in record.moved and link in spb(s, transfers[i].dst)
                    ),
                    key=lambda i: (-sizes[i], transfers[i].dst, i),
                )
                for i in order:
                    if excess <= floor:
                        break  # (``_hand_over`` would hand over nothing more)
                    per_byte = spb(s, transfers[i].dst)[link]
                    moved, rest, excess = _hand_over(transfers[i], per_byte, excess, floor, room)
                    record.add(i, moved, rest)
                room.release()
    return record.result(transfers)


def choose_ingress_carriers(
    transfers: list[Transfer],
    links: LinkModel,
    members: Mapping[int, tuple[int, ...]],
    runs: list[tuple[int, ...]],
    lone: list[int],
    carried_before: list[tuple[Transfer, int]] = (),  # type: ignore[assignment]
    worth: float = 0.03,
) -> tuple[list[Transfer], list[tuple[Transfer, int]]]:
    """Which transfers to a lone inference rank a domain neighbour carries, and which one.

    ``lone``: inference ranks planned as their own group (``domain.split_lone_members``),
    so what is stored for them reaches only them. Per inference rank its NIC ingress
    seconds ``I`` (direct deliveries and relay run hops over a NIC). In each NVLink domain
    with mean ``M`` (or, if higher, the busiest NIC nothing here relieves: a training
    rank's, a non-lone inference rank's), a lone rank above ``M`` by more than ``worth``
    has its largest
    incoming transfers sent instead to the domain's ranks furthest below ``M`` (cutting
    the last at a row), into their relay buffers; they pass them on over NVLink one round
    later. ``carried_before``: transfers training ranks already carry for each other
    (their second leg counts here; they are not carried twice). Returns the transfers
    still direct and the newly carried ``(transfer, via)``.
    """
    position = {m: (run, i) for run in runs for i, m in enumerate(run)}
    busy: dict[int, float] = defaultdict(float)  # inference rank -> NIC ingress seconds

    cache: dict[tuple[int, int], list[tuple[int, float]]] = {}

    def nic_in(src: int, dst: int) -> list[tuple[int, float]]:
        """(rank, seconds per byte) of every NIC a byte from ``src`` to ``dst`` enters."""
        out = cache.get((src, dst))
        if out is not None:
            return out
        out = cache[(src, dst)] = []
        for m in members.get(dst, (dst,)):
            link, x = links.link(src, m)
            if link != "nvlink":
                out.append((m, x))
            run, i = position.get(m, ((m,), 0))
            for k in range(1, len(run)):
                a, b = run[(i + k - 1) % len(run)], run[(i + k) % len(run)]
                link, x = links.link(a, b)
                if link != "nvlink":
                    out.append((b, x))
        return out

    pair_bytes: dict[tuple[int, int], int] = defaultdict(int)
    for (src, dst), ts in groupby(transfers, key=_PAIR):
        pair_bytes[(src, dst)] += sum(sizes_of(list(ts)))
    for t, via in carried_before:
        pair_bytes[(via, t.dst)] += t.nbytes
    for (src, dst), nbytes in pair_bytes.items():
        for m, x in nic_in(src, dst):
            busy[m] += nbytes * x
    lone_set = set(lone)
    ranks = sorted(set(busy) | lone_set)
    domains = nvlink_domains(ranks, links)
    # Relieving a lone rank only helps down to what nothing here can relieve: the other
    # inference ranks' NICs, lone ranks with no neighbour, the training ranks' NICs.
    out: dict[int, float] = defaultdict(float)
    for (src, dst), nbytes in pair_bytes.items():
        for m in members.get(dst, (dst,)):
            link, x = links.link(src, m)
            if link != "nvlink":
                out[src] += nbytes * x
    fixed = max(
        [busy[r] for d in domains for r in d if r not in lone_set or len(d) < 2]
        + list(out.values()),
        default=0.0,
    )

    def via_cost(t: Transfer, via: int) -> float:
        return links.link(t.src, via)[1]

    by_dst: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(transfers):
        if t.dst in lone_set:
            by_dst[t.dst].append(i)
    sizes = {i: transfers[i].nbytes for ids in by_dst.values() for i in ids}
    record = _Moves()
    for domain in domains:
        heavy_here = [y for y in domain if y in lone_set]
        if not heavy_here or len(domain) < 2:
            continue
        mean = max(fixed, sum(busy[r] for r in domain) / len(domain))
        floor = max(mean * worth, LATENCIES_WORTH * links.latency("nic"))
        room = _Carriers({r: mean - busy[r] for r in domain if r not in lone_set})
        for y in sorted(heavy_here, key=lambda r: (-busy[r], r)):
            excess = busy[y] - mean
            order = sorted(by_dst[y], key=lambda i: (-sizes[i], transfers[i].src, i))
            for i in order:
                if excess <= floor:
                    break  # (``_hand_over`` would hand over nothing more)
                link, per_byte = links.link(transfers[i].src, y)
                if link == "nvlink":
                    continue
                before = excess
                moved, rest, excess = _hand_over(
                    transfers[i], per_byte, excess, floor, room, via_cost
                )
                busy[y] -= before - excess
                record.add(i, moved, rest)
            room.release()
    return record.result(transfers)


class _Moves:
    """What the carrier choice decided: transfers carried (whole or in part), by index."""

    def __init__(self) -> None:
        self.moved: set[int] = set()
        self.rest: dict[int, Transfer] = {}  # what of a cut transfer stays direct
        self.carried: list[tuple[Transfer, int]] = []

    def add(self, i: int, moved: list[tuple[Transfer, int]], rest: Transfer | None) -> None:
        if moved:
            self.moved.add(i)
            self.carried += moved
            if rest is not None:
                self.rest[i] = rest

    def result(
        self, transfers: list[Transfer]
    ) -> tuple[list[Transfer], list[tuple[Transfer, int]]]:
        """(the transfers still direct, the carried ``(transfer, via)``)."""
        if not self.moved:
            return list(transfers), self.carried
        direct = [
            self.rest.get(i, t)
            for i, t in enumerate(transfers)
            if i not in self.moved or i in self.rest
        ]
        return direct, self.carried


class _Carriers:
    """Ranks with spare seconds, most spare first. The one taken stays in use until it
    is full or released, so a busy rank's bytes go to few carriers: few pairs, few
    messages."""

    def __init__(self, spare: Mapping[int, float]) -> None:
        self.heap = [(-x, r) for r, x in spare.items() if x > 0]
        heapq.heapify(self.heap)
        self.active: list[float | int] | None = None  # [spare, rank]

    def take(self) -> tuple[int, float] | None:
        if self.active is None:
            if not self.heap:
                return None
            x, r = heapq.heappop(self.heap)
            self.active = [-x, r]
        return int(self.active[1]), float(self.active[0])

    def use(self, seconds: float) -> None:
        assert self.active is not None
        self.active[0] -= seconds
        if self.active[0] <= 0:
            self.active = None

    def release(self) -> None:
        if self.active is not None:
            heapq.heappush(self.heap, (-self.active[0], int(self.active[1])))
            self.active = None


def _hand_over(
    t: Transfer,
    per_byte: float,
    excess: float,
    floor: float,
    room: _Carriers,
    carrier_per_byte: Callable[[Transfer, int], float] | None = None,
) -> tuple[list[tuple[Transfer, int]], Transfer | None, float]:
    """Hand parts of ``t`` (``per_byte`` seconds a byte on the busy link) to carriers
    while ``excess`` stays above ``floor``; a carrier's spare shrinks by
    ``carrier_per_byte(part, via)`` a byte. Returns the parts with their carriers, what
    stays direct (None if nothing) and the excess left."""
    moved: list[tuple[Transfer, int]] = []
    rest: Transfer | None = t
    while rest is not None and excess > floor and (pick := room.take()):
        via, spare = pick
        part, rest = _part(rest, min(excess, spare) / per_byte)
        if part is None:
            room.release()
            break
        moved.append((part, via))
        excess -= part.nbytes * per_byte
        cost = per_byte if carrier_per_byte is None else carrier_per_byte(part, via)
        room.use(part.nbytes * cost)
    return moved, rest, excess


def _part(t: Transfer, nbytes: float) -> tuple[Transfer | None, Transfer | None]:
    """(what of ``t`` fits in ``nbytes``, the rest): ``t`` whole, or cut after whole rows
    (``(None, t)`` if not one row fits)."""
    if t.nbytes <= nbytes:
        return t, None
    parts = cut_rows(t, nbytes)
    return (None, t) if parts is None else parts
