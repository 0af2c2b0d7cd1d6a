"""Compile one rank's share of a plan into pack/unpack programs and replay them.

Compilation binds every transfer to views of the live tensors and of
preallocated staging buffers once; a replay step is then, per round, one
``copy_`` per transfer on the sender (which also casts to the wire dtype, e.g.
fp32 master weights to bf16), one batched exchange, and one ``copy_`` per
transfer on the receiver. Host work per step therefore grows with the number
of transfers and messages, never with the number of elements.

Staging: per round, a rank's outgoing messages are laid out back to back in
one send buffer and its incoming messages in one receive buffer; both are
sized to the largest round and reused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..layouts.base import Box
from ..plan.balance import DTYPE_BYTES
from ..plan.overlap import PlanError
from ..plan.plan import RefitPlan
from ..plan.schedule import Message
from .transport import Transport

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
TORCH_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass
class _RoundProgram:
    copies_out: list[tuple[torch.Tensor, torch.Tensor]]  # (staging view, live view)
    copies_in: list[tuple[torch.Tensor, torch.Tensor]]  # (live view, staging view)
    sends: list[tuple[int, torch.Tensor]]  # (peer group rank, bytes)
    recvs: list[tuple[int, torch.Tensor]]


def check_live_tensors(
    expected: Mapping[str, tuple[tuple[int, ...], str]],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | None,
    who: str,
) -> None:
    """Raise ``PlanError`` listing every live tensor that differs from the plan."""
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
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise PlanError(f"{who}: live tensors do not match the plan:\n  {shown}{more}")


ALIGN = 16  # message starts in staging; keeps every dtype view legal


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _view(buf: torch.Tensor, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]):
    return buf[offset : offset + nbytes].view(TORCH_DTYPES[dtype]).view(shape)


def _staged(messages) -> int:
    end = 0
    for m in messages:
        end = _align(end) + m.nbytes
    return end


class RankProgram:
    """One refit-group rank's compiled share of a plan."""

    def __init__(
        self,
        plan: RefitPlan,
        group_rank: int,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
    ) -> None:
        self.plan = plan
        self.group_rank = group_rank
        self.device = torch.device(device)
        s = plan.num_sources
        self.is_source = group_rank < s
        if self.is_source:
            expected = plan.source_tensors[group_rank]
            who = f"source rank {group_rank}"
        else:
            expected = plan.destination_tensors[group_rank - s]
            who = f"destination rank {group_rank - s}"
        check_live_tensors(expected, tensors, self.device, who)
        messages = plan.messages_of(group_rank)
        by_round: dict[int, list[Message]] = {}
        for m in messages:
            by_round.setdefault(m.round, []).append(m)
        send_size = recv_size = 0
        for msgs in by_round.values():
            send_size = max(send_size, _staged(m for m in msgs if m.src == group_rank))
            recv_size = max(recv_size, _staged(m for m in msgs if m.src != group_rank))
        self.send_buffer = torch.empty(send_size, dtype=torch.uint8, device=self.device)
        self.recv_buffer = torch.empty(recv_size, dtype=torch.uint8, device=self.device)
        self.rounds = [
            self._compile_round(by_round.get(r, []), tensors) for r in range(len(plan.rounds))
        ]
        self.num_transfers = sum(len(m.transfers) for m in messages)
        self.num_messages = len(messages)

    def _compile_round(self, messages: list[Message], tensors: Mapping[str, torch.Tensor]):
        s = self.plan.num_sources
        prog = _RoundProgram([], [], [], [])
        send_off = recv_off = 0
        for m in messages:
            outgoing = m.src == self.group_rank
            buf = self.send_buffer if outgoing else self.recv_buffer
            base = _align(send_off if outgoing else recv_off)
            off = base
            # Merge copies whose live boxes continue each other (e.g. Megatron's
            # [gate; up] rows into vLLM's [gate; up] rows): one copy instead of two.
            runs: list[tuple[str, Box, str, int, int]] = []
            for t in m.transfers:
                name, box = (t.src_tensor, t.src_box) if outgoing else (t.dst_tensor, t.dst_box)
                if runs and runs[-1][0] == name and runs[-1][2] == t.dtype:
                    joined = runs[-1][1].followed_by(box)
                    if joined is not None:
                        runs[-1] = (name, joined, t.dtype, runs[-1][3], runs[-1][4] + t.nbytes)
                        off += t.nbytes
                        continue
                runs.append((name, box, t.dtype, off, t.nbytes))
                off += t.nbytes
            for name, box, dtype, start, nbytes in runs:
                live = tensors[name][box.slices()]
                staged = _view(buf, start, nbytes, dtype, tuple(box.sizes))
                if outgoing:
                    prog.copies_out.append((staged, live))
                else:
                    prog.copies_in.append((live, staged))
            span = buf[base:off]
            if outgoing:
                prog.sends.append((s + m.dst, span))
                send_off = off
            else:
                prog.recvs.append((m.src, span))
                recv_off = off
        return prog

    def replay(self, transport: Transport) -> None:
        """One refit step: pack, exchange, unpack, round by round."""
        with torch.no_grad():
            for prog in self.rounds:
                for staged, live in prog.copies_out:
                    staged.copy_(live)
                if prog.sends or prog.recvs:
                    transport.exchange(prog.sends, prog.recvs)
                for live, staged in prog.copies_in:
                    live.copy_(staged)

    @property
    def staging_bytes(self) -> int:
        return self.send_buffer.numel() + self.recv_buffer.numel()


__all__ = ["DTYPE_BYTES", "RankProgram", "check_live_tensors"]
