"""What a delta step needs of a compiled program, per round: each outgoing message's
staging span and its distinct-content key, each incoming message's span and how its
receiver re-packs it from live tensors.

A receiver re-packs a message by running its unpack's copies backwards (live → staged),
for the runs whose bytes its live tensors hold as they arrived: same dtype, and not a
relay buffer (bytes carried on to another rank) or a block-FP8 engine's scratch of BF16
shadows (quantized on arrival; the e4m3 result cannot give the BF16 back). The byte
ranges of the other runs are *fixed*: they travel every step, whatever changed
(``engine/delta/program.py`` marks their units changed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...plan import RankPlan, RefitPlan
from ..program import TORCH_DTYPES, RankProgram
from .codec import check_gap_bytes, put_units, unit_of

_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INTS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
# (sender, round, [(start, end) byte ranges of that message]) as gathered: plain JSON
Fixed = tuple[int, int, list[tuple[int, int]]]


@dataclass
class Outgoing:
    peer: int
    span: torch.Tensor
    unit: int
    key: int  # index of its distinct span (shared by identical replica messages)


DIRECT, REPACK, FIXED = "direct", "repack", "fixed"


@dataclass
class RunIn:
    """One unpack copy of an incoming message: units ``[start, end)`` of the message,
    ``staged`` (its view of the span) into ``live``. How a delta reaches it (``mode``):
    ``DIRECT``, its changed units written straight into ``live`` (one unit per element);
    ``REPACK``, the run re-packed from ``live``, patched, unpacked (elements wider than
    the message's unit); ``FIXED``, its bytes travel whole every step, patched into the
    span and unpacked (a relay buffer, an FP8 engine's BF16 shadow)."""

    start: int
    end: int
    staged: torch.Tensor
    live: torch.Tensor
    mode: str
    # the compiled scatter's view of ``live`` (``delta_kernels.scatter_target``): found once
    target: tuple | None = None


@dataclass
class Incoming:
    peer: int
    span: torch.Tensor
    unit: int
    runs: list[RunIn]  # in staging order

    @property
    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Its unpack's copies, ``(live, staged)``."""
        return [(r.live, r.staged) for r in self.runs]


@dataclass
class Round:
    outgoing: list[Outgoing]
    incoming: list[Incoming]


def compile_rounds(
    program: RankProgram, plan: RefitPlan | RankPlan, local_peer: int | None = None
) -> tuple[list[Round], list[Fixed]]:
    """Every round's messages on the wire (in the order of the phase's sends and
    receives) and the fixed byte ranges of this rank's incoming messages.
    ``local_peer``: a colocated guest's host, whose message is packed into the staging
    (no wire)."""
    me = program.group_rank
    by_round: dict[int, list] = {}
    for m in plan.messages_of(me):
        by_round.setdefault(m.round, []).append(m)
    # Storages told apart by identity (their StorageImpl), not address: the same on any
    # device, fake CUDA included.
    foreign = {program.relay_buffer.untyped_storage()._cdata}
    if program.fp8_receiver is not None:
        foreign.add(program.fp8_receiver.scratch.untyped_storage()._cdata)
    spans: dict[tuple[int, int, int], int] = {}
    rounds, fixed = [], []
    for k, phase in enumerate(program.rounds):
        messages = by_round.get(k, [])
        # (a message packed straight into a co-located receiver's staging: no wire)
        sent = [m for m in messages if m.src == me and (k, m.dst) not in program.local_into]
        received = [m for m in messages if m.dst == me]
        outgoing = []
        for (peer, span), m in zip(phase.sends, sent, strict=True):
            # Identical replica messages of one round share a span; rounds reuse the
            # staging, so the round is part of what makes a message distinct.
            key = spans.setdefault((k, span.storage_offset(), span.numel()), len(spans))
            outgoing.append(Outgoing(peer, span, _unit(m), key))
        incoming = []
        for (peer, span), m in zip(phase.recvs, received, strict=True):
            if local_peer is not None:  # a colocated host holds its guest's messages
                if peer != local_peer:
                    incoming.append(Incoming(peer, span, _unit(m), []))
                continue
            unit, runs = _unit(m), []
            for (live, staged), src in zip(phase.copies_in, phase.copies_in_from):
                if src != peer:
                    continue
                a, b = _range(span, staged)
                if not _repackable(staged, live, foreign):
                    mode = FIXED
                elif staged.element_size() == unit and staged.is_contiguous():
                    mode = DIRECT
                else:
                    mode = REPACK
                runs.append(RunIn(a // unit, -(-b // unit), staged, live, mode))
            ranges = [(r.start * unit, r.end * unit) for r in runs if r.mode == FIXED]
            if ranges:
                fixed.append((peer, k, _merged(ranges, span.numel())))
            incoming.append(Incoming(peer, span, unit, sorted(runs, key=lambda r: r.start)))
        rounds.append(Round(outgoing, incoming))
    return rounds, fixed


def _unit(message) -> int:
    return unit_of([TORCH_DTYPES[t.dtype].itemsize for t in message.transfers])


def _repackable(staged: torch.Tensor, live: torch.Tensor, foreign: set[int]) -> bool:
    return live.dtype == staged.dtype and live.untyped_storage()._cdata not in foreign


def _range(span: torch.Tensor, staged: torch.Tensor) -> tuple[int, int]:
    """The bytes of ``span`` that ``staged`` (a view of the same buffer) covers; the
    whole span when the view is not one contiguous run of bytes."""
    if not staged.is_contiguous():
        return 0, span.numel()
    start = staged.storage_offset() * staged.element_size() - span.storage_offset()
    return start, start + staged.numel() * staged.element_size()


def _merged(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, min(b, size)))
    return out


def place(
    incoming: Incoming, index: torch.Tensor, values: torch.Tensor, compiled: bool = False
) -> None:
    """Apply a decoded delta (``index``: sorted changed units, ``values``: their bytes)
    to the live tensors its message unpacks into, run by run (``RunIn.mode``): only the
    changed elements of a ``DIRECT`` run are written, nothing of the message is copied.
    ``compiled``: CPU ``DIRECT`` runs through ``delta_kernels.scatter`` (one pass)."""
    unit, span = incoming.unit, incoming.span
    # The runs' first units, on the device of the decoded index (a GPU receiver's is on
    # the GPU): searchsorted takes both from one device.
    starts = [r.start for r in incoming.runs] + [span.numel() // unit]
    cuts = torch.searchsorted(index, torch.tensor(starts, device=index.device)).tolist()
    for r, lo, hi in zip(incoming.runs, cuts, cuts[1:]):
        if lo == hi and r.mode != FIXED:
            continue  # nothing of this run changed
        sub, raw = index[lo:hi], values[lo * unit : hi * unit]
        if r.mode == DIRECT:
            if not (compiled and _scatter_compiled(r, sub, raw)):
                _scatter(r.live, sub - r.start, raw)
            continue
        if r.mode == REPACK:
            r.staged.copy_(r.live)
        put_units(span, sub, raw, unit)
        r.live.copy_(r.staged)


def place_gaps(incoming: Incoming, payload: torch.Tensor, count: int) -> bool:
    """A CPU ``GAPS`` payload of ``count`` changed units applied by the compiled kernel
    straight from its gap bytes (no index), when every run of its message is ``DIRECT``
    rows; False (nothing done) where it does not apply."""
    from . import kernels as delta_kernels  # numba loads only where a compiled step runs

    unit, runs = incoming.unit, incoming.runs
    if payload.device.type != "cpu" or not runs or any(r.mode != DIRECT for r in runs):
        return False
    for r in runs:
        if r.target is None:
            r.target = delta_kernels.scatter_target(r.live)
    if not all(r.target for r in runs):
        return False
    raw = payload.numpy()
    values = raw[: count * unit].view(_NP_INTS[unit])
    gaps = raw[count * unit : count * unit + count]
    check_gap_bytes(payload[count * unit :], count, int(np.count_nonzero(gaps == 0)))
    longs = raw[count * unit + count :].copy().view("<u4")
    delta_kernels.scatter_gaps([(r.target, r.start, r.end) for r in runs], gaps, longs, values)
    return True


def _scatter_compiled(run: RunIn, index: torch.Tensor, raw: torch.Tensor) -> bool:
    """:func:`_scatter` through the compiled kernel; False where it does not apply."""
    if run.live.device.type != "cpu":
        return False
    from . import kernels as delta_kernels  # numba loads only where a compiled step runs

    if run.target is None:
        run.target = delta_kernels.scatter_target(run.live)
    if not run.target:
        return False
    values = raw.numpy().view(_NP_INTS[run.live.element_size()])
    delta_kernels.scatter(run.target, index.numpy(), run.start, values)
    return True


def _scatter(live: torch.Tensor, local: torch.Tensor, raw: torch.Tensor) -> None:
    """``live``'s elements at row-major positions ``local`` := ``raw`` (their bytes)."""
    ints = _INTS[live.element_size()]
    if live.device.type != "cpu":
        target = live.view(ints)
        target[torch.unravel_index(local, target.shape)] = raw.clone().view(ints)
        return
    values = raw.numpy().view(_NP_INTS[live.element_size()])
    if live.is_contiguous():
        live.view(ints).view(-1).numpy()[local.numpy()] = values
        return
    # A strided view (a shard's columns of a wider tensor): the elements' offsets in the
    # storage, written through one flat view of it (several times numpy's n-d indexing).
    positions = live.storage_offset() + sum(
        i * stride for i, stride in zip(np.unravel_index(local.numpy(), live.shape), live.stride())
    )
    whole = live.untyped_storage().nbytes() // live.element_size()
    torch.as_strided(live.view(ints), (whole,), (1,), 0).numpy()[positions] = values
