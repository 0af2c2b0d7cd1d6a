"""Structural checks of layouts, usable without any framework installed.

``check_rank_layout`` proves, box by box, that a rank's pieces and declared padding
tile every local tensor exactly once and that every canonical box lies inside
its canonical tensor. ``canonical_coverage`` counts, per canonical tensor, how
many elements a whole world of ranks holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import combinations

from ..spec.model import ModelSpec
from .base import Box, RankLayout


def _overlap(a: Box, b: Box) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


def check_rank_layout(layout: RankLayout, spec: ModelSpec) -> None:
    """Raise ``AssertionError`` unless pieces + padding tile each local tensor exactly once."""
    where = f"{layout.framework} rank {layout.rank}"
    for t in layout.tensors:
        boxes = [p.local_box for p in t.pieces] + list(t.padding)
        for box in boxes:
            if not box.fits_in(t.shape):
                raise AssertionError(f"{where}: {t.name}{list(t.shape)} box {box} out of bounds")
        total = sum(box.numel for box in boxes)
        if total != t.numel:
            raise AssertionError(
                f"{where}: {t.name}{list(t.shape)} pieces+padding cover "
                f"{total} of {t.numel} elements"
            )
        for a, b in combinations(boxes, 2):
            if _overlap(a, b):
                raise AssertionError(f"{where}: {t.name} boxes {a} and {b} overlap")
        for p in t.pieces:
            c = spec.tensor(p.canonical)
            if not p.canonical_box.fits_in(c.shape):
                raise AssertionError(
                    f"{where}: {t.name} piece {p.canonical_box} "
                    f"outside {p.canonical}{list(c.shape)}"
                )


def canonical_coverage(layouts: Iterable[RankLayout], spec: ModelSpec) -> dict[str, int]:
    """Per canonical tensor, the number of distinct elements held by the given ranks.

    Uses numpy masks, so it is meant for test-sized models.
    """
    import numpy as np

    masks: dict[str, np.ndarray] = {}
    for layout in layouts:
        for piece in layout.pieces():
            c = spec.tensor(piece.canonical)
            mask = masks.setdefault(c.name, np.zeros(c.shape, dtype=bool))
            mask[piece.canonical_box.slices()] = True
    return {name: int(mask.sum()) for name, mask in masks.items()}
