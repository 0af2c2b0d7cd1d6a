"""One exchange of a compiled program and the copies around it (:class:`CopyPhase`), and
how those copies are batched for ``torch._foreach_copy_`` (:class:`CopyGroups`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .transport import Transport


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)`` (casting where the dtypes differ), as
    few launches as :class:`CopyGroups` makes of them: for lists made per step (a delta
    step's dense messages, a colocated guest's unpack); a compiled phase keeps its
    groups instead (:meth:`CopyPhase._grouped`)."""
    if pairs:
        CopyGroups.of(pairs).run()


def _copy_each(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One ``_foreach_copy_`` over ``pairs``: its per-pair path when any pair is not fast."""
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


# Tensors one multi-tensor launch of a two-list op takes before ATen starts another:
# 64 before CUDA 13 (its kernel-argument space), more after it; counted at the lower.
TENSORS_PER_LAUNCH = 64
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fast(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``_foreach_copy_`` can take ``(dst, src)`` on its multi-tensor path: same
    dtype and device, same shape, both dense (contiguous) — what ATen's
    ``can_use_fast_route`` asks of every pair of a list."""
    return (
        dst.dtype == src.dtype
        and dst.device == src.device
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    )


@dataclass
class CopyGroups:
    """A list of copies split once, at compile time, into what ``_foreach_copy_`` runs
    fast: on a GPU a list takes the multi-tensor path (one launch per ~100 tensors) only
    when *every* pair qualifies (:func:`_fast`), so one cast or strided pair sends the
    whole list down the per-pair path (one launch per pair: 19,258 copies a step on a
    DeepSeek-V3 inference rank, ~100 ms of host dispatch against ~25 ms of HBM traffic).
    Here each ``(itemsize, device)`` of fast pairs is one list, and the rest one list of
    their own. Order within a phase does not matter: the destinations are disjoint.

    A fast list copies the pairs as integers of their width: the multi-tensor kernel
    loads through a float ``opmath`` type, which on a GPU would turn every BF16/FP16 NaN
    into the canonical one; an integer copy moves the bits, as ``copy_`` does."""

    fast: list[tuple[list[torch.Tensor], list[torch.Tensor]]]
    rest: list[tuple[torch.Tensor, torch.Tensor]]
    source: list[tuple[torch.Tensor, torch.Tensor]]  # the list grouped
    size: int  # its length then (a list replaced, or grown since, is grouped again)

    @classmethod
    def of(cls, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> CopyGroups:
        fast: dict[tuple[int, torch.device], tuple[list, list]] = {}
        rest = []
        for d, s in pairs:
            if _fast(d, s):
                bits = _INT_OF_WIDTH[d.element_size()]
                dsts, srcs = fast.setdefault((d.element_size(), d.device), ([], []))
                dsts.append(d.view(bits))
                srcs.append(s.view(bits))
            else:
                rest.append((d, s))
        return cls(list(fast.values()), rest, pairs, len(pairs))

    def run(self) -> None:
        for dsts, srcs in self.fast:
            torch._foreach_copy_(dsts, srcs)
        _copy_each(self.rest)

    @property
    def launches(self) -> int:
        """Kernel launches on a GPU, at most: one per :data:`TENSORS_PER_LAUNCH` tensors of
        a fast list, one per other pair."""
        return sum(-(-len(d) // TENSORS_PER_LAUNCH) for d, _ in self.fast) + len(self.rest)


@dataclass
class CopyPhase:
    """One exchange with the copies around it: pack, send/receive, unpack.

    Copies run through ``torch._foreach_copy_``, each list split once into the groups its
    multi-tensor path takes (:class:`CopyGroups`); views were bound at compile time.
    """

    copies_out: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    copies_in: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    copies_in_from: list[int] = field(default_factory=list)  # the sender of each copies_in
    # Packed straight into a co-located receiver's staging (``outgoing_into``): no wire.
    local_out: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    local_quantize_out: list[Callable[[], None]] = field(default_factory=list)
    sends: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (peer, bytes)
    recvs: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    reads_previous: bool = False  # pack reads what the previous round's unpack writes
    # Block FP8 (engine/fp8_rounds.py): runs quantized straight into the send staging;
    # shadows' scratch slots opened before the unpack and quantized after it.
    quantize_out: list[Callable[[], None]] = field(default_factory=list)
    before_in: list[Callable[[], None]] = field(default_factory=list)
    after_in: list[Callable[[], None]] = field(default_factory=list)
    _groups: dict[str, CopyGroups] = field(default_factory=dict, repr=False)

    def pack(self) -> None:
        self.pack_local()
        self.pack_wire()

    def _grouped(self, name: str) -> CopyGroups:
        """The copies of list ``name`` grouped for ``_foreach_copy_`` (:class:`CopyGroups`):
        once, at the end of compilation; again only for a list replaced or appended to
        since (compilation and rebinding do that; nothing edits a list's pairs in place)."""
        pairs = getattr(self, name)
        groups = self._groups.get(name)
        if groups is None or groups.source is not pairs or groups.size != len(pairs):
            groups = self._groups[name] = CopyGroups.of(pairs)
        return groups

    def pack_local(self) -> None:
        """What goes to a receiver on this device, into its staging."""
        self._grouped("local_out").run()
        for job in self.local_quantize_out:
            job()

    def pack_wire(self) -> None:
        """What goes on the wire, into the send buffer."""
        self._grouped("copies_out").run()
        for job in self.quantize_out:
            job()

    def unpack(self) -> None:
        for job in self.before_in:
            job()
        self._grouped("copies_in").run()
        for job in self.after_in:
            job()

    @property
    def launches(self) -> int:
        """Copy kernel launches of this phase on a GPU (pack and unpack), as grouped; the
        FP8 quantize jobs come on top."""
        names = ("local_out", "copies_out", "copies_in")
        return sum(self._grouped(n).launches for n in names)

    def run(self, transport: Transport, round_index: int = 0) -> None:
        self.pack()
        if self.sends or self.recvs:
            transport.exchange(self.sends, self.recvs, round_index)
        self.unpack()
