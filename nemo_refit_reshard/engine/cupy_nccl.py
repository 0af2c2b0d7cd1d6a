"""CuPy NCCL transport: one NCCL communicator spanning training and inference GPUs.

The NCCL unique id is created by refit rank 0 and shared through the same
``TCPStore`` rendezvous the gloo transport uses, so processes that already run
their own ``torch.distributed`` worlds can join without touching them. Each
round's sends and receives are issued inside one ``ncclGroupStart/End`` on a
dedicated CUDA stream; buffers are byte tensors, so bf16/fp8 travel as bytes.

Ordering is by CUDA events, not host synchronisation: ``start_exchange`` makes the
NCCL stream wait for everything queued so far on torch's current stream (the packs,
and the unpack that last read the receive buffers) and records a completion event
after the group; ``wait`` polls that event against ``timeout_s`` (on timeout the
communicator is aborted and :class:`TransportError` raised, so a dead peer cannot
hang a rank) and makes torch's stream wait on it before the unpacks are queued.

Step identity without tags. NCCL matches a pair's point-to-point messages in the
order they were issued on the communicator, and has no tags; the bytes on the wire are
exactly the staging spans (no header). What keeps a message of a failed step from
pairing with a later step is the communicator itself: any failure on a rank — a
timeout here, or an error of the step reported with ``fail_step`` (a pack that raised,
a check that failed) — aborts this rank's communicator, so nothing it issued can still
land, and every later step, barrier and gather is refused with ``GroupUnusableError``
naming the failed step (``engine/transport.py``'s ``StepGuard``). Its peers, waiting
for it, time out and abort theirs within ``timeout_s``. The group is thus poisoned on
every rank after any failure, and is re-joined (a new communicator) before the next
refit.

CuPy is imported lazily: importing this module never needs a GPU.
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from .rendezvous import refit_store
from .transport import (
    DEFAULT_TIMEOUT_S,
    Messages,
    StepGuard,
    Transport,
    TransportError,
    first_line,
)


def cupy_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - any import or driver failure means "not available"
        return False


class _PendingNccl:
    def __init__(self, transport: CupyNcclTransport, done: torch.cuda.Event, round_index: int):
        self.transport, self.done, self.round_index = transport, done, round_index

    def wait(self) -> None:
        self.transport._poll(self.done, self.round_index)


class CupyNcclTransport(Transport):
    """NCCL point-to-point over CuPy for CUDA byte tensors."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        prefix: str = "refit-nccl",
        store: dist.Store | None = None,
        connect_timeout_s: float | None = None,
        secret: str | None = None,
    ) -> None:
        if not cupy_available():
            raise TransportError(
                "the cupy-nccl transport needs CUDA and CuPy (pip install cupy-cuda12x); "
                "use the gloo transport on CPU"
            )
        import cupy
        from cupy.cuda import nccl

        self._nccl = nccl
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._gathers = 0
        self.guard = StepGuard(rank)
        self._aborted = False
        self.device = torch.device(
            "cuda", device if device is not None else torch.cuda.current_device()
        )
        if store is None:
            store = refit_store(
                host, port, rank, world_size, connect_timeout_s or timeout_s, secret
            )
        self.store = dist.PrefixStore(prefix, store)
        if rank == 0:
            self.store.set("uid", json.dumps(list(nccl.get_unique_id())))
        uid = tuple(json.loads(self.store.get("uid").decode()))
        with cupy.cuda.Device(self.device.index):
            self.stream = cupy.cuda.Stream(non_blocking=True)
            # The same stream as torch sees it, for torch's CUDA events.
            self._torch_stream = torch.cuda.ExternalStream(self.stream.ptr, device=self.device)
            try:
                self.comm = nccl.NcclCommunicator(world_size, uid, rank)
            except Exception as err:  # noqa: BLE001 - NCCL errors have several types
                raise TransportError(
                    f"refit rank {rank}: NCCL init failed ({first_line(err)})"
                ) from err

    def begin_step(self, step: int | None = None) -> int:
        return self.guard.begin(step)

    def fail_step(self, err: BaseException) -> None:
        """Poison the group on this rank: abort the communicator (what this rank issued
        in the failed step can no longer land anywhere) and refuse every later step."""
        self.guard.fail(err)
        self._abort()

    def _abort(self) -> None:
        if not self._aborted:
            self._aborted = True
            self.comm.abort()

    def start_exchange(
        self,
        sends: Messages,
        recvs: Messages,
        round_index: int = 0,
    ) -> _PendingNccl:
        self.guard.check()
        nccl = self._nccl
        # The staging buffers were written (and the receive buffers last read) on torch's
        # current stream: the NCCL stream waits for that work on the GPU, the host does not.
        queued = torch.cuda.Event()
        queued.record(torch.cuda.current_stream(self.device))
        self._torch_stream.wait_event(queued)
        ptr = self.stream.ptr
        try:
            nccl.groupStart()
            for peer, buf in recvs:
                self.comm.recv(buf.data_ptr(), buf.numel(), nccl.NCCL_UINT8, peer, ptr)
            for peer, buf in sends:
                self.comm.send(buf.data_ptr(), buf.numel(), nccl.NCCL_UINT8, peer, ptr)
            nccl.groupEnd()
        except Exception as err:  # noqa: BLE001
            error = TransportError(
                f"refit rank {self.rank}: {self.guard.where(round_index)}NCCL launch failed "
                f"({first_line(err)})"
            )
            self.fail_step(error)
            raise error from err
        done = torch.cuda.Event()
        done.record(self._torch_stream)
        return _PendingNccl(self, done, round_index)

    def _poll(self, done: torch.cuda.Event, round_index: int = 0) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                error = TransportError(
                    f"refit rank {self.rank}: {self.guard.where(round_index)}NCCL exchange did "
                    f"not finish within {self.timeout_s}s; a peer has died or stopped "
                    "responding (communicator aborted)"
                )
                self.fail_step(error)
                raise error
            time.sleep(0.0005)
        # Unpacks queued after this read what NCCL wrote: order them on the GPU.
        torch.cuda.current_stream(self.device).wait_event(done)

    def all_gather_object_str(self, value: str) -> list[str]:
        self.guard.check()
        self._gathers += 1  # a fresh key space per call: earlier values must not be read
        key = f"gather/{self._gathers}"
        self.store.set(f"{key}/{self.rank}", value)
        return [self.store.get(f"{key}/{r}").decode() for r in range(self.world_size)]

    def barrier(self) -> None:
        self.guard.check()
        flag = torch.zeros(1, dtype=torch.uint8, device=self.device)
        peers = [(p, flag) for p in range(self.world_size) if p != self.rank]
        # A ring of 1-byte messages: everyone must reach the barrier before anyone leaves.
        bufs = [(p, torch.zeros(1, dtype=torch.uint8, device=self.device)) for p, _ in peers]
        self.exchange(peers, bufs)

    def close(self) -> None:
        if not self._aborted:  # an aborted communicator is already freed
            self.comm.destroy()
