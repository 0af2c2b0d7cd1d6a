"""Transports: one small interface, three implementations.

A transport moves byte buffers between refit-group ranks. ``start_exchange``
issues every send and receive of one round as one batch and returns a handle
whose ``wait`` waits for all of them, so no ordering between peers can
deadlock; between the two the buffers belong to the transport (the overlapped
replay, ``engine/pipeline.py``, packs the next round meanwhile). ``exchange`` is
both at once. Every wait is bounded by ``timeout_s``; a dead or hung peer
becomes a :class:`TransportError` naming the peer, never a hang.

* :class:`GlooTransport` — a gloo process group built from a ``TCPStore``
  rendezvous ``(host, port, rank, world)``, independent of any default
  ``torch.distributed`` group, so training and inference processes that already
  run their own worlds can join one refit group. The CPU twin of the GPU path.
* :class:`TorchTransport` — an existing ``torch.distributed`` process group.
* :class:`CupyNcclTransport` (``engine/cupy_nccl.py``) — CuPy NCCL on GPUs.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from .rendezvous import RendezvousError, refit_store, tcp_port

DEFAULT_TIMEOUT_S = 600.0


class TransportError(RuntimeError):
    """A peer died, hung past the timeout, or the group could not form."""


class PendingExchange(Protocol):
    def wait(self) -> None:
        """Return when every send and receive of the exchange finished (the buffers are
        the caller's again); raise :class:`TransportError` past the timeout."""
        ...


class Transport(Protocol):
    rank: int
    world_size: int
    timeout_s: float

    def start_exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> PendingExchange:
        """Issue each send ``(peer, buffer)`` and each receive; do not wait."""
        ...

    def exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        """Send each ``(peer, buffer)`` in ``sends``, fill each of ``recvs``; wait for all."""
        ...

    def all_gather_object_str(self, value: str) -> list[str]:
        """Every rank's ``value`` (small strings: fingerprints, status)."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


def _wait_all(works: list[tuple[str, int, object]], timeout_s: float, rank: int) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    for kind, peer, work in works:
        try:
            ok = work.wait(timeout)  # type: ignore[attr-defined]
        except RuntimeError as err:
            what = "timed out" if "timed out" in str(err).lower() else "failed"
            raise TransportError(
                f"refit rank {rank}: {kind} with rank {peer} {what} ({first_line(err)}); "
                f"the peer process has died or stopped responding (timeout {timeout_s}s)"
            ) from err
        if ok is False:
            raise TransportError(
                f"refit rank {rank}: {kind} with rank {peer} did not finish within {timeout_s}s"
            )


class _PendingWorks:
    """The works of one issued exchange (gloo / torch.distributed requests)."""

    def __init__(self, works: list[tuple[str, int, object]], timeout_s: float, rank: int):
        self.works, self.timeout_s, self.rank = works, timeout_s, rank

    def wait(self) -> None:
        _wait_all(self.works, self.timeout_s, self.rank)


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name if it has none)."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


class _ProcessGroupTransport:
    """Shared batching over a ``ProcessGroup``-like object with send/recv."""

    def __init__(self, pg: object, rank: int, world_size: int, timeout_s: float) -> None:
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s

    def start_exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> _PendingWorks:
        works: list[tuple[str, int, object]] = []
        try:
            # Tag 0 for every message: at most one message per (src, dst) pair per round,
            # and one round in flight at a time.
            for peer, buf in recvs:
                works.append(("receive", peer, self._recv(buf, peer)))
            for peer, buf in sends:
                works.append(("send", peer, self._send(buf, peer)))
        except RuntimeError as err:
            raise TransportError(f"refit rank {self.rank}: {first_line(err)}") from err
        return _PendingWorks(works, self.timeout_s, self.rank)

    def exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        self.start_exchange(sends, recvs).wait()

    def _send(self, buf: torch.Tensor, peer: int) -> object:
        return self.pg.send([buf], peer, 0)  # type: ignore[attr-defined]

    def _recv(self, buf: torch.Tensor, peer: int) -> object:
        return self.pg.recv([buf], peer, 0)  # type: ignore[attr-defined]

    def all_gather_object_str(self, value: str) -> list[str]:
        data = value.encode()
        length = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(self.pg.allgather([lengths], [length]))  # type: ignore[attr-defined]
        size = int(max(t.item() for t in lengths))
        mine = torch.zeros(size, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.zeros(size, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(self.pg.allgather([outs], [mine]))  # type: ignore[attr-defined]
        return [bytes(o[: int(n.item())].tolist()).decode() for o, n in zip(outs, lengths)]

    def _wait(self, work: object) -> None:
        _wait_all([("collective", -1, work)], self.timeout_s, self.rank)

    def barrier(self) -> None:
        self._wait(self.pg.barrier())  # type: ignore[attr-defined]

    def close(self) -> None:
        pass


class GlooTransport(_ProcessGroupTransport):
    """A stateless gloo group over a TCPStore rendezvous (no default group needed).

    Rank 0 hosts the store at ``(host, port)``; pass ``port=0`` on rank 0 to pick a
    free port and read it back from :attr:`port`. ``prefix`` separates several
    refit groups on one store.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float | None = None,
        prefix: str = "refit",
        store: dist.Store | None = None,
        secret: str | None = None,
    ) -> None:
        """``timeout_s`` bounds every exchange; ``connect_timeout_s`` (default: the same)
        the rendezvous. ``secret``: the run's secret (``engine/rendezvous.py``)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside refit world of {world_size}")
        connect_s = connect_timeout_s or timeout_s
        try:
            if store is None:
                store = refit_store(host, port, rank, world_size, connect_s, secret)
            self.port = tcp_port(store, port)
            self.store = store
            # The group forms within the connect budget; then every op has timeout_s.
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix, store), rank, world_size,
                datetime.timedelta(seconds=max(connect_s, timeout_s)),
            )  # fmt: skip
        except RendezvousError:
            raise
        except RuntimeError as err:
            raise TransportError(
                f"refit rank {rank} could not join the gloo group at {host}:{port} within "
                f"{connect_s}s ({first_line(err)})"
            ) from err
        super().__init__(pg, rank, world_size, timeout_s)


class TorchTransport(_ProcessGroupTransport):
    """An existing ``torch.distributed`` process group (NCCL or gloo)."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ):
        self.group = group
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        super().__init__(group, rank, world, timeout_s)

    def _send(self, buf: torch.Tensor, peer: int) -> object:
        return dist.isend(
            buf, dist.get_global_rank(self.group, peer) if self.group else peer, group=self.group
        )

    def _recv(self, buf: torch.Tensor, peer: int) -> object:
        return dist.irecv(
            buf, dist.get_global_rank(self.group, peer) if self.group else peer, group=self.group
        )

    def all_gather_object_str(self, value: str) -> list[str]:
        # Bytes in tensors, never pickled objects: lengths first, then padded bytes.
        nccl = dist.get_backend(self.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        data = value.encode()
        length = torch.tensor([len(data)], dtype=torch.int64, device=device)
        lengths = [torch.zeros_like(length) for _ in range(self.world_size)]
        dist.all_gather(lengths, length, group=self.group)
        size = max(int(t.item()) for t in lengths)
        mine = torch.zeros(size, dtype=torch.uint8, device=device)
        mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        outs = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(outs, mine, group=self.group)
        return [bytes(o[: int(n.item())].tolist()).decode() for o, n in zip(outs, lengths)]

    def barrier(self) -> None:
        dist.barrier(group=self.group)
