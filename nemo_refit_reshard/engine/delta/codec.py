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
``GAPS``       the ``k`` changed units, then ``k`` gap bytes (the    ``k·(u + 1) + 4e``
               distance from the previous changed unit, the first
               from ``-1``; ``0`` for a gap past 255), then the
               ``e`` gaps past 255 (uint32, little-endian)
=============  ====================================================  =================

Ties go to ``DENSE``, then ``POSITIONS`` (``k = 0``: an empty ``POSITIONS`` payload),
then ``BITMAP``. Why gaps: at the densities RL updates reach (1-5 %) changed units lie a
few dozen apart, so one byte locates each (``GAPS`` is ~half ``BITMAP``'s bytes at 3 %
and BF16), and decoding is a prefix sum over the ``k`` gaps where a bitmap must be
unpacked over all ``N`` units.
A :class:`Header` (32 bytes: form, base version, ``k``, payload bytes) precedes every
message in a small exchange of its own, so the receiver posts a receive of the exact
payload size and knows how to apply it. Everything here is torch on the message's
device (CPU tensors through numpy views: faster on one core); the only host sync is the
count of changed units (the length of :func:`changed_units`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DENSE, POSITIONS, BITMAP, GAPS = 0, 1, 2, 3
FORM_NAMES = {DENSE: "dense", POSITIONS: "positions", BITMAP: "bitmap", GAPS: "gaps"}
MAX_GAP = 255  # the largest gap one byte holds; 0 marks a longer one
HEADER_BYTES = 32
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT_OF_WIDTH = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
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


def payload_bytes(form: int, nbytes: int, unit: int, count: int, long_gaps: int = 0) -> int:
    """Payload bytes of a message of ``nbytes`` with ``count`` changed ``unit``-byte units,
    ``long_gaps`` of them more than :data:`MAX_GAP` units after the previous one."""
    units = nbytes // unit
    if form == DENSE:
        return nbytes
    if form == POSITIONS:
        return count * (position_width(units) + unit)
    if form == GAPS:
        return count * (unit + 1) + 4 * long_gaps
    return -(-units // 8) + count * unit


def choose_form(nbytes: int, unit: int, count: int, long_gaps: int = 0) -> int:
    """The smallest form (ties: dense, positions, bitmap, gaps)."""
    sizes = [payload_bytes(f, nbytes, unit, count, long_gaps) for f in FORM_NAMES]
    return sizes.index(min(sizes))


def count_long_gaps(index: torch.Tensor) -> int:
    """How many of the sorted unit indices ``index`` lie more than :data:`MAX_GAP` units
    after the previous one (the first: after ``-1``)."""
    if index.numel() == 0:
        return 0
    if index.device.type == "cpu":
        ix = index.numpy()
        return int(ix[0] >= MAX_GAP) + int(np.count_nonzero(np.diff(ix) > MAX_GAP))
    return int(((index - _previous(index)) > MAX_GAP).sum())


def _previous(index: torch.Tensor) -> torch.Tensor:
    """Each index's predecessor (``-1`` for the first)."""
    return torch.cat([index.new_full((1,), -1), index[:-1]])


def unit_of(itemsizes: list[int]) -> int:
    """A message's unit: its runs' smallest itemsize (they are powers of two, so it
    divides every run's bytes)."""
    return min(itemsizes)


def _units(message: torch.Tensor, unit: int) -> torch.Tensor:
    """The message's bytes as ``(N, unit)``."""
    return message.view(-1, unit)


def _np_units(message: torch.Tensor, unit: int) -> np.ndarray:
    """A CPU message's units as one numpy integer each (a view: numpy allows unaligned)."""
    return message.numpy().view(_NP_INT_OF_WIDTH[unit])


def changed_units(current: torch.Tensor, baseline: torch.Tensor, unit: int) -> torch.Tensor:
    """Sorted int64 indices of the units of ``current`` whose bits differ from
    ``baseline``'s (CPU: numpy's compare and ``flatnonzero``, several times torch's on
    one core; CUDA: torch)."""
    if current.numel() != baseline.numel():
        raise ValueError(f"{current.numel()} bytes against a {baseline.numel()}-byte baseline")
    if current.device.type == "cpu" and baseline.device.type == "cpu":
        return torch.from_numpy(
            np.flatnonzero(_np_units(current, unit) != _np_units(baseline, unit))
        )
    baseline = baseline.to(current.device, non_blocking=True)
    if current.storage_offset() % unit == 0 and baseline.storage_offset() % unit == 0:
        dtype = _INT_OF_WIDTH[unit]
        return torch.nonzero(current.view(dtype) != baseline.view(dtype)).squeeze(1)
    return torch.nonzero((_units(current, unit) != _units(baseline, unit)).any(dim=1)).squeeze(1)


def with_ranges(index: torch.Tensor, ranges, unit: int) -> torch.Tensor:
    """``index`` with every unit of the byte ranges ``ranges`` added (sorted, unique)."""
    if not ranges:
        return index
    extra = [torch.arange(a // unit, -(-b // unit), device=index.device) for a, b in ranges]
    return torch.unique(torch.cat([index, *extra]))


def take_units(message: torch.Tensor, index: torch.Tensor, unit: int) -> torch.Tensor:
    """The bytes of units ``index`` of ``message``, back to back."""
    if message.device.type == "cpu":
        picked = _np_units(message, unit)[index.numpy()]
        return torch.from_numpy(picked.view(np.uint8).reshape(-1))
    return _units(message, unit)[index].reshape(-1)


def put_units(message: torch.Tensor, index: torch.Tensor, values: torch.Tensor, unit: int) -> None:
    """Write ``values`` (bytes, back to back) into units ``index`` of ``message``.

    The write happens where ``message`` lives: a host baseline (``baseline="host"``) or a
    chain forwarder's host copy is patched with indices and values that were found on
    the GPU, so those are brought to the message's device first (a blocking copy to the
    host: numpy reads them at once). numpy's path serves only when all three are on the
    CPU already."""
    if message.device.type == "cpu" and index.device.type == "cpu" == values.device.type:
        _np_units(message, unit)[index.numpy()] = values.numpy().view(_NP_INT_OF_WIDTH[unit])
        return
    index, values = index.to(message.device), values.to(message.device)
    _units(message, unit)[index] = values.view(-1, unit)


def encode(current: torch.Tensor, index: torch.Tensor, unit: int, form: int, out: torch.Tensor):
    """Write the ``form`` payload of ``current`` (bytes) whose units ``index`` changed
    into the front of ``out`` (bytes); returns the payload view. ``DENSE`` returns
    ``current`` itself (nothing is copied)."""
    if form == DENSE:
        return current
    units = current.numel() // unit
    count = index.numel()
    if form == GAPS:
        values = count * unit
        _take_into(current, index, unit, out[:values])
        gaps, long_gaps = _gaps(index)
        out[values : values + count].copy_(gaps)
        end = values + count + long_gaps.numel()
        out[values + count : end].copy_(long_gaps)
        return out[:end]
    if form == POSITIONS:
        width = position_width(units)
        head = count * width
        # little-endian: the low ``width`` bytes of each int64 index
        packed = index.to(torch.int64).view(torch.uint8).view(-1, 8)[:, :width].reshape(-1)
        out[:head].copy_(packed)
    else:
        head = -(-units // 8)
        out[:head].copy_(_bitmap(index, units, current.device))
    _take_into(current, index, unit, out[head : head + count * unit])
    return out[: head + count * unit]


def _take_into(message: torch.Tensor, index: torch.Tensor, unit: int, out: torch.Tensor) -> None:
    """:func:`take_units` written straight into ``out`` (no temporary on CPU)."""
    if message.device.type == "cpu":
        np.take(_np_units(message, unit), index.numpy(), out=_np_units(out, unit))
        return
    out.copy_(take_units(message, index, unit))


def payload_values(payload: torch.Tensor, form: int, nbytes: int, unit: int, count: int):
    """The changed units' bytes inside a payload of ``form`` (``count`` of them) for a
    message of ``nbytes``: a view, nothing copied."""
    if form == DENSE:
        return payload
    if form == GAPS:
        return payload[: count * unit]
    units = nbytes // unit
    head = count * position_width(units) if form == POSITIONS else -(-units // 8)
    return payload[head : head + count * unit]


def _gaps(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(one byte per index, the long gaps' uint32 bytes)`` of a ``GAPS`` payload."""
    if index.device.type != "cpu":
        return _gaps_torch(index)
    gaps = np.diff(index.numpy(), prepend=-1)
    long = gaps > MAX_GAP
    short = gaps.astype(np.uint8)
    short[long] = 0
    return torch.from_numpy(short), torch.from_numpy(gaps[long].astype("<u4").view(np.uint8))


def _gaps_torch(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_gaps` in torch ops (any device; the GPU's path)."""
    gaps = index - _previous(index)
    long = gaps > MAX_GAP
    short = torch.where(long, 0, gaps).to(torch.uint8)
    wide = gaps[long].view(torch.uint8).view(-1, 8)[:, :4].reshape(-1)  # little-endian
    return short, wide


def _ungap(payload: torch.Tensor, count: int) -> torch.Tensor:
    """The sorted unit indices of a ``GAPS`` payload's gap bytes (``payload`` from the
    first gap byte: ``count`` gap bytes, then the long gaps)."""
    if payload.device.type != "cpu":
        return _ungap_torch(payload, count)
    gaps = payload[:count].numpy().astype(np.int64)
    long = gaps == 0
    n = int(np.count_nonzero(long))
    check_gap_bytes(payload, count, n)
    gaps[long] = payload[count : count + 4 * n].numpy().view("<u4")
    return torch.from_numpy(np.cumsum(gaps) - 1)


def _ungap_compiled(payload: torch.Tensor, count: int) -> torch.Tensor:
    """:func:`_ungap` through the compiled kernel (its long gaps copied: aligned)."""
    from . import kernels as delta_kernels  # numba loads only where a compiled step runs

    raw = payload.numpy()
    check_gap_bytes(payload, count, int(np.count_nonzero(raw[:count] == 0)))
    longs = raw[count:].copy().view("<u4")
    return delta_kernels.ungap(raw[:count], longs)


def _ungap_torch(payload: torch.Tensor, count: int) -> torch.Tensor:
    """:func:`_ungap` in torch ops (any device; the GPU's path)."""
    gaps = payload[:count].to(torch.int64)
    long = gaps == 0
    n = int(long.sum())  # a host sync of a GAPS decode
    check_gap_bytes(payload, count, n)
    wide = torch.zeros(n, 8, dtype=torch.uint8, device=payload.device)
    wide[:, :4] = payload[count : count + 4 * n].view(n, 4)
    gaps[long] = wide.view(torch.int64).squeeze(1)
    return torch.cumsum(gaps, 0) - 1


def check_gap_bytes(payload: torch.Tensor, count: int, long_gaps: int) -> None:
    """A ``GAPS`` payload holds exactly its ``count`` gap bytes and ``4·long_gaps`` bytes of
    long gaps after the values: anything else is not the payload its header describes."""
    if payload.numel() != count + 4 * long_gaps:
        raise ValueError(
            f"a gaps payload with {count} gaps, {long_gaps} of them long, has "
            f"{payload.numel()} gap bytes, not {count + 4 * long_gaps}"
        )


def _bitmap(index: torch.Tensor, units: int, device: torch.device) -> torch.Tensor:
    """``⌈units/8⌉`` bytes: bit ``i mod 8`` of byte ``⌊i/8⌋`` set for each ``i`` in ``index``."""
    if device.type == "cpu":
        bits = np.zeros(units, dtype=bool)
        bits[index.numpy()] = True
        return torch.from_numpy(np.packbits(bits, bitorder="little"))
    bits = torch.zeros(-(-units // 8) * 8, dtype=torch.uint8, device=device)
    bits[index] = 1
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=device)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unbitmap(bitmap: torch.Tensor, units: int) -> torch.Tensor:
    """The sorted unit indices a bitmap marks."""
    if bitmap.device.type == "cpu":
        bits = np.unpackbits(bitmap.numpy(), count=units, bitorder="little")
        return torch.from_numpy(np.flatnonzero(bits.view(bool)))  # bool: 6x faster scan
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    bits = (bitmap.unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:units].nonzero().squeeze(1)


def decode(payload: torch.Tensor, header: Header, nbytes: int, unit: int, compiled: bool = False):
    """``(index, values)`` of a delta payload for a message of ``nbytes``: the sorted
    changed units and their bytes, back to back. ``compiled``: a CPU payload's gaps
    through ``delta_kernels.ungap`` (one pass)."""
    units = nbytes // unit
    if header.form == GAPS:
        values = header.count * unit
        if compiled and payload.device.type == "cpu":
            index = _ungap_compiled(payload[values:], header.count)
        else:
            index = _ungap(payload[values:], header.count)
        if header.count and int(index[-1]) >= units:
            raise ValueError(f"gaps reach unit {int(index[-1])} of a {units}-unit message")
        return index, payload[:values]
    if header.form == POSITIONS:
        width = position_width(units)
        head = header.count * width
        wide = torch.zeros(header.count, 8, dtype=torch.uint8, device=payload.device)
        wide[:, :width] = payload[:head].view(header.count, width)
        index = wide.view(torch.int64).squeeze(1)
    else:
        head = -(-units // 8)
        index = _unbitmap(payload[:head], units)
        if index.numel() != header.count:
            raise ValueError(f"bitmap marks {index.numel()} units, the header {header.count}")
    return index, payload[head : head + header.count * unit]


def apply_patch(message: torch.Tensor, payload: torch.Tensor, header: Header, unit: int) -> None:
    """Patch ``message`` (its previous content, bytes) with a received payload in place:
    after it, ``message`` equals the sender's current message."""
    if header.form == DENSE:
        message.copy_(payload)
        return
    if header.count == 0:
        return
    index, values = decode(payload, header, message.numel(), unit)
    put_units(message, index, values, unit)
