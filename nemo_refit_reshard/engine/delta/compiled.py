"""A CPU sender's delta step through the compiled kernels (``engine/delta/kernels.py``).

The numpy path packs every message, then compares the packed bytes with the baseline in
several passes. Here, a message whose every run is a plain copy of rows of a live tensor
(same dtype, no FP8 quantization) is *direct*: on a delta step the kernel compares those
rows where they live with the baseline and makes the baseline the message, so the
message is never packed — the baseline holds what the staging would (its ``DENSE`` form,
and any other form's values, come from there). Other messages are packed and compared
as one run. The bytes on the wire are the numpy path's, byte for byte
(``tests/test_delta_kernels.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..program import CopyPhase, RankProgram, copy_pairs
from . import kernels as delta_kernels
from .codec import (
    DENSE,
    GAPS,
    choose_form,
    count_long_gaps,
    encode,
    payload_bytes,
    with_ranges,
)
from .rounds import Outgoing

# (live units, offset, rows, row units, row stride, first unit in the message)
Run = tuple[np.ndarray, int, int, int, int, int]


@dataclass
class Changes:
    """What the kernel found in one message of ``unit``-byte units: ``count`` changed,
    ``long_gaps`` of them past ``MAX_GAP``; their gap bytes and long gaps (scratch views
    until :meth:`keep`) and how many of their values it wrote at the payload's front."""

    unit: int
    count: int
    long_gaps: int
    gaps: np.ndarray
    longs: np.ndarray
    values_written: int
    payload: torch.Tensor | None = None  # its GAPS payload, when that is its form
    _index: torch.Tensor | None = None

    def keep(self) -> None:
        """Own copies of the gaps (the scratch is about to be reused)."""
        if self._index is None and not self.gaps.flags.owndata:
            self.gaps, self.longs = self.gaps.copy(), self.longs.copy()

    def index(self) -> torch.Tensor:
        """The sorted changed units (decoded once from the gaps)."""
        if self._index is None:
            self._index = delta_kernels.ungap(self.gaps, self.longs)
        return self._index

    def gaps_payload(self, out: torch.Tensor, unit: int) -> torch.Tensor | None:
        """The ``GAPS`` payload at the front of ``out``, whose values the kernel wrote
        there; None if it could not write them all (the caller encodes from the index)."""
        values, k = self.count * unit, self.count
        if self.values_written < k or values + k + 4 * self.long_gaps > out.numel():
            return None
        raw = out.numpy()
        raw[values : values + k] = self.gaps
        raw[values + k : values + k + 4 * self.long_gaps] = self.longs.view(np.uint8)
        return out[: values + k + 4 * self.long_gaps]


class CompiledSender:
    """Per round, which outgoing messages are direct and how to pack the rest."""

    def __init__(self, program: RankProgram, rounds, baselines: dict[int, torch.Tensor]) -> None:
        self.direct: list[dict[int, list[Run]]] = []
        self.pair_keys: list[list[int | None]] = []  # each copies_out pair's message key
        largest = 1
        for phase, rnd in zip(program.rounds, rounds):
            direct, keys = _direct_runs(phase, rnd.outgoing, baselines)
            self.direct.append(direct)
            self.pair_keys.append(keys)
            largest = max([largest, *(o.span.numel() // o.unit for o in rnd.outgoing)])
        self._gaps = np.empty(largest, dtype=np.uint8)
        self._longs = np.empty(largest // (delta_kernels.MAX_GAP + 1) + 1, dtype=np.uint32)

    def pack(self, k: int, phase: CopyPhase, compared: set[int]) -> None:
        """Round ``k``'s pack, less the direct messages in ``compared`` (the kernel reads
        their runs where they live)."""
        skip = compared & self.direct[k].keys()
        if not skip:
            phase.pack()
            return
        phase.pack_local()
        keys = self.pair_keys[k]
        copy_pairs([pair for pair, key in zip(phase.copies_out, keys) if key not in skip])
        for job in phase.quantize_out:  # (none in a round with direct messages)
            job()

    def is_direct(self, k: int, key: int, packed: bool) -> bool:
        return not packed and key in self.direct[k]

    def encode(
        self,
        o: Outgoing,
        fixed,
        out: torch.Tensor,
        found: dict[int, Changes],
        baseline: torch.Tensor,
    ) -> tuple[int, int, torch.Tensor]:
        """One variant of message ``o`` (``fixed``: the byte ranges its receiver cannot
        re-pack), compared already (:meth:`compare_round`): ``(form, count, payload)``.
        A ``GAPS`` payload is the one built then; any other form is encoded into ``out``
        from the baseline, which holds the message — whole (DENSE) if ``out`` cannot
        hold it."""
        changes, unit, n = found[o.key], o.unit, o.span.numel()
        if not fixed:
            count, long_gaps = changes.count, changes.long_gaps
            form = choose_form(n, unit, count, long_gaps)
            if form == GAPS and changes.payload is not None:
                return form, count, changes.payload
            index = changes.index()
        else:
            index = with_ranges(changes.index(), fixed, unit)
            count, long_gaps = index.numel(), count_long_gaps(index)
            form = choose_form(n, unit, count, long_gaps)
        if payload_bytes(form, n, unit, count, long_gaps) > out.numel():
            form = DENSE
        return form, count, encode(baseline, index, unit, form, out)

    def ahead(
        self, outgoing: list[Outgoing], baselines: dict[int, torch.Tensor], out: torch.Tensor
    ) -> tuple[dict[int, Changes], int]:
        """Round 0's direct messages compared before the step's versions are known
        (while they are gathered; the others are not packed yet): ``(found, bytes of
        out their GAPS payloads take)``. Safe whatever the versions say: the baselines
        then hold the messages, as a dense step leaves them, and a dense message is sent
        from there."""
        found: dict[int, Changes] = {}
        at = self.compare_round(0, outgoing, set(self.direct[0]), baselines, out, False, found, 0)
        return found, at

    def compare_round(
        self,
        k: int,
        outgoing: list[Outgoing],
        keys: set[int],
        baselines: dict[int, torch.Tensor],
        out: torch.Tensor,
        packed: bool,
        found: dict[int, Changes],
        at: int,
    ) -> int:
        """Compare each message of round ``k`` in ``keys`` that ``found`` lacks, before any
        is sent (a direct one is not packed: its DENSE copies go from its baseline), each
        ``GAPS`` payload built at ``out[at:]`` and kept there; returns the next free byte."""
        for o in {o.key: o for o in outgoing if o.key in keys and o.key not in found}.values():
            changes = self.compare_into(k, o, baselines[o.key], out[at:], packed, found)
            if changes.payload is not None:
                at += changes.payload.numel()
        return at

    def compare_into(
        self,
        k: int,
        o: Outgoing,
        baseline: torch.Tensor,
        out: torch.Tensor,
        packed: bool,
        found: dict[int, Changes],
    ) -> Changes:
        """:meth:`compare`, its ``GAPS`` payload finished in ``out`` when that is its
        form; kept in ``found`` (whose earlier entries stop using the scratch)."""
        for earlier in found.values():
            earlier.keep()
        changes = self.compare(k, o, baseline, out, packed)
        if choose_form(o.span.numel(), o.unit, changes.count, changes.long_gaps) == GAPS:
            changes.payload = changes.gaps_payload(out, o.unit)
        found[o.key] = changes
        return changes

    def compare(
        self, k: int, o: Outgoing, baseline: torch.Tensor, out: torch.Tensor, packed: bool
    ) -> Changes:
        """Compare message ``o`` of round ``k`` with its ``baseline``, which then holds
        the message; the changed units' values go to the front of ``out`` (bytes) as far
        as it holds them. ``packed``: the message is in its span (compared as one run)."""
        unit = o.unit
        if self.is_direct(k, o.key, packed):
            runs = self.direct[k][o.key]
        else:
            runs = [_span_run(o.span, unit)]
        units = o.span.numel() // unit
        room = min(units, out.numel() // unit)
        values = out[: room * unit].numpy().view(delta_kernels.np_int(unit))
        base = baseline.numpy().view(delta_kernels.np_int(unit))
        count, long_gaps = delta_kernels.compare_runs(runs, base, values, self._gaps, self._longs)
        return Changes(
            unit, count, long_gaps, self._gaps[:count], self._longs[:long_gaps], min(count, room)
        )


def _span_run(span: torch.Tensor, unit: int) -> Run:
    """A packed message as one run: its span's bytes as ``unit``-byte integers."""
    units = span.numel() // unit
    return span.numpy().view(delta_kernels.np_int(unit)), 0, 1, units, units, 0


def _direct_runs(phase: CopyPhase, outgoing: list[Outgoing], baselines):
    """``({key: runs}, the key of each copies_out pair)`` of a round: the messages whose
    runs the kernel can read where they live (each run a same-dtype copy of rows of a
    live tensor, the runs covering the message exactly, no quantize job in the round)."""
    spans = {o.key: o for o in outgoing if o.key in baselines}
    keys: list[int | None] = []
    runs: dict[int, list[Run]] = {key: [] for key in spans}
    covered = dict.fromkeys(spans, 0)
    bad: set[int] = set()
    for staged, live in phase.copies_out:
        key = next((key for key, o in spans.items() if _inside(staged, o.span)), None)
        keys.append(key)
        if key is None:
            continue
        o = spans[key]
        start = staged.data_ptr() - o.span.data_ptr()
        layout = delta_kernels.rows_of(live, o.unit)
        if (
            live.dtype != staged.dtype
            or live.shape != staged.shape
            or not staged.is_contiguous()
            or layout is None
            or start % o.unit
            or staged.element_size() % o.unit
        ):
            bad.add(key)
            continue
        offset, rows, row_units, row_stride = layout
        storage = delta_kernels.unit_storage(live, o.unit)
        runs[key].append((storage, offset, rows, row_units, row_stride, start // o.unit))
        covered[key] += staged.numel() * staged.element_size()
    if phase.quantize_out:
        bad.update(runs)
    direct = {}
    for key, found in runs.items():
        found.sort(key=lambda run: run[5])
        if key in bad or covered[key] != spans[key].span.numel() or _overlap(found):
            continue
        direct[key] = found
    return direct, keys


def _inside(view: torch.Tensor, span: torch.Tensor) -> bool:
    a = view.data_ptr()
    return span.data_ptr() <= a < span.data_ptr() + span.numel()


def _overlap(runs: list[Run]) -> bool:
    end = 0
    for _, _, rows, row_units, _, start in runs:
        if start < end:
            return True
        end = start + rows * row_units
    return False
