"""Pass 1, needs: what every inference replica group must receive, and who holds it.

Source pieces are grouped per canonical tensor into *source regions*: a canonical box
together with every training rank that stores exactly that box (its holders: DP/CP
replicas, TP-replicated norms, the last stage's tied embedding copy, ...). Each
destination piece is cut by the regions it overlaps, and each cut is a :class:`Need`:
elements one destination rank must receive, and the ranks that could send them.
Within one training framework the source boxes of a canonical tensor are either
identical or disjoint; a partial overlap would make "which replica" ambiguous and is
rejected with an error naming the tensor.

Inference ranks holding identical layouts (the same slice of independent engines) form
a *replica group*: its needs are found once, for its first member, and the later passes
decide how the other members get the same bytes (``pass2_fanout.py``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter, mul
from typing import NamedTuple

from ..layouts.base import Box, Piece, RankLayout
from ..spec.model import ModelSpec
from .base import DTYPE_BYTES, PlanError


@dataclass(frozen=True)
class Holder:
    """Source rank ``rank`` stores a region in local tensor ``piece.local``."""

    rank: int
    piece: Piece


@dataclass(frozen=True)
class SourceRegion:
    box: Box
    holders: tuple[Holder, ...]


_LOCAL, _NUMEL = attrgetter("dst_piece.local"), attrgetter("canonical_box.numel")  # of a Need


class Need(NamedTuple):
    """``canonical[canonical_box]`` must land on refit-group rank ``dst`` at ``dst_piece``.

    A named tuple: a DeepSeek-V3 plan makes 1.5 million of them."""

    dst: int
    dst_piece: Piece
    canonical_box: Box
    region: SourceRegion

    @property
    def numel(self) -> int:
        return self.canonical_box.numel


def source_regions(spec: ModelSpec, sources: list[RankLayout]) -> dict[str, list[SourceRegion]]:
    """Per canonical tensor, its distinct source boxes and their holders."""
    by_box: dict[str, dict[Box, list[Holder]]] = defaultdict(dict)
    for layout in sources:
        for piece in layout.pieces():
            if piece.canonical not in spec:
                raise PlanError(
                    f"source rank {layout.rank} holds {piece.canonical!r}, which the model "
                    f"spec {spec.name!r} does not have; build both sides from the same spec"
                )
            by_box[piece.canonical].setdefault(piece.canonical_box, []).append(
                Holder(layout.rank, piece)
            )
    out: dict[str, list[SourceRegion]] = {}
    shared: dict[Box, Box] = {}  # equal boxes as one object (``destination_needs``' cache)
    for name, boxes in by_box.items():
        regions = [
            SourceRegion(shared.setdefault(box, box), tuple(h)) for box, h in sorted(boxes.items())
        ]
        _check_disjoint(name, regions)
        out[name] = regions
    return out


def _check_disjoint(name: str, regions: list[SourceRegion]) -> None:
    # Regions are sorted by offsets; only neighbours in dim-0 order can overlap often,
    # but boxes may be cut on any dim, so compare all pairs for small lists.
    if len(regions) > 64:
        return  # large lists come from regular partitions (experts, vocab); skip the O(n²) check
    for i, a in enumerate(regions):
        for b in regions[i + 1 :]:
            if a.box.intersect(b.box) is not None:
                raise PlanError(
                    f"source pieces of {name!r} overlap without being identical "
                    f"({a.box} held by ranks {[h.rank for h in a.holders]}, {b.box} held by "
                    f"ranks {[h.rank for h in b.holders]}); the source layout is inconsistent"
                )


def destination_needs(
    destination: RankLayout, regions: dict[str, list[SourceRegion]], group_rank: int
) -> list[Need]:
    """Cut every piece of one destination rank (refit-group rank ``group_rank``) by the
    source regions it overlaps."""
    needs: list[Need] = []
    append = needs.append
    # (piece box, region box) -> whether the region holds the piece: the boxes are shared
    # objects (a layer's experts, ``source_regions``), so few pairs recur many times
    inside: dict[tuple[int, int], bool] = {}
    for piece in destination.pieces():
        held = regions.get(piece.canonical, ())
        if len(held) == 1:
            box, region = piece.canonical_box, held[0]
            pair = (id(box), id(region.box))
            whole = inside.get(pair)
            if whole is None:
                whole = inside[pair] = box.contained_in(region.box)
            if whole:
                # one region holds all of it (every expert slice): the whole piece, one need
                append(tuple.__new__(Need, (group_rank, piece, box, region)))
                continue
        covered = 0
        for region in held:
            common = piece.canonical_box.intersect(region.box)
            if common is None:
                continue
            needs.append(Need(group_rank, piece, common, region))
            covered += common.numel
        if covered != piece.canonical_box.numel:
            raise PlanError(
                f"destination rank {destination.rank} needs {piece.canonical}"
                f"{_fmt(piece.canonical_box)} (for {piece.local}) but the source ranks hold "
                f"only {covered} of its {piece.canonical_box.numel} elements; check that the "
                "training layout stores this tensor (e.g. MTP layers, pipeline stages)"
            )
    return needs


def _fmt(box: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(box.offsets, box.sizes)) + "]"


@dataclass(frozen=True)
class Needs:
    """Pass 1's result. Ranks are refit-group ranks (sources ``0..S-1``, then
    destinations)."""

    num_sources: int
    num_destinations: int
    groups: tuple[tuple[int, ...], ...]  # replica groups, first member first
    by_group: dict[int, list[Need]]  # first member -> what it needs
    dtype_of: dict[tuple[int, str], str]  # (destination, local tensor) -> wire dtype

    def of(self, member: int) -> list[Need]:
        """What ``member`` needs: its group's needs, addressed to it."""
        rep = self._group_of[member]
        needs = self.by_group[rep]
        return needs if rep == member else [Need(member, *n[1:]) for n in needs]

    def group_bytes(self, rep: int) -> int:
        """Bytes one member of ``rep``'s group receives."""
        total = self._group_bytes.get(rep)
        if total is None:
            needs = self.by_group[rep]
            sizes = map(_ItemSizes(self.dtype_of, rep).__getitem__, map(_LOCAL, needs))
            total = self._group_bytes[rep] = sum(map(mul, map(_NUMEL, needs), sizes))
        return total

    @cached_property
    def _group_bytes(self) -> dict[int, int]:
        return {}

    @cached_property
    def _group_of(self) -> dict[int, int]:
        return {m: g[0] for g in self.groups for m in g}

    def __str__(self) -> str:
        count = sum(len(ns) for ns in self.by_group.values())
        stored = sum(self.group_bytes(g[0]) for g in self.groups)
        every = sum(self.group_bytes(g[0]) * len(g) for g in self.groups)
        return (
            f"Needs: {self.num_sources} sources -> {self.num_destinations} destinations in "
            f"{len(self.groups)} replica group(s); {count:,} needs, {stored:,} bytes per "
            f"group set, {every:,} bytes to every destination"
        )


class _ItemSizes(dict[str, int]):
    """Destination ``rank``'s local tensor -> bytes per element of its wire dtype, each
    looked up once (``Needs.group_bytes`` reads it once per need, in C)."""

    def __init__(self, dtype_of: dict[tuple[int, str], str], rank: int) -> None:
        super().__init__()
        self.dtype_of, self.rank = dtype_of, rank

    def __missing__(self, local: str) -> int:
        size = self[local] = DTYPE_BYTES[self.dtype_of[(self.rank, local)]]
        return size


def replica_groups(destinations: list[RankLayout], offset: int) -> list[tuple[int, ...]]:
    """Destinations (as refit-group ranks) grouped by identical layout, first = smallest.

    A layout's ``replicas`` are the ranks its provider says hold identical pieces;
    a rank joins its first replica's group only if its tensors really are equal
    (cheap when the provider shares them, as replicas usually do).
    """
    groups: dict[int, list[int]] = {}
    for layout in destinations:
        first = min(layout.replicas)
        rep = destinations[first]
        same = layout.tensors is rep.tensors or layout.tensors == rep.tensors
        if first != layout.rank and same:
            groups[first].append(offset + layout.rank)
        else:
            groups[layout.rank] = [offset + layout.rank]
    return [tuple(g) for g in groups.values()]


def find_needs(spec: ModelSpec, sources: list[RankLayout], destinations: list[RankLayout]) -> Needs:
    """Pass 1: every replica group's needs, each with the training ranks that hold it.

    Raises :class:`~.base.PlanError` naming the tensor and box when no training rank
    holds a needed element, or when training boxes overlap without being equal."""
    regions = source_regions(spec, sources)
    s = len(sources)
    groups = replica_groups(destinations, s)
    return Needs(
        num_sources=s,
        num_destinations=len(destinations),
        groups=tuple(groups),
        by_group={g[0]: destination_needs(destinations[g[0] - s], regions, g[0]) for g in groups},
        dtype_of={(s + lay.rank, t.name): t.dtype for lay in destinations for t in lay.tensors},
    )


__all__ = [
    "Holder",
    "Need",
    "Needs",
    "SourceRegion",
    "destination_needs",
    "find_needs",
    "replica_groups",
    "source_regions",
]
