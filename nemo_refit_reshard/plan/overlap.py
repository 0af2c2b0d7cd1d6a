"""Overlap of destination needs with source holdings.

For every destination piece (a canonical box a destination rank stores) we cut
it by the source regions of the same canonical tensor. A *source region* is a
canonical box together with every source rank that stores exactly that box
(its holders: DP/CP replicas, TP-replicated norms, the last stage's tied
embedding copy, ...). Each cut is a :class:`Need`: elements one destination rank
must receive, and the ranks that could send them.

Within one training framework the source boxes of a canonical tensor are
either identical or disjoint; a partial overlap would make "which replica"
ambiguous and is rejected with an error naming the tensor.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

from ..layouts.base import Box, Piece, RankLayout
from ..spec.model import ModelSpec


@dataclass(frozen=True)
class Holder:
    """Source rank ``rank`` stores a region in local tensor ``piece.local``."""

    rank: int
    piece: Piece


@dataclass(frozen=True)
class SourceRegion:
    box: Box
    holders: tuple[Holder, ...]


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


class PlanError(ValueError):
    """A refit plan cannot be built; the message says what is wrong and what to do."""

    @classmethod
    def listing(
        cls, header: str, problems: list[str], hint: str = "", limit: int = 20
    ) -> PlanError:
        """``header:`` then one indented line per problem (the first ``limit``, then a
        count of the rest), then ``hint``."""
        shown = "".join(f"\n  {p}" for p in problems[:limit])
        more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
        return cls(f"{header}:{shown}{more}" + (f"\n{hint}" if hint else ""))


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
    for name, boxes in by_box.items():
        regions = [SourceRegion(box, tuple(h)) for box, h in sorted(boxes.items())]
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
    for piece in destination.pieces():
        covered = 0
        for region in regions.get(piece.canonical, ()):
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
