"""CUDA tensors over a CPU transport (gloo), through pinned host buffers.

For single-GPU checks, groups that mix CPU and GPU ranks, and debugging: the rank's
program is compiled on its GPU as usual (same plan, same staging views, same
checksums); only the exchange goes through host memory. Per message buffer the
transport keeps one pinned copy in host memory (page-locked when CUDA is present),
made on first use and reused every step — the program's buffers are fixed views, so the set is
finite and at most the rank's staging size. ``start_exchange`` copies the outgoing
buffers to their pinned copies and synchronises the current stream once (gloo reads and
writes host memory from its own threads: the copies into the send copies, and earlier
copies out of the receive copies, must be done), then issues the inner exchange on the
pinned copies; ``wait`` waits for it and queues the copies of the incoming pinned copies
back to the device buffers on the current stream, so the unpacks after them are ordered
on the GPU. This path favours simplicity over speed: it is not the NCCL path.

On CPU tensors the same path runs with plain (unpinned) host copies: the tests exercise
it without a GPU.
"""

from __future__ import annotations

import torch

from .transport import Messages, PendingExchange, Transport


class HostStagedTransport(Transport):
    """Wraps a host transport so that device buffers can be exchanged through it."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.timeout_s = inner.timeout_s
        self._pinned: dict[tuple[int, int, str], torch.Tensor] = {}
        self.staged_bytes = 0  # host memory held by the pinned copies

    def pinned(self, buf: torch.Tensor) -> torch.Tensor:
        """The host buffer that stands for ``buf`` (same size, reused)."""
        key = (buf.data_ptr(), buf.numel(), str(buf.device))
        host = self._pinned.get(key)
        if host is None:
            pin = torch.cuda.is_available()
            host = torch.empty(buf.numel(), dtype=torch.uint8, pin_memory=pin)
            self._pinned[key] = host
            self.staged_bytes += host.numel()
        return host

    def begin_step(self, step: int | None = None) -> int:
        return self.inner.begin_step(step)

    def fail_step(self, err: BaseException) -> None:
        self.inner.fail_step(err)

    def start_exchange(
        self,
        sends: Messages,
        recvs: Messages,
        round_index: int = 0,
    ) -> PendingExchange:
        host_sends = [(peer, self.pinned(buf)) for peer, buf in sends]
        for (_, buf), (_, host) in zip(sends, host_sends):
            host.copy_(buf.view(torch.uint8), non_blocking=True)
        if any(buf.is_cuda for _, buf in [*sends, *recvs]):
            # gloo reads the send copies and overwrites the receive copies from its own
            # threads: the copies into the former, and any earlier copy out of the latter
            # still queued, must be done.
            torch.cuda.current_stream().synchronize()
        host_recvs = [(peer, self.pinned(buf)) for peer, buf in recvs]
        pending = self.inner.start_exchange(host_sends, host_recvs, round_index)
        return _StagedPending(pending, recvs, host_recvs)

    def all_gather_object_str(self, value: str) -> list[str]:
        return self.inner.all_gather_object_str(value)

    def barrier(self) -> None:
        self.inner.barrier()

    def close(self) -> None:
        self.inner.close()


class _StagedPending:
    def __init__(self, inner: PendingExchange, recvs, host_recvs) -> None:
        self.inner, self.recvs, self.host_recvs = inner, recvs, host_recvs

    def wait(self) -> None:
        self.inner.wait()
        for (_, buf), (_, host) in zip(self.recvs, self.host_recvs):
            buf.view(torch.uint8).copy_(host, non_blocking=True)
