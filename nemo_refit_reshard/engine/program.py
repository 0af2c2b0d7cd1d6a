"""Compile one rank's share of a plan into pack/unpack programs and replay them.

Compilation binds every transfer to views of the live tensors and of
preallocated staging buffers once; a replay step is then, per round, one
``copy_`` per transfer on the sender (which also casts to the wire dtype, e.g.
fp32 master weights to bf16), one batched exchange, and one ``copy_`` per
transfer on the receiver. Host work per step therefore grows with the number
of transfers and messages, never with the number of elements.

Staging: per round, a rank's outgoing messages are laid out back to back in
one send buffer and its incoming messages in one receive buffer; both are
sized to the largest round and reused. With ``overlap`` there are two such
sets, alternating by round, so the next round is packed while this one is on
the wire (``engine/pipeline.py``).

Relay buffer (``plan/pass4_routes/carry.py``): bytes a rank carries for another one
arrive in round ``r`` into one half of a relay buffer and leave from it in round
``r + 1``; the halves alternate, each sized to the largest round's carried bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..layouts.base import Box
from ..plan import DTYPE_BYTES, Message, PlanError, RankPlan, RefitPlan, is_relay
from .fp8_rounds import Fp8Receiver, Fp8Sender
from .phase import CopyGroups, CopyPhase, copy_pairs
from .pipeline import replay_overlapped, replay_serial
from .transport import Transport

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,  # block-FP8 engines' weights (engine/quantize.py)
}
TORCH_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def check_live_tensors(
    expected: Mapping[str, tuple[tuple[int, ...], str]],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | None,
    who: str,
) -> None:
    """Raise ``PlanError`` listing every live tensor that differs from the plan."""
    problems = live_tensor_problems(expected, tensors, device)
    if problems:
        raise PlanError.listing(f"{who}: live tensors do not match the plan", problems)


def live_tensor_problems(
    expected: Mapping[str, tuple[tuple[int, ...], str]],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | None,
) -> list[str]:
    """One line per planned tensor that is missing or differs in shape, dtype or device."""
    problems = []
    for name, (shape, dtype) in sorted(expected.items()):
        t = tensors.get(name)
        if t is None:
            problems.append(f"{name}: missing (the plan expects {list(shape)} {dtype})")
            continue
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name}: shape {list(t.shape)}, the plan expects {list(shape)}")
        if TORCH_DTYPE_NAMES.get(t.dtype) != dtype:
            problems.append(f"{name}: dtype {t.dtype}, the plan expects {dtype}")
        if device is not None and t.device.type != device.type:
            problems.append(f"{name}: on {t.device}, the transport needs {device.type}")
    return problems


ALIGN = 16  # message starts in staging; keeps every dtype view legal


def _touched(entries, outgoing: bool) -> set[str]:
    """Live tensors (or ``@relay``) a round's pack reads (``outgoing``) or unpack writes."""
    return {
        "@relay" if r.relay is not None else r.name
        for out, _peer, _start, _end, runs, _into in entries
        if out == outgoing
        for r in runs
    }


def align_up(offset: int) -> int:
    """``offset`` rounded up to the staging alignment (``ALIGN`` bytes)."""
    return -(-offset // ALIGN) * ALIGN


def byte_view(buf: torch.Tensor, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]):
    """``nbytes`` of a byte buffer from ``offset``, seen as a ``dtype`` tensor of ``shape``."""
    return buf[offset : offset + nbytes].view(TORCH_DTYPES[dtype]).view(shape)


@dataclass(frozen=True)
class _Run:
    """A contiguous staged span copied to/from one live box, or (``relay`` set) to/from
    ``(half, byte offset)`` of the relay buffer."""

    name: str
    box: Box
    dtype: str
    offset: int
    nbytes: int
    relay: tuple[int, int] | None = None


class RankProgram:
    """One refit-group rank's compiled share of a plan."""

    def __init__(
        self,
        plan: RefitPlan | RankPlan,
        group_rank: int,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
        overlap: bool = False,
        make_recv_buffer: Callable[[int], torch.Tensor] | None = None,
        outgoing_into: Mapping[tuple[int, int], torch.Tensor] | None = None,
    ) -> None:
        """``make_recv_buffer(nbytes)``: where incoming messages land, in place of a
        buffer of this program's own (the colocated refit's shared staging,
        ``engine/colocated.py``); without ``overlap`` only. ``outgoing_into[(round,
        dst)]``: the byte span that message is packed straight into, in place of the
        send buffer — its receiver's staging, when the receiver shares the device (the
        colocated host's own worker): it goes on no wire, so it is in no ``sends``."""
        if (make_recv_buffer is not None or outgoing_into) and overlap:
            raise ValueError("an outside receive buffer serves serial replay only")
        self._into = dict(outgoing_into or {})
        self.local_into = frozenset(self._into)  # (round, dst) packed into a local staging
        self.plan = plan
        self.group_rank = group_rank
        self.device = torch.device(device)
        self.overlap = overlap
        s = plan.num_sources
        self.is_source = group_rank < s
        who = (
            f"source rank {group_rank}" if self.is_source else f"destination rank {group_rank - s}"
        )
        check_live_tensors(plan.expected_tensors(group_rank), tensors, self.device, who)
        # Block-FP8 refits (engine/fp8_rounds.py): a sender quantizes each run into its
        # round's staging (no derived copies); a receiver's shadows live in bounded
        # scratch slots (plan/result/memory.py), bound like live tensors.
        steps = plan.quantize_steps_of(group_rank)
        self.fp8_sender: Fp8Sender | None = None
        self.fp8_receiver: Fp8Receiver | None = None
        if steps:
            assert plan.fp8_block is not None
            if self.is_source:
                self.fp8_sender = Fp8Sender(steps, plan.fp8_block, tensors)
            else:
                self.fp8_receiver = Fp8Receiver(
                    plan, group_rank, plan.fp8_block, tensors, self.device
                )
        messages = plan.messages_of(group_rank)
        by_round: dict[int, list[Message]] = {}
        for m in messages:
            by_round.setdefault(m.round, []).append(m)
        self._carried: dict[tuple[str, Box], tuple[int, int]] = {}  # arrived last round
        self._relay_size = 0  # bytes of one relay buffer half
        layouts = [self._layout_round(r, by_round.get(r, []), who) for r in range(plan.num_rounds)]
        send_size = max((lay[1] for lay in layouts), default=0)
        recv_size = max((lay[2] for lay in layouts), default=0)
        sets = 2 if overlap else 1
        self.send_buffers = [
            torch.empty(send_size, dtype=torch.uint8, device=self.device) for _ in range(sets)
        ]
        self.recv_buffers = [
            torch.empty(recv_size, dtype=torch.uint8, device=self.device)
            if make_recv_buffer is None
            else make_recv_buffer(recv_size)
            for _ in range(sets)
        ]
        self.relay_buffer = torch.empty(2 * self._relay_size, dtype=torch.uint8, device=self.device)
        self.rounds = [self._bind(lay[0], tensors, k % sets) for k, lay in enumerate(layouts)]
        if self.fp8_receiver is not None:
            for k, phase in enumerate(self.rounds):
                phase.before_in += self.fp8_receiver.before_unpack(k)
                phase.after_in += self.fp8_receiver.after_unpack(k)
        # Bytes a rank forwards (carried in its relay buffer, or relayed on from its own
        # live tensors along an inference chain) were unpacked the round before: that
        # round's unpack must precede this round's pack (engine/pipeline.py).
        for k in range(1, len(layouts)):
            self.rounds[k].reads_previous = bool(
                _touched(layouts[k][0], True) & _touched(layouts[k - 1][0], False)
            )
        self.num_transfers = sum(len(m.transfers) for m in messages)
        self.num_messages = len(messages)
        self.num_copies = sum(
            len(r.copies_out) + len(r.local_out) + len(r.copies_in) for r in self.rounds
        )
        # Grouped now, so that the first step pays nothing for it; reported per round.
        self.launches_per_round = [phase.launches for phase in self.rounds]

    def _runs(
        self, m: Message, outgoing: bool, start: int, carried: dict, arriving: dict, who: str
    ) -> tuple[list[_Run], int]:
        """Staged runs of one message from byte ``start``; adjacent live boxes merged
        (e.g. Megatron's [gate; up] rows into vLLM's [gate; up] rows: one copy).
        Carried bytes (relay buffer names) get their own runs: arriving ones a place in
        this round's half (``arriving``), leaving ones the place they arrived at in the
        previous round (``carried``)."""
        runs: list[_Run] = []
        off = start
        for t in m.transfers:
            name, box = (t.src_tensor, t.src_box) if outgoing else (t.dst_tensor, t.dst_box)
            if is_relay(name):
                if outgoing:
                    at = carried.get((name, box))
                    if at is None:
                        raise PlanError(
                            f"{who}: round {m.round} sends {t.canonical}{list(box.sizes)} "
                            f"from its relay buffer ({name}) but did not receive it in "
                            f"round {m.round - 1}; the plan is inconsistent, rebuild it"
                        )
                else:
                    half, end = arriving.setdefault("@end", (m.round % 2, 0))
                    at = (half, align_up(end))
                    arriving[(name, box)] = at
                    arriving["@end"] = (half, at[1] + t.nbytes)
                runs.append(_Run(name, box, t.dtype, off, t.nbytes, at))
                off += t.nbytes
                continue
            last = runs[-1] if runs else None
            if last and last.relay is None and last.name == name and last.dtype == t.dtype:
                joined = last.box.followed_by(box)
                if joined is not None:
                    runs[-1] = _Run(name, joined, t.dtype, last.offset, last.nbytes + t.nbytes)
                    off += t.nbytes
                    continue
            runs.append(_Run(name, box, t.dtype, off, t.nbytes))
            off += t.nbytes
        return runs, off

    def _layout_round(self, round_index: int, messages: list[Message], who: str):
        """Byte offsets of one round's messages in the staging buffers.

        Outgoing messages with identical contents (the same source boxes in the same
        order, as when several inference replicas need the same slice) share one
        staged copy: packed once, sent to each peer.
        """
        # outgoing, peer, start, end, runs, the outside span it is packed into (or None)
        entries: list[tuple[bool, int, int, int, list[_Run], torch.Tensor | None]] = []
        shared: dict[tuple, tuple[int, int]] = {}
        send_end = recv_end = 0
        arriving: dict = {}
        for m in messages:
            into = self._into.get((round_index, m.dst)) if m.src == self.group_rank else None
            if into is not None:  # packed straight into its receiver's staging
                runs, end = self._runs(m, True, 0, self._carried, arriving, who)
                if end != into.numel():
                    raise PlanError(
                        f"{who}: round {round_index}'s message to rank {m.dst} is {end} bytes, "
                        f"its receiver's staging span {into.numel()}: the two sides compiled "
                        "different plans"
                    )
                entries.append((True, m.dst, 0, end, runs, into))
            elif m.src == self.group_rank:
                key = tuple((t.src_tensor, t.src_box, t.dtype) for t in m.transfers)
                if key in shared:
                    start, end = shared[key]
                    entries.append((True, m.dst, start, end, [], None))
                    continue
                runs, end = self._runs(m, True, align_up(send_end), self._carried, arriving, who)
                shared[key] = (align_up(send_end), end)
                entries.append((True, m.dst, align_up(send_end), end, runs, None))
                send_end = end
            else:
                runs, end = self._runs(m, False, align_up(recv_end), self._carried, arriving, who)
                entries.append((False, m.src, align_up(recv_end), end, runs, None))
                recv_end = end
        if "@end" in arriving:
            self._relay_size = max(self._relay_size, align_up(arriving.pop("@end")[1]))
        self._carried = arriving
        return entries, send_end, recv_end

    def _bind(self, layout, tensors: Mapping[str, torch.Tensor], staging: int) -> CopyPhase:
        phase = CopyPhase()
        for outgoing, peer, start, end, runs, into in layout:
            buf = (self.send_buffers if outgoing else self.recv_buffers)[staging]
            if into is not None:
                buf = into
            for r in runs:
                out = phase.copies_out if into is None else phase.local_out
                if r.relay is None and self.fp8_sender and self.fp8_sender.binds(r.name):
                    staged = byte_view(buf, r.offset, r.nbytes, r.dtype, tuple(r.box.sizes))
                    jobs = phase.quantize_out if into is None else phase.local_quantize_out
                    jobs.append(self.fp8_sender.job(r.name, r.box, staged))
                    continue
                if r.relay is None and self.fp8_receiver and self.fp8_receiver.binds(r.name):
                    staged = byte_view(buf, r.offset, r.nbytes, r.dtype, tuple(r.box.sizes))
                    pairs = self.fp8_receiver.copies(r.name, r.box, staged)
                    if outgoing:  # forwarded on from a shadow (an inference chain)
                        out += [(s, band) for band, s in pairs]
                    else:
                        phase.copies_in += pairs
                        phase.copies_in_from += [peer] * len(pairs)
                    continue
                if r.relay is None:
                    live = tensors[r.name][r.box.slices()]
                else:
                    half, at = r.relay
                    base = half * self._relay_size + at
                    live = byte_view(self.relay_buffer, base, r.nbytes, r.dtype, tuple(r.box.sizes))
                staged = byte_view(buf, r.offset, r.nbytes, r.dtype, tuple(r.box.sizes))
                if outgoing:
                    out.append((staged, live))
                else:
                    phase.copies_in.append((live, staged))
                    phase.copies_in_from.append(peer)
            if into is None:  # a span packed into its receiver's staging crosses no wire
                (phase.sends if outgoing else phase.recvs).append((peer, buf[start:end]))
        return phase

    def replay(self, transport: Transport) -> None:
        """One refit step: pack, exchange, unpack, round by round — overlapped across
        rounds when compiled with ``overlap`` — between :meth:`prepare` and
        :meth:`finish`."""
        with torch.no_grad():
            self.prepare()
            if self.overlap:
                replay_overlapped(self.rounds, transport)
            else:
                replay_serial(self.rounds, transport)
            self.finish()

    def prepare(self) -> None:
        """Before a step's rounds: nothing now (a block-FP8 sender quantizes in its
        packs, a receiver after the unpack of each shadow's last round); kept for callers."""

    def finish(self) -> None:
        """After a step's rounds: nothing now (see :meth:`prepare`)."""

    @property
    def staging_bytes(self) -> int:
        buffers = [*self.send_buffers, *self.recv_buffers, self.relay_buffer]
        return sum(b.numel() for b in buffers)


__all__ = [
    "DTYPE_BYTES",
    "CopyGroups",
    "CopyPhase",
    "RankProgram",
    "check_live_tensors",
    "copy_pairs",
]
