"""Block-FP8 quantization bound into a program's rounds, in bounded memory.

Sending (``QuantizeStep.source`` set): a derived e4m3 tensor or scale tensor is never
allocated. Each staged run of one is, at pack time, the quantization of the live
source's blocks it covers, written straight into the send staging: for e4m3 rows
``r0..r1`` of a piece, the rows ``⌊r0/bm⌋·bm .. min(⌈r1/bm⌉·bm, rows)`` are quantized
(``quantize_block_fp8``) and the run's part of them is staged; for scales the same
blocks give their scales. Block FP8 is a function of each block alone
(``layouts/fp8_wire.py``) and every piece starts on a block boundary, so the bytes equal
those of quantizing the whole piece (and the whole canonical weight). The price: a block
whose e4m3 and scale runs travel apart has its ``amax`` computed twice.

Receiving: the trained-dtype shadows live in one scratch buffer, in bands of whole block
rows (per expert of fused experts) at the slots ``plan/result/memory.shadow_slots`` gives
them (the bytes the plan reports); a run is unpacked into the bands it touches. A slot
is filled with NaN as its first round starts (bytes the plan fails to write show after
the step) and quantized into its rows of the live e4m3 weight and scales, in place,
once its last round is unpacked: every block in it is whole then.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..layouts.base import Box
from ..plan.result.fp8_steps import QuantizeStep
from ..plan.result.memory import ShadowSlot, shadow_slots
from .quantize import block_scales, quantize_block_fp8, quantize_into

Job = Callable[[], None]


def _expand(start: int, size: int, block: int, extent: int) -> tuple[int, int]:
    """``[start, start+size)`` widened to whole blocks (the last may end at ``extent``)."""
    lo = start // block * block
    return lo, min(-(-(start + size) // block) * block, extent)


class Fp8Sender:
    """A sending rank's quantization, run by its packs (module docstring)."""

    def __init__(
        self,
        steps: tuple[QuantizeStep, ...],
        block: tuple[int, int],
        live: Mapping[str, torch.Tensor],
    ) -> None:
        self.block = block
        self.live = live
        self.weights: dict[str, QuantizeStep] = {}
        self.scales: dict[str, QuantizeStep] = {}
        for q in steps:
            if q.source is not None and q.box is not None:
                self.weights[q.weight] = q
                self.scales[q.scale] = q

    def binds(self, name: str) -> bool:
        return name in self.weights or name in self.scales

    def _source(self, q: QuantizeStep) -> torch.Tensor:
        assert q.source is not None and q.box is not None
        # the live box as the piece's 2-D shape: a view where the strides allow
        return self.live[q.source][q.box.slices()].reshape(q.shape)

    def job(self, name: str, box: Box, staged: torch.Tensor) -> Job:
        """Stage the run ``box`` of derived tensor ``name`` into ``staged``."""
        bm, bn = self.block
        (r0, c0), (nr, nc) = box.offsets, box.sizes
        if name in self.weights:
            q = self.weights[name]
            rows, cols = q.shape
            er, ec = _expand(r0, nr, bm, rows), _expand(c0, nc, bn, cols)
            trim = (slice(r0 - er[0], r0 - er[0] + nr), slice(c0 - ec[0], c0 - ec[0] + nc))
            dtype = getattr(torch, q.dtype)

            def weight() -> None:
                x = self._source(q)[er[0] : er[1], ec[0] : ec[1]].to(dtype)
                staged.copy_(quantize_block_fp8(x, self.block)[0][trim])

            return weight
        q = self.scales[name]
        rows, cols = q.shape
        er = (r0 * bm, min((r0 + nr) * bm, rows))
        ec = (c0 * bn, min((c0 + nc) * bn, cols))
        dtype = getattr(torch, q.dtype)

        def scale() -> None:
            x = self._source(q)[er[0] : er[1], ec[0] : ec[1]].to(dtype)
            staged.copy_(block_scales(x, self.block))

        return scale


class Fp8Receiver:
    """A receiving rank's shadows in bounded scratch, quantized round by round."""

    def __init__(
        self,
        plan,  # RefitPlan | RankPlan
        group_rank: int,
        block: tuple[int, int],
        live: Mapping[str, torch.Tensor],
        device: torch.device,
    ) -> None:
        self.block = block
        steps = plan.quantize_steps_of(group_rank)
        self.slots, size = shadow_slots(plan.messages_of(group_rank), steps, group_rank, block)
        self.scratch = torch.empty(size, dtype=torch.uint8, device=device)
        self._views: dict[str, list[tuple[ShadowSlot, torch.Tensor]]] = {}
        self._starts: dict[int, list[Job]] = {}
        self._ends: dict[int, list[Job]] = {}
        bm = block[0]
        for slot in self.slots:
            q = slot.step
            dtype = getattr(torch, q.dtype)
            rows, cols = slot.shape
            raw = self.scratch[slot.offset : slot.offset + rows * cols * dtype.itemsize]
            band = raw.view(dtype).view(rows, cols)
            self._views.setdefault(q.weight, []).append((slot, band))
            weight, scale = live[q.weight], live[q.scale]
            if slot.expert is not None:
                weight, scale = weight[slot.expert], scale[slot.expert]
            r0, r1 = slot.rows
            weight, scale = weight[r0:r1], scale[r0 // bm : -(-r1 // bm)]
            self._starts.setdefault(slot.first, []).append(_nan_fill(band))
            self._ends.setdefault(slot.last_recv, []).append(_quantize(band, weight, scale, block))

    def binds(self, name: str) -> bool:
        return name in self._views

    def copies(self, name: str, box: Box, staged: torch.Tensor):
        """``(band part, staged part)`` for each slot of shadow ``name`` that run ``box``
        (staged as ``staged``, of ``box``'s shape) touches."""
        pairs = []
        three_d = len(box.sizes) == 3
        r0, nr = box.offsets[-2], box.sizes[-2]
        c0, nc = box.offsets[-1], box.sizes[-1]
        for slot, band in self._views[name]:
            lo, hi = max(r0, slot.rows[0]), min(r0 + nr, slot.rows[1])
            if lo >= hi:
                continue
            part = band[lo - slot.rows[0] : hi - slot.rows[0], c0 : c0 + nc]
            if three_d:
                e = slot.expert
                assert e is not None
                if not box.offsets[0] <= e < box.offsets[0] + box.sizes[0]:
                    continue
                pairs.append((part, staged[e - box.offsets[0], lo - r0 : hi - r0]))
            else:
                pairs.append((part, staged[lo - r0 : hi - r0]))
        return pairs

    def before_unpack(self, round_index: int) -> list[Job]:
        return self._starts.get(round_index, [])

    def after_unpack(self, round_index: int) -> list[Job]:
        return self._ends.get(round_index, [])

    @property
    def scratch_bytes(self) -> int:
        return self.scratch.numel()


def _nan_fill(shadow: torch.Tensor) -> Job:
    def fill() -> None:
        shadow.fill_(float("nan"))

    return fill


def _quantize(band: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block) -> Job:
    def run() -> None:
        quantize_into(band, weight, scale, block)

    return run


__all__ = ["Fp8Receiver", "Fp8Sender"]
