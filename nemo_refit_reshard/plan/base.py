"""What every pass shares: a transfer (one box from one rank's tensor into another's), the
wire sizes of dtypes, box cutting, :class:`PlanError`, and the names of relay buffers.

Relay buffers: a carried transfer (``pass4_routes/carry.py``) travels in two legs,

* leg 1, round ``r``: ``src -> via``, into ``via``'s relay buffer under the name
  :func:`relay_tensor` ``(dst, dst_tensor)`` and the destination box;
* leg 2, round ``r + 1``: ``via -> dst``, from that relay buffer entry into the
  destination tensor, like any other transfer to ``dst``.

The buffer is allocated by the engine (``engine/program.py``), never a live tensor the
frameworks hand over; messages, expansion, verification and the engine read these names.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from operator import attrgetter, itemgetter, mul
from typing import NamedTuple

from ..layouts.base import Box, map_sub_box

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
        src, dst, src_tensor, src_box, dst_tensor, dst_box, canonical, whole, dtype = self
        return new_transfer(
            Transfer,
            (
                src,
                dst,
                src_tensor,
                map_sub_box(whole, src_box, box),
                dst_tensor,
                map_sub_box(whole, dst_box, box),
                canonical,
                box,
                dtype,
            ),
        )


# ``new_transfer(Transfer, fields)`` is ``Transfer(*fields)`` without the generated
# ``__new__`` (a Python function): hot loops make millions of transfers.
new_transfer = tuple.__new__
_NUMEL = attrgetter("canonical_box.numel")
_DTYPE = itemgetter(8)


def sizes_of(transfers: Sequence[Transfer]) -> Iterator[int]:
    """``t.nbytes`` of every transfer, in order: the same numbers, computed in C (plans
    size millions of transfers several times over)."""
    return map(mul, map(_NUMEL, transfers), map(DTYPE_BYTES.__getitem__, map(_DTYPE, transfers)))


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


def rows_that_fit(sizes: tuple[int, ...], total: int, nbytes: float) -> tuple[int, int] | None:
    """``(lead, rows)``: the lead (first non-unit) dim of a box of ``sizes`` holding
    ``total`` bytes, and how many of its whole rows fit in ``nbytes``; None if not even one
    row fits or the box is one row (the arithmetic of :func:`cut_rows`)."""
    lead = next((d for d, n in enumerate(sizes) if n != 1), None)
    if lead is None:
        return None
    rows = sizes[lead]
    take = min(rows - 1, int(nbytes // (total // rows)))
    return None if take < 1 else (lead, take)


def cut_rows(t: Transfer, nbytes: float) -> tuple[Transfer, Transfer] | None:
    """``t`` cut after as many whole rows of its lead (first non-unit) dim as fit in
    ``nbytes``: (head, tail), or None if not even one row fits or ``t`` is one row."""
    box = t.canonical_box
    fit = rows_that_fit(box.sizes, t.nbytes, nbytes)
    if fit is None:
        return None
    lead, take = fit
    head = list(box.sizes)
    head[lead] = take
    offsets, rest = list(box.offsets), list(box.sizes)
    offsets[lead] += take
    rest[lead] -= take
    return t.part(Box(box.offsets, tuple(head))), t.part(Box(tuple(offsets), tuple(rest)))


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


# -- the order of transfers in a message ------------------------------------------------
def message_order(t: Transfer) -> tuple:
    # Largest dtype first (alignment), then destination order, so the receiver's adjacent
    # boxes (e.g. consecutive experts of w13_weight) sit next to each other and merge.
    return (-DTYPE_BYTES[t.dtype], t.dst_tensor, t.dst_box.offsets, t.src_tensor, t.src_box.offsets)


# message_order without its first field, a key computed in C: where every transfer has
# one dtype (most messages), sorting on it gives the same order.
_WITHIN_DTYPE = attrgetter("dst_tensor", "dst_box.offsets", "src_tensor", "src_box.offsets")


def in_message_order(transfers: Sequence[Transfer], reverse: bool = False) -> list[Transfer]:
    """``sorted(transfers, key=message_order, reverse=reverse)``."""
    one_dtype = len(set(map(_DTYPE, transfers))) <= 1
    return sorted(transfers, key=_WITHIN_DTYPE if one_dtype else message_order, reverse=reverse)


# -- relay buffers -----------------------------------------------------------------------
RELAY = "@relay:"


def relay_tensor(dst: int, dst_tensor: str) -> str:
    """The relay buffer name of bytes on their way to ``dst``'s ``dst_tensor``."""
    return f"{RELAY}{dst}:{dst_tensor}"


def relayed_to(name: str) -> tuple[int, str] | None:
    """``(dst, dst_tensor)`` of a relay buffer name; ``None`` for a live tensor."""
    if not name.startswith(RELAY):
        return None
    rank, _, tensor = name[len(RELAY) :].partition(":")
    return int(rank), tensor


def is_relay(name: str) -> bool:
    return name.startswith(RELAY)


def legs(t: Transfer, via: int) -> tuple[Transfer, Transfer]:
    """Leg 1 (``t.src -> via``, into the relay buffer) and leg 2 (``via -> t.dst``)."""
    name = relay_tensor(t.dst, t.dst_tensor)
    src, dst, src_tensor, src_box, dst_tensor, dst_box, canonical, box, dtype = t
    first = new_transfer(
        Transfer, (src, via, src_tensor, src_box, name, dst_box, canonical, box, dtype)
    )
    second = new_transfer(
        Transfer, (via, dst, name, dst_box, dst_tensor, dst_box, canonical, box, dtype)
    )
    return first, second
