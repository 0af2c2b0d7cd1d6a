"""The layout model: a rank's local tensors and the pieces that fill them.

A :class:`Piece` says that the elements of a box of a canonical tensor live in
a box of a local tensor. The two boxes may differ in rank only by unit
dimensions: element ``k`` (row-major) of the canonical box is element ``k`` of
the local box. E.g. expert ``e``'s ``gate_proj`` rows ``[a, b)`` land in
``w13_weight[j, 0:b-a, :]`` as a ``(1, b-a, H)`` box.

Local elements covered by no piece are padding (padded vocabulary rows) and are
never transferred.
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from operator import add
from operator import sub as _sub
from typing import Any, TypeVar

from ..spec.model import index_by_name

F = TypeVar("F", bound=Callable[..., Any])


def paused_gc(fn: F) -> F:
    """Run ``fn`` with CPython's cyclic garbage collector paused.

    Layouts and plans allocate millions of small acyclic objects (boxes, pieces,
    transfers); each allocation burst triggers collections that rescan the whole
    growing heap. Pausing it halves plan build time at DeepSeek-V3 scale; nothing
    built here forms reference cycles, so nothing is left for it to collect.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True, order=True)
class Box:
    """A hyper-rectangle ``[offsets[d], offsets[d] + sizes[d])`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box offsets {self.offsets} and sizes {self.sizes} differ in rank")
        for v in self.offsets + self.sizes:
            if v < 0:
                raise ValueError(f"box {self.offsets}+{self.sizes} has a negative offset or size")
        # A plain attribute, not a property: planners read it millions of times.
        object.__setattr__(self, "numel", math.prod(self.sizes))

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @classmethod
    def rows(cls, shape: tuple[int, ...], start: int, stop: int, dim: int = 0) -> Box:
        """The full box of ``shape`` restricted to ``[start, stop)`` along ``dim``."""
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[dim], sizes[dim] = start, stop - start
        return cls(tuple(offsets), tuple(sizes))

    @property
    def core_sizes(self) -> tuple[int, ...]:
        """Sizes without unit dimensions: what must agree between the two boxes of a piece."""
        return tuple(s for s in self.sizes if s != 1)

    def fits_in(self, shape: tuple[int, ...]) -> bool:
        if len(shape) != len(self.offsets):
            return False
        for o, s, n in zip(self.offsets, self.sizes, shape):
            if o + s > n:
                return False
        return True

    def intersect(self, other: Box) -> Box | None:
        """The common box of ``self`` and ``other`` (same rank), or ``None`` if empty.

        Returns ``self`` itself when ``other`` contains it (the common case when a
        destination slice lies inside one source region)."""
        if self.contained_in(other):
            return self
        offsets, sizes = [], []
        for ao, as_, bo, bs in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(ao, bo), min(ao + as_, bo + bs)
            if lo >= hi:
                return None
            offsets.append(lo)
            sizes.append(hi - lo)
        return _derived_box(tuple(offsets), tuple(sizes))

    def contained_in(self, other: Box) -> bool:
        for ao, as_, bo, bs in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            if ao < bo or ao + as_ > bo + bs:
                return False
        return True

    def followed_by(self, other: Box) -> Box | None:
        """The union box if ``other`` continues ``self`` in row-major order of that union.

        The boxes must agree everywhere except on one dimension d, where ``other``
        starts right after ``self`` ends, and every dimension before d must have
        size 1: the union's elements are then ``self``'s followed by ``other``'s.
        E.g. ``w13[j, :, :]`` followed by ``w13[j+1, :, :]`` is ``w13[j:j+2, :, :]``.
        """
        if len(other.sizes) != len(self.sizes):
            return None
        for d in range(len(self.sizes)):
            if (
                self.offsets[:d] == other.offsets[:d]
                and self.sizes[:d] == other.sizes[:d]
                and self.offsets[d + 1 :] == other.offsets[d + 1 :]
                and self.sizes[d + 1 :] == other.sizes[d + 1 :]
                and other.offsets[d] == self.offsets[d] + self.sizes[d]
            ):
                sizes = list(self.sizes)
                sizes[d] += other.sizes[d]
                return _derived_box(self.offsets, tuple(sizes))
            if self.sizes[d] != 1:
                return None  # a non-unit dimension before d would interleave the parts
        return None

    def slices(self) -> tuple[slice, ...]:
        # Cached: compiled programs index with the same (shared) boxes many times.
        cached = self.__dict__.get("_slices")
        if cached is None:
            cached = tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))
            object.__setattr__(self, "_slices", cached)
        return cached

    def to_json(self) -> list[list[int]]:
        return [list(self.offsets), list(self.sizes)]

    @classmethod
    def from_json(cls, data: list[list[int]]) -> Box:
        return cls(tuple(data[0]), tuple(data[1]))


def _derived_box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Box:
    """``Box(offsets, sizes)`` for a box computed from valid boxes (an intersection, a
    union, a mapped sub-box), without re-checking it: planners make millions of them,
    and the checked constructor takes most of their cost."""
    box = object.__new__(Box)
    fields = box.__dict__  # (a frozen dataclass: its fields are set once, here)
    fields["offsets"] = offsets
    fields["sizes"] = sizes
    fields["numel"] = math.prod(sizes)
    return box


def map_sub_box(outer: Box, image: Box, sub: Box) -> Box:
    """Where ``sub`` (a box inside ``outer``) lies in ``image``, ``outer``'s counterpart.

    ``outer`` and ``image`` hold the same elements in the same row-major order and
    agree on their non-unit sizes: the k-th non-unit dimension of ``outer`` is the
    k-th non-unit dimension of ``image``; unit dimensions carry no offset.
    """
    if sub is outer or (sub.offsets == outer.offsets and sub.sizes == outer.sizes):
        return image
    if outer.sizes == image.sizes:
        # Same shape (no unit dimensions to line up): a plain shift.
        if outer.offsets == image.offsets:
            return sub
        shifted = map(_sub, map(add, image.offsets, sub.offsets), outer.offsets)
        return _derived_box(tuple(shifted), sub.sizes)
    offsets, sizes = list(image.offsets), list(image.sizes)
    image_dims = [d for d, s in enumerate(image.sizes) if s != 1]
    outer_dims = [d for d, s in enumerate(outer.sizes) if s != 1]
    for od, idim in zip(outer_dims, image_dims):
        offsets[idim] = image.offsets[idim] + sub.offsets[od] - outer.offsets[od]
        sizes[idim] = sub.sizes[od]
    return _derived_box(tuple(offsets), tuple(sizes))


@dataclass(frozen=True)
class Piece:
    """``canonical[canonical_box]`` is stored at ``local[local_box]`` on this rank."""

    canonical: str
    canonical_box: Box
    local: str
    local_box: Box

    def __post_init__(self) -> None:
        c, local = self.canonical_box.sizes, self.local_box.sizes
        if c == local or (local[0] == 1 and local[1:] == c):
            return  # the common cases (same box shape; one stacked slot, e.g. an expert)
        if self.canonical_box.core_sizes != self.local_box.core_sizes:
            raise ValueError(
                f"piece {self.canonical}{self.canonical_box.sizes} -> "
                f"{self.local}{self.local_box.sizes}: box sizes disagree"
            )

    def local_sub_box(self, canonical_sub: Box) -> Box:
        """The local box holding ``canonical_sub`` (a box inside ``canonical_box``)."""
        return map_sub_box(self.canonical_box, self.local_box, canonical_sub)

    def to_json(self) -> dict[str, Any]:
        return {
            "canonical": self.canonical,
            "canonical_box": self.canonical_box.to_json(),
            "local": self.local,
            "local_box": self.local_box.to_json(),
        }


def _unchecked_piece(canonical: str, canonical_box: Box, local: str, local_box: Box) -> Piece:
    """``Piece(...)`` for boxes a provider computed consistent by construction, without
    the frozen dataclass's per-field setattr and the shape check."""
    piece = object.__new__(Piece)
    piece.__dict__.update(
        canonical=canonical, canonical_box=canonical_box, local=local, local_box=local_box
    )
    return piece


@dataclass(frozen=True)
class Fp8Link:
    """How a local tensor of a block-FP8 refit (``layouts/fp8_wire.py``) relates to the
    rank's live tensors.

    On a sending rank (``source`` set) the tensor is not live: it is ``source[box]``
    (the box's non-unit sizes as ``[rows, cols]``) cast to ``dtype`` and quantized in
    ``block`` blocks, its block scales going to the (equally derived) tensor ``scale``.
    On a receiving rank (``source`` None) it is the ``dtype`` shadow of the live e4m3
    tensor of the same name, quantized into that tensor and into ``scale`` after each
    step."""

    scale: str
    block: tuple[int, int]
    dtype: str  # the unquantized (trained) dtype
    source: str | None = None
    box: Box | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"scale": self.scale, "block": list(self.block), "dtype": self.dtype}
        if self.source is not None and self.box is not None:
            out.update(source=self.source, box=self.box.to_json())
        return out


@dataclass(frozen=True)
class LocalTensor:
    """A tensor as one framework names and shapes it on one rank."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]
    padding: tuple[Box, ...] = ()  # local boxes no canonical element maps to
    fp8: Fp8Link | None = None  # a block-FP8 refit's quantized view or shadow (Fp8Link)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "pieces": [
                {
                    "canonical": p.canonical,
                    "canonical_box": p.canonical_box.to_json(),
                    "local_box": p.local_box.to_json(),
                }
                for p in self.pieces
            ],
            "padding": [b.to_json() for b in self.padding],
            **({"fp8": self.fp8.to_json()} if self.fp8 is not None else {}),
        }


@dataclass(frozen=True)
class RankLayout:
    """Everything one rank holds: its local tensors and its place in the parallel grid.

    ``position`` maps grid axes (``tp``, ``pp``, ``dp``, ...) to this rank's
    coordinate; ``replicas`` lists the ranks (this one included) whose pieces are
    identical to this rank's, in increasing order.
    """

    framework: str
    rank: int
    world_size: int
    position: dict[str, int]
    replicas: tuple[int, ...]
    tensors: tuple[LocalTensor, ...]
    _index: dict[str, LocalTensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = index_by_name(self.tensors, f"{self.framework} rank {self.rank}'s local tensors")
        object.__setattr__(self, "_index", index)

    def tensor(self, name: str) -> LocalTensor:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(
                f"{self.framework} rank {self.rank} has no local tensor {name!r}"
            ) from None

    def pieces(self) -> Iterator[Piece]:
        for t in self.tensors:
            yield from t.pieces

    def to_json(self) -> dict[str, Any]:
        return {
            "framework": self.framework,
            "rank": self.rank,
            "world_size": self.world_size,
            "position": dict(self.position),
            "replicas": list(self.replicas),
            "tensors": [t.to_json() for t in self.tensors],
        }


class LayoutBuilder:
    """Collects local tensors and their pieces while a provider walks a model."""

    def __init__(self) -> None:
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        self._pieces: dict[str, list[Piece]] = {}
        self._padding: dict[str, list[Box]] = {}

    def tensor(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        if name in self._shapes:
            raise ValueError(f"local tensor {name!r} declared twice")
        self._shapes[name] = tuple(shape)
        self._dtypes[name] = dtype
        self._pieces[name] = []
        self._padding[name] = []

    def piece(
        self, canonical: str, canonical_box: Box, local: str, local_box: Box, check: bool = True
    ) -> None:
        """Record a piece; ``check=False`` skips the bounds check for boxes a provider
        computes in range by construction (a million expert pieces at DeepSeek scale)."""
        if local_box.numel == 0:
            return
        if check and not local_box.fits_in(self._shapes[local]):
            raise AssertionError(f"piece box {local_box} outside {local}{self._shapes[local]}")
        self._pieces[local].append(Piece(canonical, canonical_box, local, local_box))

    def stacked_pieces(
        self, local: str, canonical_box: Box, slots: Iterable[tuple[str, tuple[int, ...]]]
    ) -> None:
        """Record, per ``(canonical, offsets)``, the piece ``canonical[canonical_box]``
        stored as one slot of a stacked tensor: ``local`` at ``offsets``, sizes
        ``(1, *canonical_box.sizes)`` (experts: 1.4 million pieces per replica at
        DeepSeek-V3 scale). The provider computes the offsets in range by construction:
        neither the boxes nor the pieces are checked."""
        sizes = (1, *canonical_box.sizes)
        if 0 in sizes:
            return
        out = self._pieces[local]
        for canonical, offsets in slots:
            out.append(
                _unchecked_piece(canonical, canonical_box, local, _derived_box(offsets, sizes))
            )

    def padding(self, local: str, local_box: Box) -> None:
        if local_box.numel:
            self._padding[local].append(local_box)

    def rows(
        self,
        local: str,
        segments: list[tuple[int, int, str, int]],
        start: int,
        stop: int,
        local_row: int = 0,
    ) -> None:
        """Map rows ``[start, stop)`` of a row-fused tensor into ``local`` from ``local_row``.

        ``segments`` lists ``(fused_row, rows, canonical, canonical_row)``: fused rows
        ``[fused_row, fused_row + rows)`` are canonical rows from ``canonical_row``.
        Rows that no segment covers are padding. Every other dimension is taken whole.
        """
        shape = self._shapes[local]
        covered = 0
        for fused_row, rows, canonical, canonical_row in segments:
            lo, hi = max(start, fused_row), min(stop, fused_row + rows)
            if lo >= hi:
                continue
            c_lo = canonical_row + lo - fused_row
            c_shape = (canonical_row + rows,) + shape[1:]
            self.piece(
                canonical,
                Box.rows(c_shape, c_lo, c_lo + hi - lo),
                local,
                Box.rows(shape, local_row + lo - start, local_row + hi - start),
            )
            covered += hi - lo
        if covered < stop - start:
            # Only trailing rows may be uncovered (padded vocabulary rows).
            first_pad = local_row + covered
            self.padding(local, Box.rows(shape, first_pad, local_row + stop - start))

    def build(self) -> tuple[LocalTensor, ...]:
        return tuple(
            LocalTensor(
                name,
                self._shapes[name],
                self._dtypes[name],
                tuple(self._pieces[name]),
                tuple(self._padding[name]),
            )
            for name in self._shapes
        )
