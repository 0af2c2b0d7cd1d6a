"""Compiled replay of the gather-broadcast baseline (``plan/analysis/baseline.py``).

Same discipline as the reshard engine — views bound once, one batched exchange
per phase, one message per peer pair per phase — so timing differences come
from the bytes each design moves, not from host overhead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch

from ..layouts.base import Box
from ..plan import BroadcastPlan, BroadcastStep
from .program import TORCH_DTYPES, CopyPhase, align_up, byte_view
from .quantize import Fp8Steps
from .transport import Transport


class _Spans:
    """Lays out byte spans back to back (aligned) in one growing buffer."""

    def __init__(self) -> None:
        self.size = 0

    def take(self, nbytes: int) -> int:
        start = align_up(self.size)
        self.size = start + nbytes
        return start


class BroadcastProgram:
    """One refit-group rank's share of a :class:`BroadcastPlan`."""

    def __init__(
        self,
        plan: BroadcastPlan,
        group_rank: int,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
    ) -> None:
        self.plan = plan
        self.rank = group_rank
        self.device = torch.device(device)
        # Into a block-FP8 engine: shadows this rank receives into and quantizes after.
        self.fp8: Fp8Steps | None = None
        d = group_rank - plan.num_sources
        if d >= 0 and plan.quantize_steps and plan.quantize_steps[d]:
            assert plan.fp8_block is not None
            self.fp8 = Fp8Steps(plan.quantize_steps[d], plan.fp8_block, tensors, self.device)
            tensors = {**tensors, **self.fp8.tensors}
        self.tensors = tensors
        self.phases: list[CopyPhase] = []
        for steps in plan.rounds:
            self.phases += self._compile_round(steps)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _compile_round(self, steps: tuple[BroadcastStep, ...]) -> list[CopyPhase]:
        s, me, t = self.plan.num_sources, self.rank, self.tensors
        full_spans, full_off = _Spans(), {}
        for st in steps:
            if st.root == me:
                full_off[st.canonical] = full_spans.take(st.nbytes)
        full = self._alloc(full_spans.size)

        def full_view(st: BroadcastStep) -> torch.Tensor:
            return byte_view(full, full_off[st.canonical], st.nbytes, st.dtype, st.shape)

        # Phase 1: gather to the roots.
        gather = CopyPhase()
        out_by_root: dict[int, list] = defaultdict(list)
        in_by_holder: dict[int, list] = defaultdict(list)
        for st in steps:
            for holder, name, box, cbox in st.gathers:
                if holder == me and st.root == me:
                    gather.copies_in.append(
                        (full_view(st)[cbox.slices()], t[name][box.slices()].view(cbox.sizes))
                    )
                elif holder == me:
                    out_by_root[st.root].append((st, name, box, cbox))
                elif st.root == me:
                    in_by_holder[holder].append((st, cbox))
        self._pack(
            gather, out_by_root, lambda item: t[item[1]][item[2].slices()], lambda item: item[3]
        )
        self._unpack(gather, in_by_holder, lambda item: full_view(item[0])[item[1].slices()])

        # Phase 2: broadcast whole tensors from the roots to every reader.
        bcast = CopyPhase()
        out_by_reader: dict[int, list] = defaultdict(list)
        in_by_root: dict[int, list] = defaultdict(list)
        for st in steps:
            for dst, pieces in st.readers:
                if st.root == me:
                    out_by_reader[s + dst].append(st)
                if s + dst == me:
                    in_by_root[st.root].append((st, pieces))
        self._pack(bcast, out_by_reader, full_view, lambda st: Box.full(st.shape))
        # One message per root: the whole tensors this rank reads from it, back to back.
        spans, recv_views, ranges = _Spans(), [], []
        for root in sorted(in_by_root):
            start = spans.take(0)
            for st, pieces in in_by_root[root]:
                recv_views.append((spans.take(st.nbytes), st, pieces))
            ranges.append((root, start, spans.size))
        buf = self._alloc(spans.size)
        for root, start, end in ranges:
            bcast.recvs.append((root, buf[start:end]))
        for off, st, pieces in recv_views:
            whole = byte_view(buf, off, st.nbytes, st.dtype, st.shape)
            for name, local_box, cbox in pieces:
                dst_view = t[name][local_box.slices()]
                # .view (never .reshape): a copy made here would freeze the data at compile time
                bcast.copies_in.append((dst_view, whole[cbox.slices()].view(dst_view.shape)))
        return [gather, bcast]

    def _pack(self, phase: CopyPhase, by_peer: dict, source, cbox_of) -> None:
        """One message per peer: each item's canonical box, packed back to back."""
        messages, views = self._messages(by_peer, cbox_of, source)
        phase.sends += messages
        phase.copies_out += [(packed, live) for packed, live in views]

    def _unpack(self, phase: CopyPhase, by_peer: dict, target) -> None:
        """Receive one message per peer and copy each item into its target view."""
        messages, views = self._messages(by_peer, lambda item: item[1], target)
        phase.recvs += messages
        phase.copies_in += [(live, packed) for packed, live in views]

    def _messages(self, by_peer: dict, cbox_of, live_of) -> tuple[list, list]:
        """Lay ``by_peer``'s items out in one buffer, one message per peer in peer order:
        the ``(peer, message)`` pairs and each item's ``(packed view, live view)``."""
        spans, items, ranges = _Spans(), [], []
        for peer in sorted(by_peer):
            start = spans.take(0)
            for item in by_peer[peer]:
                st = item[0] if isinstance(item, tuple) else item
                nbytes = cbox_of(item).numel * TORCH_DTYPES[st.dtype].itemsize
                items.append((spans.take(nbytes), nbytes, st.dtype, live_of(item)))
            ranges.append((peer, start, spans.size))
        buf = self._alloc(spans.size)
        messages = [(peer, buf[start:end]) for peer, start, end in ranges]
        views = [
            (byte_view(buf, off, nbytes, dtype, tuple(live.shape)), live)
            for off, nbytes, dtype, live in items
        ]
        return messages, views

    def replay(self, transport: Transport) -> None:
        with torch.no_grad():
            for k, phase in enumerate(self.phases):  # the same phases on every rank
                phase.run(transport, k)
            if self.fp8 is not None:
                self.fp8.run()
