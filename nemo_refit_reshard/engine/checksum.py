"""Exact, order-independent checksums of what a refit delivers, per destination tensor.

For every element ``x`` of a canonical tensor ``c`` at canonical flat index ``i``::

    term(x) = (bits(x) + OFFSET) * (MULT * i + salt(c))        (int64, wrapping)

``bits`` reinterprets the value in the wire dtype as an integer of the same width
(float32 -> int32, bfloat16/float16 -> int16), widened to int64. A checksum is the
wrapping int64 sum of its elements' terms. Addition modulo 2^64 is associative and
commutative, so a sum is exact whichever rank, message or order computes it: the
senders of a refit can each checksum what they send (from their *source* boxes, after
casting to the wire dtype) and the driver adds their parts per destination tensor,
while each receiver checksums its destination tensor's pieces (from its layout, so an
element the plan forgot still counts on the receiving side). The two agree iff
(barring a 2^-64 collision) every element arrived, bit for bit, at its place.

* ``OFFSET`` makes zeros count: a tensor that never received anything (still 0)
  does not checksum to 0.
* ``MULT`` is odd and ``salt`` depends on the canonical name, so swapping two elements,
  or two canonical tensors of one fused destination tensor (q and k inside
  ``qkv_proj``), changes the sum.

Carried transfers (``plan/pass4_routes/carry.py``): the first sender checksums what it
hands to the carrying rank under a relay key (that rank, the relay buffer name and box);
the carrying rank adds nothing, and :func:`relay_routes` (from the plan) sends each relay
key's sum on to every (rank, tensor) that receives those bytes from the relay buffer.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping

import torch

from ..layouts.base import Box, RankLayout
from ..plan import Message, is_relay
from .program import TORCH_DTYPES

MASK = (1 << 64) - 1
OFFSET = 0x5851F42D4C957F2D  # < 2^63: an int64 literal
MULT = 0x2545F4914F6CDD1D  # odd
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# (destination refit rank, destination local tensor) -> checksum in [0, 2^64)
Checksums = dict[tuple[int, str], int]
# relay key -> every (rank, tensor) its bytes reach from the relay buffer
Routes = dict[tuple[int, str], list[tuple[int, str]]]


def relay_key(rank: int, name: str, box: Box) -> tuple[int, str]:
    """Checksum key of bytes held in ``rank``'s relay buffer as ``name`` at ``box``."""
    return rank, f"{name}{list(box.offsets)}{list(box.sizes)}"


def _salt(canonical: str) -> int:
    return 2 * zlib.crc32(canonical.encode()) + 1


def _flat_index(shape: tuple[int, ...], box: Box) -> torch.Tensor:
    """int64 canonical flat index of every element of ``box``, in row-major box order."""
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for dim in range(len(shape) - 1, -1, -1):
        offs = torch.arange(box.offsets[dim], box.offsets[dim] + box.sizes[dim])
        view = [1] * len(shape)
        view[dim] = box.sizes[dim]
        index = index + offs.view(view) * stride
        stride *= shape[dim]
    return index.reshape(-1)


def box_checksum(
    values: torch.Tensor, canonical: str, canonical_shape: tuple[int, ...], canonical_box: Box
) -> int:
    """Checksum of ``values`` (any shape, row-major order = ``canonical_box``'s order, in
    the wire dtype) as the elements ``canonical[canonical_box]``."""
    if values.numel() != canonical_box.numel:
        raise ValueError(
            f"{canonical}: {values.numel()} values for a canonical box of "
            f"{canonical_box.numel} elements"
        )
    if not values.dtype.is_floating_point:
        raise ValueError(f"{canonical}: checksums cover floating-point tensors, not {values.dtype}")
    bits = values.detach().cpu().contiguous().reshape(-1).view(_INT_VIEW[values.element_size()])
    weights = _flat_index(canonical_shape, canonical_box) * MULT + _salt(canonical)
    # int64 tensor arithmetic wraps on overflow: exactly the modulo-2^64 sum we want.
    total = ((bits.to(torch.int64) + OFFSET) * weights).sum()
    return int(total) & MASK


def add(into: Checksums, key: tuple[int, str], value: int) -> None:
    into[key] = (into.get(key, 0) + value) & MASK


def sender_checksums(
    messages: Iterable[Message],
    group_rank: int,
    tensors: Mapping[str, torch.Tensor],
    canonical_shapes: Mapping[str, tuple[int, ...]],
) -> Checksums:
    """Checksums of everything ``group_rank`` sends in ``messages`` (its plan share),
    computed from its live source tensors cast to each transfer's wire dtype."""
    out: Checksums = {}
    for m in messages:
        if m.src != group_rank:
            continue
        for t in m.transfers:
            if is_relay(t.src_tensor):
                continue  # counted by the rank that handed it over (see relay_routes)
            live = tensors[t.src_tensor][t.src_box.slices()].to(TORCH_DTYPES[t.dtype])
            value = box_checksum(live, t.canonical, canonical_shapes[t.canonical], t.canonical_box)
            if is_relay(t.dst_tensor):
                add(out, relay_key(m.dst, t.dst_tensor, t.dst_box), value)
            else:
                add(out, (m.dst, t.dst_tensor), value)
    return out


def relay_routes(messages: Iterable[Message]) -> Routes:
    """Where the bytes of each relay key go (from a plan's expanded messages)."""
    out: Routes = {}
    for m in messages:
        for t in m.transfers:
            if is_relay(t.src_tensor):
                out.setdefault(relay_key(m.src, t.src_tensor, t.src_box), []).append(
                    (m.dst, t.dst_tensor)
                )
    return out


def receiver_checksums(
    layout: RankLayout,
    group_rank: int,
    tensors: Mapping[str, torch.Tensor],
    canonical_shapes: Mapping[str, tuple[int, ...]],
) -> Checksums:
    """Checksums of a destination rank's live tensors over every piece of its layout
    (padding excluded), keyed like :func:`sender_checksums`."""
    out: Checksums = {}
    for t in layout.tensors:
        for p in t.pieces:
            live = tensors[t.name][p.local_box.slices()]
            value = box_checksum(live, p.canonical, canonical_shapes[p.canonical], p.canonical_box)
            add(out, (group_rank, t.name), value)
    return out


def combine(parts: Iterable[Checksums], routes: Routes | None = None) -> Checksums:
    """Sum several ranks' checksums per key (modulo 2^64); a relay key's sum goes to
    every target ``routes`` gives it (a relay key without a route stays as it is,
    so :func:`compare` reports it)."""
    out: Checksums = {}
    for part in parts:
        for key, value in part.items():
            for target in (routes or {}).get(key, [key]):
                add(out, target, value)
    return out


def compare(senders: Checksums, receivers: Checksums) -> list[tuple[int, str, int, int]]:
    """``(destination rank, tensor, sent, received)`` for every key whose sums differ;
    a key only one side has counts with 0 on the other."""
    keys = sorted(senders.keys() | receivers.keys())
    return [
        (rank, name, senders.get((rank, name), 0), receivers.get((rank, name), 0))
        for rank, name in keys
        if senders.get((rank, name), 0) != receivers.get((rank, name), 0)
    ]
