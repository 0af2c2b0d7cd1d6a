"""Replica choice: which source rank sends each needed region.

Greedy longest-processing-time assignment: regions in decreasing size go to
the least-loaded source rank that holds them. A region larger than the ideal
per-sender share ``total / senders`` is first cut along its outermost non-unit
dimension into up to ``len(holders)`` parts, so replicas share one large
tensor instead of one replica carrying it whole. Ties break on rank, so the
result is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..layouts.base import Box
from .overlap import Need

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class Transfer:
    """Copy ``canonical[canonical_box]`` from ``src``'s ``src_tensor[src_box]`` to
    ``dst``'s ``dst_tensor[dst_box]``, carried on the wire in the destination dtype."""

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

    @cached_property
    def nbytes(self) -> int:
        return self.canonical_box.numel * DTYPE_BYTES[self.dtype]


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


def assign_senders(needs: list[Need], dtype_of: dict[tuple[int, str], str]) -> list[Transfer]:
    """Turn needs into transfers, each with one sender, balancing sender bytes.

    ``dtype_of[(dst, local tensor)]`` is the destination dtype (the wire dtype).
    """
    senders = {h.rank for need in needs for h in need.region.holders}
    total = sum(
        need.numel * DTYPE_BYTES[dtype_of[(need.dst, need.dst_piece.local)]] for need in needs
    )
    share = max(1, total // max(1, len(senders)))
    items: list[tuple[int, int, Need, Box]] = []
    for index, need in enumerate(needs):
        nbytes = need.numel * DTYPE_BYTES[dtype_of[(need.dst, need.dst_piece.local)]]
        parts = 1
        if len(need.region.holders) > 1 and nbytes > share:
            parts = min(len(need.region.holders), -(-nbytes // share))
        for box in split_box(need.canonical_box, parts):
            items.append((box.numel * nbytes // max(1, need.numel), index, need, box))
    # Largest first; index keeps the order total for equal sizes.
    items.sort(key=lambda it: (-it[0], it[1], it[3].offsets))
    load = dict.fromkeys(sorted(senders), 0)
    out: list[Transfer] = []
    for nbytes, _, need, box in items:
        holder = min(need.region.holders, key=lambda h: (load[h.rank], h.rank))
        load[holder.rank] += nbytes
        out.append(
            Transfer(
                src=holder.rank,
                dst=need.dst,
                src_tensor=holder.piece.local,
                src_box=holder.piece.local_sub_box(box),
                dst_tensor=need.dst_piece.local,
                dst_box=need.dst_piece.local_sub_box(box),
                canonical=need.dst_piece.canonical,
                canonical_box=box,
                dtype=dtype_of[(need.dst, need.dst_piece.local)],
            )
        )
    return out


def max_load(transfers: list[Transfer]) -> int:
    load: dict[int, int] = {}
    for t in transfers:
        load[t.src] = load.get(t.src, 0) + t.nbytes
    return max(load.values(), default=0)
