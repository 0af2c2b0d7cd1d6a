"""What a refit holds beyond the live weights, per refit-group rank, from the plan alone.

A rank's compiled program (``engine/program.py``) allocates, once, and keeps:

* **staging**: per round its outgoing messages back to back in one send buffer and its
  incoming ones in one receive buffer (each message starting on ``ALIGN`` bytes, an
  outgoing message identical to an earlier one of the round staged once), both sized to
  the largest round; ×2 with ``overlap``. The planner keeps a rank's bytes per round
  within the bucket, so each buffer holds at most ``bucket_bytes`` plus alignment.
* **relay**: two halves, each the largest round's bytes carried for another rank.
* **fp8_scratch** (a block-FP8 receiver): the trained-dtype *shadows* of the e4m3 tensors
  it receives unquantized (``layouts/fp8_wire.py``) live in one scratch buffer, in
  bands of whole block rows, each band in a slot from the first round that writes it to
  the last round that reads it (quantized into the live e4m3 weight and scales at the
  end of its last receiving round: its blocks are whole then); slots whose rounds do
  not overlap share bytes (first fit, in round order). A band's pieces arrive within a
  round or two unless the plan spreads one block row over many rounds, so the scratch
  is about the shadow bytes a rank receives in a round or two, not the whole shadows.

A block-FP8 *sender* holds nothing more: it quantizes each e4m3 piece and its scales
per round straight into that round's send staging (``engine/fp8_rounds.py``).

A colocated plan (``plan/colocation.py``): the training rank allocates its guest's
receive staging (shared with the vLLM worker by a same-device handle), so it is counted
once, at the training rank, and packs what it sends its own guest straight into it (no
send staging for those messages); the guest adds only its scratch.

These are the exact byte counts the engine allocates (``tests/test_fp8_memory.py``
compiles every rank and compares). Not counted: the quantizer's transient working set
(float32 of the largest run, freed as it ends).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..base import DTYPE_BYTES, is_relay
from ..pass6_messages import Message
from .fp8_steps import QuantizeStep

if TYPE_CHECKING:
    from .rank_share import RankPlan
    from .refit_plan import RefitPlan

ALIGN = 16  # message starts in staging (engine/program.py keeps the same value)


def align_up(offset: int) -> int:
    """``offset`` rounded up to ``ALIGN`` bytes."""
    return -(-offset // ALIGN) * ALIGN


@dataclass(frozen=True)
class StagingSizes:
    """Bytes of one send buffer, one receive buffer and one relay half."""

    send: int
    recv: int
    relay_half: int


def staging_sizes(messages: Sequence[Message], group_rank: int, num_rounds: int) -> StagingSizes:
    """The staging a rank's program lays out for ``messages`` (its own, in round order):
    per round, outgoing messages back to back (identical contents once), incoming ones
    back to back, relay arrivals in this round's half; each buffer the largest round."""
    by_round: dict[int, list[Message]] = {}
    for m in messages:
        by_round.setdefault(m.round, []).append(m)
    send = recv = relay = 0
    for r in range(num_rounds):
        shared: set[tuple] = set()
        send_end = recv_end = 0
        relay_end: int | None = None
        for m in by_round.get(r, ()):
            nbytes = sum(t.nbytes for t in m.transfers)
            if m.src == group_rank:
                key = tuple((t.src_tensor, t.src_box, t.dtype) for t in m.transfers)
                if key in shared:
                    continue
                shared.add(key)
                send_end = align_up(send_end) + nbytes
                continue
            recv_end = align_up(recv_end) + nbytes
            for t in m.transfers:
                if is_relay(t.dst_tensor):
                    relay_end = align_up(relay_end or 0) + t.nbytes
        send, recv = max(send, send_end), max(recv, recv_end)
        if relay_end is not None:
            relay = max(relay, align_up(relay_end))
    return StagingSizes(send, recv, relay)


@dataclass(frozen=True)
class ShadowSlot:
    """Rows ``rows`` (whole block rows) of a shadow — of expert ``expert`` for fused
    experts ``[E, rows, cols]`` — in the receiver's scratch, from round ``first`` (its
    first write) to ``last_use``; quantized at the end of round ``last_recv``."""

    step: QuantizeStep
    expert: int | None
    rows: tuple[int, int]
    first: int
    last_recv: int
    last_use: int
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.step.shape[-1])


def _bands(box_offsets: tuple[int, ...], box_sizes: tuple[int, ...], three_d: bool, bm: int):
    """``(expert, block row)`` of every band a box of a shadow touches."""
    experts: Sequence[int | None] = [None]
    if three_d:
        experts = range(box_offsets[0], box_offsets[0] + box_sizes[0])
    r0, nr = box_offsets[-2], box_sizes[-2]
    return [(e, i) for e in experts for i in range(r0 // bm, (r0 + nr - 1) // bm + 1)]


def shadow_slots(
    messages: Sequence[Message],
    steps: Sequence[QuantizeStep],
    group_rank: int,
    block: tuple[int, int] | None,
) -> tuple[tuple[ShadowSlot, ...], int]:
    """The scratch slots of a receiver's shadows (``steps`` without ``source``), and the
    scratch's bytes. A shadow is cut into bands of whole block rows (per expert of fused
    experts); each band lives from the first round that writes it to the last that reads
    it — a block is quantized as soon as all of it has arrived. Consecutive bands of one
    shadow (one expert) with the same rounds form one slot. Slots are placed first fit in
    order of first round, reusing bytes only of slots whose last use came earlier."""
    shadows = {q.weight: q for q in steps if q.source is None}
    if not shadows:
        return (), 0
    assert block is not None, "a plan with shadows names its FP8 block"
    bm = block[0]
    first: dict[tuple, int] = {}
    last_recv: dict[tuple, int] = {}
    last_use: dict[tuple, int] = {}
    for m in messages:
        for t in m.transfers:
            if m.dst == group_rank and t.dst_tensor in shadows:
                name, box, received = t.dst_tensor, t.dst_box, True
            elif m.src == group_rank and t.src_tensor in shadows:  # forwarded on (a chain)
                name, box, received = t.src_tensor, t.src_box, False
            else:
                continue
            three_d = len(shadows[name].shape) == 3
            for e, i in _bands(box.offsets, box.sizes, three_d, bm):
                key = (name, -1 if e is None else e, i)
                if received:
                    first[key] = min(first.get(key, m.round), m.round)
                    last_recv[key] = max(last_recv.get(key, m.round), m.round)
                last_use[key] = max(last_use.get(key, m.round), m.round)
    bands: list[tuple[tuple, int, int, int]] = []  # (key, first, last recv, last use)
    for name, q in sorted(shadows.items()):
        experts = range(q.shape[0]) if len(q.shape) == 3 else [-1]
        for e in experts:
            for i in range(-(-q.shape[-2] // bm)):
                key = (name, e, i)
                if key not in first:
                    raise ValueError(
                        f"refit rank {group_rank} quantizes {name} but receives none of rows "
                        f"{i * bm}+{bm}{'' if e < 0 else f' of expert {e}'}: the plan is "
                        "inconsistent, rebuild it"
                    )
                bands.append((key, first[key], last_recv[key], last_use[key]))
    units: list[tuple[str, int, int, int, int, int, int]] = []  # name, e, i0, i1, rounds
    for (name, e, i), f, lr, lu in bands:
        if (
            units
            and units[-1][:2] == (name, e)
            and units[-1][3] == i
            and units[-1][4:] == (f, lr, lu)
        ):
            units[-1] = (*units[-1][:3], i + 1, f, lr, lu)
        else:
            units.append((name, e, i, i + 1, f, lr, lu))
    live: list[tuple[int, int, int]] = []  # (offset, end, last use)
    slots: list[ShadowSlot] = []
    size = 0
    for name, e, i0, i1, f, lr, lu in sorted(units, key=lambda u: (u[4], u[:3])):
        q = shadows[name]
        rows = (i0 * bm, min(i1 * bm, q.shape[-2]))
        nbytes = align_up((rows[1] - rows[0]) * q.shape[-1] * DTYPE_BYTES[q.dtype])
        live = sorted(a for a in live if a[2] >= f)
        offset = 0
        for start, end, _ in live:
            if offset + nbytes <= start:
                break
            offset = max(offset, end)
        live.append((offset, offset + nbytes, lu))
        expert = None if e < 0 else e
        slots.append(ShadowSlot(q, expert, rows, f, lr, lu, offset, nbytes))
        size = max(size, offset + nbytes)
    return tuple(slots), size


@dataclass(frozen=True)
class RankMemory:
    """What one refit-group rank allocates beyond its live weights (module docstring)."""

    staging: int  # send and receive buffers
    relay: int
    fp8_scratch: int

    @property
    def peak_extra_bytes(self) -> int:
        return self.staging + self.relay + self.fp8_scratch

    def to_json(self) -> dict[str, int]:
        """The total, then every field under its own name."""
        return {"peak_extra_bytes": self.peak_extra_bytes, **asdict(self)}


def rank_memory(plan: RefitPlan | RankPlan, group_rank: int, overlap: bool = False) -> RankMemory:
    """One rank's extra bytes as its program allocates them; a colocated plan's as the
    training rank (its own staging and its guest's receive staging) and the vLLM worker
    (its scratch) allocate them. ``overlap``: two staging sets (separate pools only)."""
    sets = 2 if overlap else 1
    messages = plan.messages_of(group_rank)
    own = staging_sizes(messages, group_rank, plan.num_rounds)
    steps = plan.quantize_steps_of(group_rank)
    _, scratch = shadow_slots(messages, steps, group_rank, plan.fp8_block)
    hosts = plan.colocated_hosts
    if not hosts:
        return RankMemory(sets * (own.send + own.recv), 2 * own.relay_half, scratch)
    if overlap:
        raise ValueError("a colocated refit replays serially: no overlap")
    s = plan.num_sources
    if group_rank >= s:  # the guest: its receive staging is the host's
        return RankMemory(own.send, 2 * own.relay_half, scratch)
    if group_rank not in hosts:
        return RankMemory(own.send + own.recv, 2 * own.relay_half, scratch)
    guest = s + hosts.index(group_rank)
    # what it sends its own guest is packed straight into the guest's receive staging
    sent = [m for m in messages if m.dst != guest]
    own = staging_sizes(sent, group_rank, plan.num_rounds)
    received = staging_sizes(plan.messages_of(guest), guest, plan.num_rounds).recv
    return RankMemory(own.send + own.recv + received, 2 * own.relay_half, scratch)


def memory_report(plan: RefitPlan, overlap: bool = False) -> dict[str, Any]:
    """``plan --json``'s ``memory``: per refit-group rank its extra bytes, the largest,
    and the bound the staging keeps (two buffers of a bucket each, ×2 with overlap)."""
    ranks = [rank_memory(plan, r, overlap) for r in range(plan.num_sources + plan.num_destinations)]
    sets = 2 if overlap else 1
    return {
        "overlap": overlap,
        "peak_extra_bytes": [m.peak_extra_bytes for m in ranks],
        "max_peak_extra_bytes": max((m.peak_extra_bytes for m in ranks), default=0),
        "max_fp8_scratch": max((m.fp8_scratch for m in ranks), default=0),
        "staging_bound": 2 * sets * plan.bucket_bytes,
        "ranks": [m.to_json() for m in ranks],
    }


__all__ = [
    "ALIGN",
    "RankMemory",
    "StagingSizes",
    "ShadowSlot",
    "align_up",
    "memory_report",
    "rank_memory",
    "staging_sizes",
    "shadow_slots",
]
