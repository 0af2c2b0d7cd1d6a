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

CuPy is imported lazily: importing this module never needs a GPU.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .rendezvous import refit_store
from .transport import DEFAULT_TIMEOUT_S, TransportError, first_line


def cupy_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - any import or driver failure means "not available"
        return False


class _PendingNccl:
    def __init__(self, transport: CupyNcclTransport, done: torch.cuda.Event) -> None:
        self.transport, self.done = transport, done

    def wait(self) -> None:
        self.transport._poll(self.done)


class CupyNcclTransport:
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

    def start_exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> _PendingNccl:
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
            raise TransportError(
                f"refit rank {self.rank}: NCCL launch failed ({first_line(err)})"
            ) from err
        done = torch.cuda.Event()
        done.record(self._torch_stream)
        return _PendingNccl(self, done)

    def exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        self.start_exchange(sends, recvs).wait()

    def _poll(self, done: torch.cuda.Event) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                self.comm.abort()
                raise TransportError(
                    f"refit rank {self.rank}: NCCL exchange did not finish within "
                    f"{self.timeout_s}s; a peer has died or stopped responding "
                    "(communicator aborted)"
                )
            time.sleep(0.0005)
        # Unpacks queued after this read what NCCL wrote: order them on the GPU.
        torch.cuda.current_stream(self.device).wait_event(done)

    def all_gather_object_str(self, value: str) -> list[str]:
        self._gathers += 1  # a fresh key space per call: earlier values must not be read
        key = f"gather/{self._gathers}"
        self.store.set(f"{key}/{self.rank}", value)
        return [self.store.get(f"{key}/{r}").decode() for r in range(self.world_size)]

    def barrier(self) -> None:
        flag = torch.zeros(1, dtype=torch.uint8, device=self.device)
        peers = [(p, flag) for p in range(self.world_size) if p != self.rank]
        # A ring of 1-byte messages: everyone must reach the barrier before anyone leaves.
        bufs = [(p, torch.zeros(1, dtype=torch.uint8, device=self.device)) for p, _ in peers]
        self.exchange(peers, bufs)

    def close(self) -> None:
        self.comm.destroy()
