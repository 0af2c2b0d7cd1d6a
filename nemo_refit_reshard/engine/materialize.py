"""Fill a rank's local tensors from canonical tensors through its layout's pieces.

Used to create the training side of demos and tests (the "live" weights a
framework would hold) and to check a destination against the canonical truth.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..layouts.base import RankLayout
from .program import TORCH_DTYPES


def materialize(
    layout: RankLayout,
    canonical: Mapping[str, torch.Tensor],
    fill: float = 0.0,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Local tensors of ``layout``, every piece copied from ``canonical``, padding ``fill``."""
    out: dict[str, torch.Tensor] = {}
    for t in layout.tensors:
        local = torch.full(t.shape, fill, dtype=TORCH_DTYPES[t.dtype], device=device)
        for p in t.pieces:
            src = canonical[p.canonical][p.canonical_box.slices()]
            local[p.local_box.slices()] = src.reshape(p.local_box.sizes).to(local.dtype)
        out[t.name] = local
    return out


def empty_like_layout(
    layout: RankLayout, fill: float = float("nan"), device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Local tensors of ``layout`` filled with ``fill`` (NaN shows any element never written)."""
    return {
        t.name: torch.full(t.shape, fill, dtype=TORCH_DTYPES[t.dtype], device=device)
        for t in layout.tensors
    }


def mismatches(
    layout: RankLayout, tensors: Mapping[str, torch.Tensor], canonical: Mapping[str, torch.Tensor]
) -> list[str]:
    """Names of local tensors whose pieces differ (bitwise, after the dtype cast) from canonical."""
    bad = []
    for t in layout.tensors:
        local = tensors[t.name]
        for p in t.pieces:
            want = canonical[p.canonical][p.canonical_box.slices()].reshape(p.local_box.sizes)
            got = local[p.local_box.slices()]
            if not torch.equal(got, want.to(got.dtype)):
                bad.append(f"{t.name} <- {p.canonical}")
                break
    return bad
