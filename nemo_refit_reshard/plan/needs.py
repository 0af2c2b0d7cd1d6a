"""Pass 1, needs: what every inference replica group must receive, and who holds it.

Source pieces are grouped per canonical tensor into regions (a box and every training
rank storing exactly that box, ``plan/overlap.py``); each destination piece is cut by
the regions it overlaps, and each cut is a :class:`~.overlap.Need`. Inference ranks
holding identical layouts (the same slice of independent engines) form a *replica
group*: its needs are found once, for its first member, and the later passes decide how
the other members get the same bytes (``plan/fanout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..layouts.base import RankLayout
from ..spec.model import ModelSpec
from .overlap import Need, destination_needs, source_regions
from .transfer import DTYPE_BYTES


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
            total = self._group_bytes[rep] = sum(
                n.canonical_box.numel * DTYPE_BYTES[self.dtype_of[(rep, n.dst_piece.local)]]
                for n in self.by_group[rep]
            )
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

    Raises :class:`~.overlap.PlanError` naming the tensor and box when no training rank
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


__all__ = ["Need", "Needs", "find_needs", "replica_groups"]
