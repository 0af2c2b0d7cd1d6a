"""A message's delta: which of its units changed since the last step, in the smallest form.

A message of the plan is ``n`` packed bytes between two ranks in one round. Its *units*
are ``u``-byte words, ``u`` the smallest itemsize among its runs (BF16 → 2, e4m3 → 1,
float32 scales alone → 4), ``N = n / u`` of them. A unit *changed* when its bits differ
from the sender's baseline (the message's payload the step before): bits, never float
equality, so ``-0.0`` vs ``0.0``, NaN payloads and FP8 bytes all compare as bytes.
With ``k`` changed units the message travels in the smallest of:

=============  ====================================================  =================
form           payload                                               bytes
=============  ====================================================  =================
``DENSE``      the message                                           ``n``
``POSITIONS``  ``k`` unit indices, ``w`` bytes each (little-endian,   ``k·(w + u)``
               ``w`` = 1, 2 or 4: the narrowest that holds ``N-1``),
               then the ``k`` changed units
``BITMAP``     ``⌈N/8⌉`` bytes (bit ``i mod 8`` of byte ``⌊i/8⌋``:   ``⌈N/8⌉ + k·u``
               unit ``i`` changed), then the ``k`` changed units
=============  ====================================================  =================

Ties go to ``DENSE``, then ``POSITIONS`` (``k = 0``: an empty ``POSITIONS`` payload).
A :class:`Header` (32 bytes: form, base version, ``k``, payload bytes) precedes every
message in a small exchange of its own, so the receiver posts a receive of the exact
payload size and knows how to apply it. Everything here is torch on the message's
device; the only host sync is reading the counts (:func:`changed_counts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DENSE, POSITIONS, BITMAP = 0, 1, 2
FORM_NAMES = {DENSE: "dense", POSITIONS: "positions", BITMAP: "bitmap"}
HEADER_BYTES = 32
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = [1 << b for b in range(8)]


@dataclass(frozen=True)
class Header:
    """What precedes a message: its ``form``, the ``base`` version a delta applies to
    (-1 for ``DENSE``), ``count`` = ``k`` changed units, ``nbytes`` of payload."""

    form: int
    base: int
    count: int
    nbytes: int

    def write(self, out: torch.Tensor) -> None:
        """Into ``out`` (``HEADER_BYTES`` bytes, any device)."""
        values = torch.tensor([self.form, self.base, self.count, self.nbytes], dtype=torch.int64)
        out.copy_(values.view(torch.uint8))

    @classmethod
    def read(cls, raw: torch.Tensor) -> Header:
        form, base, count, nbytes = raw.cpu().view(torch.int64).tolist()
        if form not in FORM_NAMES or count < 0 or nbytes < 0:
            raise ValueError(f"not a delta header: {[form, base, count, nbytes]}")
        return cls(form, base, count, nbytes)


def position_width(units: int) -> int:
    """Bytes per unit index: the narrowest of 1, 2, 4 that holds ``units - 1``."""
    if units <= 1 << 8:
        return 1
    if units <= 1 << 16:
        return 2
    if units <= 1 << 32:
        return 4
    raise ValueError(f"a message of {units} units is past 32-bit positions; lower bucket_mb")


def payload_bytes(form: int, nbytes: int, unit: int, count: int) -> int:
    """Payload bytes of a message of ``nbytes`` with ``count`` changed ``unit``-byte units."""
    units = nbytes // unit
    if form == DENSE:
        return nbytes
    if form == POSITIONS:
        return count * (position_width(units) + unit)
    return -(-units // 8) + count * unit


def choose_form(nbytes: int, unit: int, count: int) -> int:
    """The smallest form (ties: dense, then positions)."""
    best = DENSE
    for form in (POSITIONS, BITMAP):
        if payload_bytes(form, nbytes, unit, count) < payload_bytes(best, nbytes, unit, count):
            best = form
    return best


def unit_of(itemsizes: list[int]) -> int:
    """A message's unit: its runs' smallest itemsize (they are powers of two, so it
    divides every run's bytes)."""
    return min(itemsizes)


def _units(message: torch.Tensor, unit: int) -> torch.Tensor:
    """The message's bytes as ``(N, unit)``."""
    return message.view(-1, unit)


def changed_mask(current: torch.Tensor, baseline: torch.Tensor, unit: int) -> torch.Tensor:
    """``(N,)`` bool: unit ``i`` of ``current`` differs in bits from ``baseline``'s."""
    if current.numel() != baseline.numel():
        raise ValueError(f"{current.numel()} bytes against a {baseline.numel()}-byte baseline")
    if current.storage_offset() % unit == 0 and baseline.storage_offset() % unit == 0:
        dtype = _INT_OF_WIDTH[unit]
        return current.view(dtype) != baseline.view(dtype)
    return (_units(current, unit) != _units(baseline, unit)).any(dim=1)


def changed_counts(masks: list[torch.Tensor]) -> list[int]:
    """``k`` of each mask, with one host sync for all of them."""
    if not masks:
        return []
    return torch.stack([m.sum() for m in masks]).tolist()


def encode(current: torch.Tensor, mask: torch.Tensor, unit: int, form: int, out: torch.Tensor):
    """Write the ``form`` payload of ``current`` (bytes) with changed units ``mask`` into
    the front of ``out`` (bytes); returns the payload view. ``DENSE`` returns
    ``current`` itself (nothing is copied)."""
    if form == DENSE:
        return current
    units = current.numel() // unit
    values = _units(current, unit)[mask].reshape(-1)
    count = values.numel() // unit
    if form == POSITIONS:
        width = position_width(units)
        index = mask.nonzero().squeeze(1).to(torch.int64)
        # little-endian: the low ``width`` bytes of each int64 index
        packed = index.view(torch.uint8).view(-1, 8)[:, :width].reshape(-1)
        head = count * width
        out[:head].copy_(packed)
    else:
        head = -(-units // 8)
        bits = torch.zeros(head * 8, dtype=torch.uint8, device=current.device)
        bits[:units] = mask.to(torch.uint8)
        weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=current.device)
        out[:head].copy_((bits.view(head, 8) * weights).sum(dim=1, dtype=torch.uint8))
    out[head : head + values.numel()].copy_(values)
    return out[: head + values.numel()]


def apply_patch(message: torch.Tensor, payload: torch.Tensor, header: Header, unit: int) -> None:
    """Patch ``message`` (its previous content, bytes) with a received payload in place:
    after it, ``message`` equals the sender's current message."""
    if header.form == DENSE:
        message.copy_(payload)
        return
    if header.count == 0:
        return
    units = message.numel() // unit
    if header.form == POSITIONS:
        width = position_width(units)
        head = header.count * width
        wide = torch.zeros(header.count, 8, dtype=torch.uint8, device=message.device)
        wide[:, :width] = payload[:head].view(header.count, width)
        index = wide.view(torch.int64).squeeze(1)
    else:
        head = -(-units // 8)
        shifts = torch.arange(8, dtype=torch.uint8, device=message.device)
        bits = (payload[:head].unsqueeze(1) >> shifts) & 1
        index = bits.reshape(-1)[:units].nonzero().squeeze(1)
        if index.numel() != header.count:
            raise ValueError(f"bitmap marks {index.numel()} units, the header {header.count}")
    values = payload[head : head + header.count * unit].view(header.count, unit)
    _units(message, unit)[index] = values
