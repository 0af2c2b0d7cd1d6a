"""CUDA tensors over a CPU transport (gloo), through pinned host buffers.

For single-GPU checks, groups that mix CPU and GPU ranks, and debugging: the rank's
program is compiled on its GPU as usual (same plan, same staging views, same
checksums); only the exchange goes through host memory. Every message buffer is a view
of one of the program's few staging buffers, so the transport keeps one host *mirror per
staging storage* (page-locked when the buffer is on a GPU), made on first use and reused
every step, and stands each message for the same byte range of its mirror: the host
memory held is the staging size, whatever the number of messages (keyed per message
instead, a DeepSeek-V3 inference rank's 1,758 spans pinned 39.6 GiB against 1 GiB of
staging; a buffer of a storage under :data:`MIRROR_MIN_BYTES`, such as a delta step's
headers made anew each round, gets host bytes of its own for the one exchange).
``start_exchange`` copies the outgoing buffers to their mirrors and
synchronises the current stream of each buffer's own GPU once (gloo reads and writes
host memory from its own threads: the copies into the send ranges, and earlier copies
out of the receive ranges, must be done; the device is the buffer's, never the calling
thread's current one: a thread-pool thread's is GPU 0), then issues the inner exchange
on the mirrors' ranges; ``wait`` waits for it and queues the copies of the incoming
ranges back to the device buffers on the current stream, so the unpacks after them are
ordered on the GPU. This path favours simplicity over speed: it is not the NCCL path.

On CPU tensors the same path runs with plain (unpinned) host copies: the tests exercise
it without a GPU.
"""

from __future__ import annotations

import torch

from .transport import Messages, PendingExchange, Transport

MIRROR_MIN_BYTES = 1 << 16  # a storage this large or larger gets a mirror kept across steps


class HostStagedTransport(Transport):
    """Wraps a host transport so that device buffers can be exchanged through it."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.timeout_s = inner.timeout_s
        self._mirrors: dict[tuple[str, int], torch.Tensor] = {}
        self.staged_bytes = 0  # host memory held by the mirrors

    def pinned(self, buf: torch.Tensor) -> torch.Tensor:
        """The host bytes that stand for ``buf``: its range of the mirror of its storage,
        or, for a buffer of a small storage, host bytes of its own for this exchange."""
        storage = buf.untyped_storage()
        nbytes = buf.numel() * buf.element_size()
        # A meta buffer (sizing a rank at scale) gets meta bytes: no memory.
        host = "meta" if buf.device.type == "meta" else "cpu"
        pin = buf.device.type == "cuda"
        if storage.nbytes() < MIRROR_MIN_BYTES:
            # Small storages are made anew each round (a delta step's 32-byte headers):
            # mirrored, they would pile up one per address ever used.
            return torch.empty(nbytes, dtype=torch.uint8, device=host, pin_memory=pin)
        # The storage's identity (its StorageImpl, as torch.multiprocessing keys storages)
        # and size: the staging and the delta scratch, made once per program.
        key = (str(buf.device), storage._cdata, storage.nbytes())
        mirror = self._mirrors.get(key)
        if mirror is None:
            mirror = torch.empty(storage.nbytes(), dtype=torch.uint8, device=host, pin_memory=pin)
            self._mirrors[key] = mirror
            self.staged_bytes += mirror.numel()
        start = buf.storage_offset() * buf.element_size()
        return mirror[start : start + nbytes]

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
        # gloo reads the send copies and overwrites the receive copies from its own
        # threads: the copies into the former, and any earlier copy out of the latter
        # still queued, must be done — on each buffer's own GPU.
        for device in {buf.device for _, buf in [*sends, *recvs] if buf.is_cuda}:
            torch.cuda.current_stream(device).synchronize()
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
