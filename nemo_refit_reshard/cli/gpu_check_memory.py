"""The device memory ``gpu-check`` holds at once, by arithmetic: what it sizes its buffers by.

Why a module of its own: the check once timed its copy peak on a copy of *every* byte a
rank moves — for DeepSeek-V3's inference rank 0 two 40.9 GiB buffers beside the rank's
own 40.9 GiB of tensors, about 125 GiB, which no 80 GB card holds. The reference copy is
now capped (:data:`REFERENCE_CAP_BYTES`: a copy of 1 GiB already runs at the device's
copy peak), and the check asks :func:`plan_rank_memory` — programs compiled on the meta
device, so nothing is allocated — how much one rank's checks hold before it allocates
any of it; ``tests/test_gpu_check_memory.py`` asks the same function at DeepSeek-V3
scale and holds the answer to an 80 GB card.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..engine.program import TORCH_DTYPES, RankProgram
from ..layouts import RankLayout
from ..plan import RankPlan

GB = 10**9
GIB = 1 << 30
REFERENCE_CAP_BYTES = GIB  # each side of the copy a rate is held to
DIGEST_CHUNK = 1 << 24  # elements per chunk of the bit-exact digest
LOOPBACK_PAD = 4096  # the loopback's receive pattern is this much longer than a message
# Outside torch's caching allocator, never in its counts: the CUDA context, cuBLAS
# workspaces, NCCL's buffers and CuPy's pool (a few hundred MiB each at most).
CONTEXT_RESERVE_BYTES = 2 * GIB
# torch's caching allocator rounds each block up (to 512 B) and carves blocks of 1-10 MiB
# out of shared 20 MiB segments: at most this much lost per tensor, and one segment.
PER_TENSOR_SLACK_BYTES = 2 << 20
SEGMENT_SLACK_BYTES = 20 << 20


def reference_bytes(moved: int) -> int:
    """Bytes on each side of the reference copy a rate over ``moved`` bytes is held to."""
    return min(max(moved, 1 << 20), REFERENCE_CAP_BYTES)


def loopback_bytes(largest_message: int) -> int:
    """The loopback transport's receive pattern and send sink (``engine/loopback.py``)."""
    return 2 * largest_message + LOOPBACK_PAD


def digest_bytes(chunk: int = DIGEST_CHUNK) -> int:
    """The digest's int64 weights, one chunk widened to int64 and their product."""
    return 3 * chunk * 8


def nccl_bytes(sizes_mib: list[int]) -> int:
    """The NCCL section at its largest size: send and receive buffers, and the copy."""
    return max((2 * (n << 20) + 2 * reference_bytes(n << 20) for n in sizes_mib), default=0)


@dataclass(frozen=True)
class RankMemory:
    """What one rank's checks hold at once (bytes): its tensors, both programs' staging
    (serial: one set, overlapped: two), the loopback wire, the reference copy (``reference``
    bytes each side), the digest (inference ranks); ``moved``: what its pack or unpack
    copies, the bytes its rate is over."""

    label: str
    tensors: int
    num_tensors: int
    staging: int
    loopback: int
    reference: int
    digest: int
    moved: int

    @property
    def allocated(self) -> int:
        """Bytes the check allocates through torch's caching allocator, slack included."""
        slack = self.num_tensors * PER_TENSOR_SLACK_BYTES + SEGMENT_SLACK_BYTES
        return (
            self.tensors + slack + self.staging + self.loopback + 2 * self.reference + self.digest
        )

    @property
    def peak(self) -> int:
        """What the device must hold: :attr:`allocated` and the CUDA context beside it."""
        return self.allocated + CONTEXT_RESERVE_BYTES


def _copy_bytes(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(d.numel() * d.element_size() for d, _ in pairs)


def moved_bytes(program: RankProgram, is_source: bool) -> int:
    """Bytes a sender packs or a receiver unpacks over a whole step."""
    return sum(_copy_bytes(p.copies_out if is_source else p.copies_in) for p in program.rounds)


def largest_message(program: RankProgram) -> int:
    return max(b.numel() for b in [*program.send_buffers, *program.recv_buffers])


def rank_memory(
    label: str,
    tensors: Mapping[str, torch.Tensor],
    serial: RankProgram,
    overlapped: RankProgram,
    is_source: bool,
) -> RankMemory:
    """The :class:`RankMemory` of programs compiled on any device (the meta device too)."""
    moved = moved_bytes(serial, is_source)
    return RankMemory(
        label=label,
        tensors=sum(t.numel() * t.element_size() for t in tensors.values()),
        num_tensors=len(tensors),
        staging=serial.staging_bytes + overlapped.staging_bytes,
        loopback=loopback_bytes(largest_message(serial)),
        reference=reference_bytes(moved),
        digest=0 if is_source else digest_bytes(),
        moved=moved,
    )


def empty_tensors(layout: RankLayout, device: torch.device) -> dict[str, torch.Tensor]:
    """A rank's tensors, uninitialised (on the meta device: no memory)."""
    return {
        t.name: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=device)
        for t in layout.tensors
    }


def plan_rank_memory(
    label: str, slice_: RankPlan, rank: int, layout: RankLayout, is_source: bool
) -> RankMemory:
    """What the checks of group rank ``rank`` will hold, from its programs compiled on the
    meta device exactly as the check compiles them on the GPU."""
    meta = torch.device("meta")
    tensors = empty_tensors(layout, meta)
    serial = RankProgram(slice_, rank, tensors, meta)
    overlapped = RankProgram(slice_, rank, tensors, meta, overlap=True)
    return rank_memory(label, tensors, serial, overlapped, is_source)


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:,.1f} GiB"


__all__ = [
    "CONTEXT_RESERVE_BYTES",
    "GB",
    "REFERENCE_CAP_BYTES",
    "RankMemory",
    "nccl_bytes",
    "plan_rank_memory",
    "rank_memory",
    "reference_bytes",
]
