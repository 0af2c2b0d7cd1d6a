"""Compiled CPU kernels of a delta step (numba), byte for byte the numpy path's result.

numpy finds a message's changed units in passes over all of it (compare, then
``flatnonzero``, ~1 ns per unit on one core: branchy at RL densities), then gathers the
values, the gaps and the baseline's new units in more passes. One compiled pass does it
all while the bytes are in cache:

* :func:`compare_runs` walks a message's runs *where they live* (a training rank's
  tensors: no pack into the staging), 64 units at a time: their compare against the
  baseline gives a 64-bit mask (vectorized), whose set bits (count-trailing-zeros) are the
  changed units. Each changed unit is written to the baseline (which then holds the
  message as sent), its bits to the values, its distance from the previous changed unit
  to the gap bytes (``codec``'s ``GAPS`` form). Cost: one read of the live runs and
  of the baseline, writes proportional to the changed units.
* :func:`ungap` turns a ``GAPS`` payload's gap bytes into sorted unit indices (one pass).
* :func:`scatter_runs` writes changed units into a receiver's live tensor through its
  strides (one pass; numpy needs ``unravel_index`` and a sum per dimension).

numba is optional (``pip install nemo-refit-reshard[cpu-delta]``; the ``test`` extra has
it). Without it, :data:`AVAILABLE` is False and ``DeltaOptions(cpu_kernel="auto")`` takes
the numpy path; ``cpu_kernel="numba"`` then refuses by name. GPU messages never come here
(torch ops on the device).
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import numpy as np
import torch

# numba is an extra: the numpy path serves without it. Imported and compiled on first
# use (its import alone is ~0.2 s, which no command that refits densely should pay).
AVAILABLE = importlib.util.find_spec("numba") is not None

CPU_KERNELS = ("auto", "numba", "numpy")
_NP_INTS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
MAX_GAP = 255  # codec.MAX_GAP (kept in step by tests/test_delta_kernels.py)


def use_numba(choice: str) -> bool:
    """Whether delta steps on CPU use these kernels, for ``DeltaOptions.cpu_kernel``."""
    if choice not in CPU_KERNELS:
        raise ValueError(f"delta cpu_kernel={choice!r}: choose one of {list(CPU_KERNELS)}")
    if choice == "numba" and not AVAILABLE:
        raise ValueError(
            "delta cpu_kernel='numba' but numba is not installed: "
            "pip install 'nemo-refit-reshard[cpu-delta]', or choose cpu_kernel='numpy'"
        )
    return AVAILABLE and choice != "numpy"


def np_int(unit: int) -> type:
    """numpy's integer of ``unit`` bytes (a unit's bits, compared and copied as they are)."""
    return _NP_INTS[unit]


def unit_storage(t: torch.Tensor, unit: int) -> np.ndarray:
    """The whole storage of CPU tensor ``t`` as ``unit``-byte integers (a numpy view)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return raw.numpy().view(_NP_INTS[unit])


def rows_of(t: torch.Tensor, unit: int) -> tuple[int, int, int, int] | None:
    """``t`` as rows of contiguous ``unit``-byte units: ``(offset, rows, row_units,
    row_stride)`` in units of its storage; None when its elements are not one uniform
    stride of contiguous rows (a transposed view, a 3-d slice that does not collapse)."""
    width = t.element_size()
    if width % unit or t.numel() == 0:
        return None
    per = width // unit
    shape, strides = list(t.shape), list(t.stride())
    if not shape:
        shape, strides = [1], [1]
    # the innermost dimension must be contiguous; drop size-1 dimensions, then merge the
    # outer dimensions that nest into one uniform stride
    if shape[-1] > 1 and strides[-1] != 1:
        return None
    row_units = shape[-1] * per
    outer = [(n, s) for n, s in zip(shape[:-1], strides[:-1]) if n > 1]
    rows, row_stride = 1, row_units
    if outer:
        rows, row_stride = outer[-1]
        for n, s in reversed(outer[:-1]):
            if s != row_stride * rows:
                return None
            rows *= n
        row_stride *= per
    if rows > 1 and row_stride == row_units:  # rows back to back: one long row
        rows, row_units = 1, rows * row_units
        row_stride = row_units
    return t.storage_offset() * per, rows, row_units, row_stride


# The kernels as Python functions; numba compiles them in _kernels(). Each is written out
# in one function (the tail loop repeats the block loop's body) because that is what
# numba turns into one tight loop.


def _compare_run(
    live, offset, rows, row_units, row_stride, base, start, values, gaps, longs, k, e, prev
):
    """One run's rows; ``k, e, prev``: changed units, long gaps and the last changed
    unit so far (message indices), returned updated. One function, row slices and
    int64 bit positions: what lets LLVM vectorize the mask and keep the state in
    registers (4x faster than helpers or offsets into the whole arrays)."""
    cap = values.shape[0]
    for r in range(rows):
        first = start + r * row_units
        lv = live[offset + r * row_stride : offset + r * row_stride + row_units]
        bv = base[first : first + row_units]
        for b in range(row_units // 64):
            s = b * 64
            mask = np.uint64(0)
            for j in range(64):  # vectorized: one mask bit per unit
                mask |= np.uint64(lv[s + j] != bv[s + j]) << np.uint64(j)
            while mask != 0:
                j = s + np.int64(trailing_zeros(mask))
                mask &= mask - np.uint64(1)
                c = lv[j]
                bv[j] = c
                if k < cap:
                    values[k] = c
                g = first + j - prev
                prev = first + j
                if g > 255:  # MAX_GAP
                    gaps[k] = 0
                    longs[e] = g
                    e += 1
                else:
                    gaps[k] = g
                k += 1
        for j in range(row_units // 64 * 64, row_units):
            c = lv[j]
            if c != bv[j]:
                bv[j] = c
                if k < cap:
                    values[k] = c
                g = first + j - prev
                prev = first + j
                if g > 255:
                    gaps[k] = 0
                    longs[e] = g
                    e += 1
                else:
                    gaps[k] = g
                k += 1
    return k, e, prev


def _ungap(gaps, longs, out):
    """``out`` := the indices of the gap bytes ``gaps`` (long ones from ``longs``);
    returns the long gaps used, -1 if ``longs`` runs out."""
    e, at = 0, -1
    for i in range(gaps.shape[0]):
        g = gaps[i]
        if g == 0:
            if e == longs.shape[0]:
                return -1
            at += longs[e]
            e += 1
        else:
            at += g
        out[i] = at
    return e


def _scatter(live, offset, rows, row_units, row_stride, index, start, values):
    """``live`` (rows of a storage) at row-major positions ``index - start`` :=
    ``values``. The indices are sorted: the row advances, never divides."""
    row_start, at = start, offset
    for t in range(index.shape[0]):
        i = index[t]
        while i >= row_start + row_units:
            row_start += row_units
            at += row_stride
        live[at + i - row_start] = values[t]


def _scatter_gaps(
    live, offset, rows, row_units, row_stride, start, end, gaps, longs, values, t, at, e
):
    """:func:`_ungap` and :func:`_scatter` in one pass, for one run ``[start, end)`` of
    a message: from gap ``t`` (``at``: the unit it reached, ``e``: long gaps used), write
    every changed unit below ``end``; returns the state after them, ``t = -1`` if a
    unit falls before ``start`` (outside every run) or the long gaps run out."""
    row_start, pos = start, offset
    k = gaps.shape[0]
    while t < k:
        g = gaps[t]
        if g == 0 and e == longs.shape[0]:
            return -1, at, e
        nxt = at + (longs[e] if g == 0 else g)
        if nxt >= end:
            break
        if nxt < start:
            return -1, nxt, e
        if g == 0:
            e += 1
        at = nxt
        while at >= row_start + row_units:
            row_start += row_units
            pos += row_stride
        live[pos + at - row_start] = values[t]
        t += 1
    return t, at, e


def trailing_zeros(mask):  # replaced by numba's intrinsic when compiled
    return (int(mask) & -int(mask)).bit_length() - 1


@functools.cache
def _kernels() -> SimpleNamespace:
    """The kernels below compiled (numba's on-disk cache: once per machine)."""
    global trailing_zeros
    from numba import njit
    from numba.cpython.unsafe.numbers import trailing_zeros

    jit = njit(cache=True, nogil=True, boundscheck=False)
    return SimpleNamespace(
        compare_run=jit(_compare_run),
        ungap=jit(_ungap),
        scatter=jit(_scatter),
        scatter_gaps=jit(_scatter_gaps),
    )


def warm(units: set[int]) -> None:
    """Load (or compile) the kernels for messages of these unit sizes now, at plan load,
    so that no refit step pays for it."""
    for unit in sorted(units):
        ints = np.zeros(64, dtype=_NP_INTS[unit])
        gaps, longs = np.zeros(64, dtype=np.uint8), np.zeros(1, dtype=np.uint32)
        compare_runs([(ints, 0, 1, 64, 64, 0)], ints.copy(), ints.copy(), gaps, longs)
        scatter((ints, 0, 1, 64, 64), np.zeros(1, dtype=np.int64), 0, ints[:1].copy())
        scatter_gaps([((ints, 0, 1, 64, 64), 0, 64)], gaps[:1] + 1, longs[:0], ints[:1].copy())
    ungap(np.ones(1, dtype=np.uint8), np.zeros(0, dtype=np.uint32))


def compare_runs(runs, baseline: np.ndarray, values: np.ndarray, gaps: np.ndarray, longs):
    """Compare a message's runs with its ``baseline`` (units) and make the baseline the
    message: ``runs`` = ``(live units, offset, rows, row_units, row_stride, start)`` in
    message order (``start``: the run's first unit in the message). Writes the changed
    units to ``values`` (as many as it holds), one gap byte each to ``gaps`` and the long
    gaps to ``longs`` (``codec``'s ``GAPS`` form); returns ``(k, long gaps)``."""
    k, e, prev = 0, 0, -1
    for live, offset, rows, row_units, row_stride, start in runs:
        k, e, prev = _kernels().compare_run(
            live, offset, rows, row_units, row_stride, baseline, start, values, gaps, longs,
            k, e, prev,
        )  # fmt: skip
    return k, e


def ungap(gaps: np.ndarray, longs: np.ndarray) -> torch.Tensor:
    """Sorted unit indices of ``GAPS`` bytes (int64); raises if the long gaps are not
    exactly the zero bytes' values."""
    if gaps.shape[0] == 0:  # (torch gives a zero-size numpy array stride 0)
        if longs.shape[0]:
            raise ValueError(f"a gaps payload with no gaps has {4 * longs.shape[0]} gap bytes")
        return torch.empty(0, dtype=torch.int64)
    out = np.empty(gaps.shape[0], dtype=np.int64)
    used = _kernels().ungap(gaps, longs, out)
    if used != longs.shape[0]:
        zeros = int(np.count_nonzero(gaps == 0))
        raise ValueError(
            f"a gaps payload with {gaps.shape[0]} gaps, {zeros} of them long, has "
            f"{gaps.shape[0] + 4 * longs.shape[0]} gap bytes, not {gaps.shape[0] + 4 * zeros}"
        )
    return torch.from_numpy(out)


def scatter_gaps(runs, gaps: np.ndarray, longs: np.ndarray, values: np.ndarray) -> None:
    """Apply a ``GAPS`` delta to the runs of a message straight from its gap bytes:
    ``runs`` = ``(target, start, end)`` in message order (``target``:
    :func:`scatter_target`, ``[start, end)`` its units in the message), ``values`` the
    changed units' bits. Raises if a changed unit lies outside every run or past the
    last, or the long gaps are not exactly the zero gap bytes'."""
    t, at, e = 0, -1, 0
    for target, start, end in runs:
        t, at, e = _kernels().scatter_gaps(*target, start, end, gaps, longs, values, t, at, e)
        if t < 0:
            break
    if t != gaps.shape[0] or e != longs.shape[0]:
        raise ValueError(
            f"a gaps payload of {gaps.shape[0]} changed units does not fit its message's runs "
            f"(stopped at unit {at}, gap {t}, long gaps used {e} of {longs.shape[0]})"
        )


def scatter_target(live: torch.Tensor) -> tuple:
    """What :func:`scatter` needs of ``live``: its storage as integers of its width and
    its rows (``rows_of``); ``()`` when it is not rows of one stride (numpy's path)."""
    unit = live.element_size()
    layout = rows_of(live, unit)
    return () if layout is None else (unit_storage(live, unit), *layout)


def scatter(target: tuple, index: np.ndarray, start: int, values: np.ndarray) -> None:
    """Elements at row-major positions ``index - start`` of the tensor ``target``
    describes (:func:`scatter_target`) := ``values`` (their bits as integers of its
    width)."""
    _kernels().scatter(*target, index, start, values)
