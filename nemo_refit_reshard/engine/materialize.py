"""Fill a rank's local tensors from canonical tensors through its layout's pieces.

Used to create the training side of demos and tests (the "live" weights a
framework would hold) and to check a destination against the canonical truth.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence

import torch

from ..layouts.base import RankLayout
from ..layouts.fp8_wire import live_layout
from .program import TORCH_DTYPES


def materialize(
    layout: RankLayout,
    canonical: Mapping[str, torch.Tensor],
    fill: float = 0.0,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Local tensors of ``layout``, every piece copied from ``canonical``, padding ``fill``.
    A block-FP8 refit's layout is materialized as the rank holds it (``live_layout``)."""
    out: dict[str, torch.Tensor] = {}
    for t in live_layout(layout).tensors:
        local = torch.full(t.shape, fill, dtype=TORCH_DTYPES[t.dtype], device=device)
        for p in t.pieces:
            src = canonical[p.canonical][p.canonical_box.slices()]
            local[p.local_box.slices()] = src.reshape(p.local_box.sizes).to(device, local.dtype)
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
            if not torch.equal(got.cpu(), want.to(got.dtype)):
                bad.append(f"{t.name} <- {p.canonical}")
                break
    return bad


class SyntheticWeights(Mapping[str, torch.Tensor]):
    """Deterministic random canonical tensors, generated on first access.

    Tensor ``name`` is drawn from a generator seeded by ``(seed, crc32(name))``, so
    every process that asks for a tensor gets the same values without the whole
    model ever being materialised in one place.
    """

    def __init__(self, spec, seed: int = 0, dtype: torch.dtype | None = None) -> None:
        self.spec = spec
        self.seed = seed
        self.dtype = dtype
        self._cache: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            t = self.spec.tensor(name)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            dtype = self.dtype or TORCH_DTYPES[t.dtype]
            self._cache[name] = torch.randn(t.shape, generator=g).to(dtype)
        return self._cache[name]

    def __iter__(self) -> Iterator[str]:
        return (t.name for t in self.spec)

    def __len__(self) -> int:
        return len(self.spec)

    def forget(self) -> None:
        self._cache.clear()


def canonical_from_ranks(
    canonical_shapes: Mapping[str, tuple[int, ...]],
    layouts: Sequence[RankLayout],
    tensors: Sequence[Mapping[str, torch.Tensor]],
    who: str = "ranks",
) -> dict[str, torch.Tensor]:
    """Rebuild canonical tensors (float32 on the CPU) from every rank's local tensors.

    The inverse of :func:`materialize` over a whole world: each piece of each rank is
    copied to its canonical box. Elements several ranks hold (TP-replicated norms,
    data-parallel and inference replicas, a tied embedding on two pipeline stages) must
    agree bit for bit, and every element of every tensor in ``canonical_shapes`` must be
    held by some rank; otherwise ``ValueError`` names the tensor (and the rank).
    """
    if len(layouts) != len(tensors):
        raise ValueError(f"{len(layouts)} layouts but {len(tensors)} sets of local tensors")
    out: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for layout, local in zip(layouts, tensors):
        for t in layout.tensors:
            for p in t.pieces:
                if p.canonical not in out:
                    shape = canonical_shapes[p.canonical]
                    out[p.canonical] = torch.zeros(shape, dtype=torch.float32)
                    seen[p.canonical] = torch.zeros(shape, dtype=torch.bool)
                value = local[t.name][p.local_box.slices()].detach().cpu().float()
                dst = out[p.canonical][p.canonical_box.slices()]
                mask = seen[p.canonical][p.canonical_box.slices()]
                value = value.reshape(dst.shape)
                # bitwise comparison (NaN == NaN) of the elements already filled
                before = dst[mask].view(torch.int32)
                if not torch.equal(value[mask].view(torch.int32), before):
                    raise ValueError(
                        f"{who}: rank {layout.rank} holds {p.canonical} at offsets "
                        f"{list(p.canonical_box.offsets)} (in {t.name}) with values that "
                        "differ from another rank's copy"
                    )
                dst.copy_(value)
                mask.fill_(True)
    for name in canonical_shapes:
        mask = seen.get(name)
        if mask is None or not bool(mask.all()):
            missing = mask.numel() - int(mask.sum()) if mask is not None else "all"
            raise ValueError(f"{who}: {missing} elements of {name} are held by no rank")
    return out
