"""Replica choice: which source rank sends each needed region.

Greedy longest-processing-time assignment: regions in decreasing size go to
the least-loaded source rank that holds them. A region larger than the ideal
per-sender share ``total / senders`` is first cut along its outermost non-unit
dimension into up to ``len(holders)`` parts, so replicas share one large
tensor instead of one replica carrying it whole. Ties break on rank, so the
result is deterministic.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import NamedTuple, Protocol

from ..layouts.base import Box, map_sub_box
from .overlap import Holder, Need

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1}


class Transfer(NamedTuple):
    """Copy ``canonical[canonical_box]`` from ``src``'s ``src_tensor[src_box]`` to
    ``dst``'s ``dst_tensor[dst_box]``, carried on the wire in the destination dtype.

    A named tuple, not a dataclass: plans hold millions of them, and tuple creation
    and field access are several times cheaper."""

    src: int
    dst: int
    src_tensor: str
    src_box: Box
    dst_tensor: str
    dst_box: Box
    canonical: str
    canonical_box: Box
    dtype: str

    @property
    def numel(self) -> int:
        return self.canonical_box.numel

    @property
    def nbytes(self) -> int:
        return self.canonical_box.numel * DTYPE_BYTES[self.dtype]

    def part(self, box: Box) -> Transfer:
        """This transfer restricted to ``box``, a sub-box of its canonical box."""
        return Transfer(
            self.src,
            self.dst,
            self.src_tensor,
            map_sub_box(self.canonical_box, self.src_box, box),
            self.dst_tensor,
            map_sub_box(self.canonical_box, self.dst_box, box),
            self.canonical,
            box,
            self.dtype,
        )


def split_box(box: Box, parts: int) -> list[Box]:
    """Cut ``box`` into up to ``parts`` near-equal boxes along its first non-unit dim."""
    dims = [d for d, s in enumerate(box.sizes) if s > 1]
    if parts <= 1 or not dims:
        return [box]
    d = dims[0]
    n = box.sizes[d]
    parts = min(parts, n)
    out = []
    for k in range(parts):
        lo, hi = k * n // parts, (k + 1) * n // parts
        offsets = list(box.offsets)
        sizes = list(box.sizes)
        offsets[d] += lo
        sizes[d] = hi - lo
        out.append(Box(tuple(offsets), tuple(sizes)))
    return out


def cut_rows(t: Transfer, nbytes: float) -> tuple[Transfer, Transfer] | None:
    """``t`` cut after as many whole rows of its lead (first non-unit) dim as fit in
    ``nbytes``: (head, tail), or None if not even one row fits or ``t`` is one row."""
    box = t.canonical_box
    lead = next((d for d, n in enumerate(box.sizes) if n != 1), None)
    if lead is None:
        return None
    rows = box.sizes[lead]
    take = min(rows - 1, int(nbytes // (t.nbytes // rows)))
    if take < 1:
        return None
    head = list(box.sizes)
    head[lead] = take
    offsets, rest = list(box.offsets), list(box.sizes)
    offsets[lead] += take
    rest[lead] -= take
    return t.part(Box(box.offsets, tuple(head))), t.part(Box(tuple(offsets), tuple(rest)))


class LinkModel(Protocol):
    """What the balancer needs to know about the network (``plan/topology.py``)."""

    def link(self, src: int, dst: int) -> tuple[str, float]:
        """``(link id, seconds per byte)`` of the sender's side of ``src -> dst``
        (e.g. its NVLink port when ``dst`` is on the same node, else its NIC)."""
        ...

    def latency(self, link: str) -> float:
        """Seconds one message costs on a link of this id, whatever its size."""
        ...


def assign_senders(
    needs: list[Need],
    dtype_of: dict[tuple[int, str], str],
    links: LinkModel | None = None,
    members: Mapping[int, tuple[int, ...]] | None = None,
) -> list[Transfer]:
    """Turn needs into transfers, each with one sender, balancing the senders.

    ``dtype_of[(dst, local tensor)]`` is the destination dtype (the wire dtype).
    ``members[dst]`` lists the replicas ``dst`` stands for (itself first): the
    sender sends them the same transfer, so it is charged once per member.
    Without ``links`` the balancer minimises the largest number of bytes one
    sender sends. With ``links`` it minimises the largest predicted busy time of
    a sender's link — bytes × seconds-per-byte, per (sender, link) — so holders
    on the receiver's node (NVLink) are preferred and NIC load is spread.
    """
    members = members or {}

    def copies(dst: int) -> int:
        return len(members.get(dst, (dst,)))

    busy: dict[tuple[int, str], float] = defaultdict(float)  # (sender, link) -> busy seconds
    weights: dict[tuple[int, int], list[tuple[tuple[int, str], float]]] = {}

    def weight(rank: int, dst: int) -> list[tuple[tuple[int, str], float]]:
        """(sender link, cost per byte) of sending one byte to ``dst`` and its replicas."""
        w = weights.get((rank, dst))
        if w is None:
            acc: dict[tuple[int, str], float] = defaultdict(float)
            for d in members.get(dst, (dst,)):
                if links is None:
                    acc[(rank, "")] += 1.0
                else:
                    link, seconds_per_byte = links.link(rank, d)
                    acc[(rank, link)] += seconds_per_byte
            w = weights[(rank, dst)] = sorted(acc.items())
        return w

    out: list[Transfer] = []

    def emit(holder: Holder, need: Need, box: Box, nbytes: int) -> None:
        for k, c in weight(holder.rank, need.dst):
            busy[k] += nbytes * c
        src_piece, dst_piece = holder.piece, need.dst_piece
        out.append(
            Transfer(
                holder.rank,
                need.dst,
                src_piece.local,
                src_piece.local_sub_box(box),
                dst_piece.local,
                dst_piece.local_sub_box(box),
                dst_piece.canonical,
                box,
                dtype_of[(need.dst, dst_piece.local)],
            )
        )

    # Needs with one holder leave no choice: charge them first, so the greedy choice
    # for the others sees every fixed load (experts held by one EP rank are most of a
    # DeepSeek-V3 plan).
    senders = {h.rank for need in needs for h in need.region.holders}
    total = 0
    chosen: list[tuple[Need, int]] = []
    for need in needs:
        dst, dst_piece, box = need.dst, need.dst_piece, need.canonical_box
        dtype = dtype_of[(dst, dst_piece.local)]
        nbytes = box.numel * DTYPE_BYTES[dtype]
        total += nbytes * copies(dst)
        holders = need.region.holders
        if len(holders) > 1:
            chosen.append((need, nbytes))
            continue
        # ``emit`` inlined: this loop runs over every expert slice of the model.
        rank, src_piece = holders[0].rank, holders[0].piece
        for k, c in weight(rank, dst):
            busy[k] += nbytes * c
        out.append(
            Transfer(
                rank,
                dst,
                src_piece.local,
                map_sub_box(src_piece.canonical_box, src_piece.local_box, box),
                dst_piece.local,
                map_sub_box(dst_piece.canonical_box, dst_piece.local_box, box),
                dst_piece.canonical,
                box,
                dtype,
            )
        )
    share = max(1, total // max(1, len(senders)))
    items: list[tuple[int, int, Need, Box]] = []
    for index, (need, nbytes) in enumerate(chosen):
        wire = nbytes * copies(need.dst)
        parts = 1
        if wire > share:
            parts = min(len(need.region.holders), -(-wire // share))
        if parts == 1:
            items.append((nbytes, index, need, need.canonical_box))
            continue
        for box in split_box(need.canonical_box, parts):
            items.append((box.numel * nbytes // max(1, need.numel), index, need, box))
    # Largest first; index keeps the order total for equal sizes.
    items.sort(key=lambda it: (-it[0], it[1], it[3].offsets))
    for nbytes, _, need, box in items:
        best = None
        for h in need.region.holders:
            score = max(busy[k] + nbytes * c for k, c in weight(h.rank, need.dst))
            if best is None or (score, h.rank) < best[0]:
                best = ((score, h.rank), h)
        assert best is not None
        emit(best[1], need, box, nbytes)
    return out


def max_load(transfers: list[Transfer]) -> int:
    load: dict[int, int] = {}
    for t in transfers:
        load[t.src] = load.get(t.src, 0) + t.nbytes
    return max(load.values(), default=0)
