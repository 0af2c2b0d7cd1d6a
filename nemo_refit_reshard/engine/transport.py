"""Transports: one small interface, three implementations.

A transport moves byte buffers between refit-group ranks. ``start_exchange``
issues every send and receive of one round as one batch and returns a handle
whose ``wait`` waits for all of them, so no ordering between peers can
deadlock; between the two the buffers belong to the transport (the overlapped
replay, ``engine/pipeline.py``, packs the next round meanwhile). ``exchange`` is
both at once. Every wait is bounded by ``timeout_s``; a dead or hung peer
becomes a :class:`TransportError` naming the peer, never a hang.

Step identity. A refit step begins with ``begin_step`` on every rank of the group; the
transport counts the steps it has begun (the group's *sequence*: the same on every live
rank, whatever the callers number their steps) and each exchange names its round. On
gloo every message's tag is :func:`message_tag` ``(sequence, round)``, so a message left
in flight by a failed step can never pair with a receive of a later step or round: it
waits unmatched. After any failure in a step (a timeout, a dead peer, an error of the
caller's, reported with ``fail_step``) the transport refuses every later step, barrier
and gather with :class:`GroupUnusableError` naming the failed step: the ranks may hold
messages of that step, so the group is re-joined (``RefitWorker.rejoin``: a new group,
new counters) before the next refit. NCCL has no tags: ``engine/cupy_nccl.py`` aborts
its communicator on any failure instead (nothing of the step can land later).

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


class GroupUnusableError(TransportError):
    """An earlier step of this refit group failed: re-join the group before refitting."""


ROUND_BITS = 20  # rounds of one step: up to ~1M (a plan has one per bucket of bytes)
STEP_SPAN = 1 << (31 - ROUND_BITS)  # gloo tags are 31-bit: the sequence wraps at 2048


def message_tag(sequence: int, round_index: int) -> int:
    """The gloo tag of round ``round_index`` of the group's ``sequence``-th step:
    ``(sequence mod 2048) * 2**20 + round``. Two messages share a tag only 2048 steps
    apart, and a failed step stops the group long before (``GroupUnusableError``)."""
    if not 0 <= round_index < 1 << ROUND_BITS:
        raise ValueError(
            f"round {round_index} outside the {1 << ROUND_BITS} rounds a step can tag; "
            "raise bucket_mb"
        )
    return (sequence % STEP_SPAN) << ROUND_BITS | round_index


class StepGuard:
    """Which step a group member is in, and the first failure that made the group
    unusable. ``sequence``: steps begun on this transport (equal on every live rank);
    ``step``: the caller's number of the current one (named in errors)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.sequence = 0
        self.step: int | None = None
        self.failed: str | None = None

    def check(self) -> None:
        """Raise :class:`GroupUnusableError` if an earlier step failed."""
        if self.failed is not None:
            raise GroupUnusableError(self.failed)

    def begin(self, step: int | None) -> int:
        """Begin the next step (the caller's ``step``, default its sequence number)."""
        self.check()
        self.sequence += 1
        self.step = step if step is not None else self.sequence
        return self.sequence

    def where(self, round_index: int) -> str:
        """``"step 3 round 0: "`` inside a step, ``""`` before the first."""
        return f"step {self.step} round {round_index}: " if self.sequence else ""

    def fail(self, err: BaseException) -> None:
        """The current step failed with ``err``: refuse every later one."""
        if self.failed is not None or isinstance(err, GroupUnusableError):
            return
        step = f"step {self.step}" if self.sequence else "an exchange before the first step"
        self.failed = (
            f"refit rank {self.rank}: refit group unusable: {step} failed "
            f"({type(err).__name__}: {first_line(err)}); re-join the group "
            "(RefitWorker.rejoin) before the next refit"
        )


Messages = Sequence[tuple[int, torch.Tensor]]
"""One rank's messages of a round: ``(peer, byte buffer)`` pairs, sends or receives."""


class PendingExchange(Protocol):
    def wait(self) -> None:
        """Return when every send and receive of the exchange finished (the buffers are
        the caller's again); raise :class:`TransportError` past the timeout."""
        ...


class Transport(Protocol):
    rank: int
    world_size: int
    timeout_s: float

    def begin_step(self, step: int | None = None) -> int:
        """Begin the group's next step (collective by convention: every rank begins every
        step); its sequence number. Raises :class:`GroupUnusableError` after a failed one."""
        ...

    def fail_step(self, err: BaseException) -> None:
        """The current step failed on this rank (``err``): the group is unusable."""
        ...

    def start_exchange(
        self,
        sends: Messages,
        recvs: Messages,
        round_index: int = 0,
    ) -> PendingExchange:
        """Issue each send ``(peer, buffer)`` and each receive of round ``round_index``
        of the current step; do not wait."""
        ...

    def exchange(
        self,
        sends: Messages,
        recvs: Messages,
        round_index: int = 0,
    ) -> None:
        """Send each ``(peer, buffer)`` in ``sends``, fill each of ``recvs``; wait for all
        (every transport that subclasses this: start, then wait)."""
        self.start_exchange(sends, recvs, round_index).wait()

    def all_gather_object_str(self, value: str) -> list[str]:
        """Every rank's ``value`` (small strings: fingerprints, status)."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


_GATHER_HEAD = 56  # bytes of each value in the first collective of a gather


def _wait_all(
    works: list[tuple[str, int, object]], timeout_s: float, rank: int, where: str = ""
) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    for kind, peer, work in works:
        try:
            ok = work.wait(timeout)  # type: ignore[attr-defined]
        except RuntimeError as err:
            what = "timed out" if "timed out" in str(err).lower() else "failed"
            raise TransportError(
                f"refit rank {rank}: {where}{kind} with rank {peer} {what} ({first_line(err)}); "
                f"the peer process has died or stopped responding (timeout {timeout_s}s)"
            ) from err
        if ok is False:
            raise TransportError(
                f"refit rank {rank}: {where}{kind} with rank {peer} did not finish within "
                f"{timeout_s}s"
            )


class _PendingWorks:
    """The works of one issued exchange (gloo / torch.distributed requests); a failed
    wait makes the group unusable."""

    def __init__(
        self, works: list[tuple[str, int, object]], timeout_s: float, guard: StepGuard, where: str
    ) -> None:
        self.works, self.timeout_s, self.guard, self.where = works, timeout_s, guard, where

    def wait(self) -> None:
        try:
            _wait_all(self.works, self.timeout_s, self.guard.rank, self.where)
        except TransportError as err:
            self.guard.fail(err)
            raise


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name if it has none)."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


class _ProcessGroupTransport(Transport):
    """Shared batching over a ``ProcessGroup``-like object with send/recv."""

    def __init__(self, pg: object, rank: int, world_size: int, timeout_s: float) -> None:
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.guard = StepGuard(rank)

    def begin_step(self, step: int | None = None) -> int:
        return self.guard.begin(step)

    def fail_step(self, err: BaseException) -> None:
        self.guard.fail(err)

    def start_exchange(
        self,
        sends: Messages,
        recvs: Messages,
        round_index: int = 0,
    ) -> _PendingWorks:
        self.guard.check()
        # At most one message per (src, dst) pair per round; the tag names the step and
        # the round, so nothing of another step or round can pair with it.
        tag = message_tag(self.guard.sequence, round_index)
        where = self.guard.where(round_index)
        works: list[tuple[str, int, object]] = []
        try:
            for peer, buf in recvs:
                works.append(("receive", peer, self._recv(buf, peer, tag)))
            for peer, buf in sends:
                works.append(("send", peer, self._send(buf, peer, tag)))
        except RuntimeError as err:
            error = TransportError(f"refit rank {self.rank}: {where}{first_line(err)}")
            self.guard.fail(error)
            raise error from err
        return _PendingWorks(works, self.timeout_s, self.guard, where)

    def _send(self, buf: torch.Tensor, peer: int, tag: int) -> object:
        return self.pg.send([buf], peer, tag)  # type: ignore[attr-defined]

    def _recv(self, buf: torch.Tensor, peer: int, tag: int) -> object:
        return self.pg.recv([buf], peer, tag)  # type: ignore[attr-defined]

    def all_gather_object_str(self, value: str) -> list[str]:
        self.guard.check()
        # One collective of a length and the first bytes; a second only for the rest of
        # values longer than that. A delta step's versions fit: its step pays one ring
        # of latency, not two (12 processes on 2 cores: ~25 ms each).
        data = value.encode()
        head = _GATHER_HEAD
        mine = torch.zeros(8 + head, dtype=torch.uint8)
        mine[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        mine[8 : 8 + min(head, len(data))] = torch.tensor(list(data[:head]), dtype=torch.uint8)
        outs = [torch.zeros(8 + head, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(self.pg.allgather([outs], [mine]))  # type: ignore[attr-defined]
        lengths = [int(o[:8].view(torch.int64)[0]) for o in outs]
        texts = [bytes(o[8 : 8 + min(n, head)].tolist()) for o, n in zip(outs, lengths)]
        rest = max(lengths) - head
        if rest > 0:
            tail = torch.zeros(rest, dtype=torch.uint8)
            tail[: max(0, len(data) - head)] = torch.tensor(list(data[head:]), dtype=torch.uint8)
            tails = [torch.zeros(rest, dtype=torch.uint8) for _ in range(self.world_size)]
            self._wait(self.pg.allgather([tails], [tail]))  # type: ignore[attr-defined]
            texts = [
                t + bytes(x[: max(0, n - head)].tolist()) for t, x, n in zip(texts, tails, lengths)
            ]
        return [t.decode() for t in texts]

    def _wait(self, work: object) -> None:
        try:
            _wait_all([("collective", -1, work)], self.timeout_s, self.rank)
        except TransportError as err:
            self.guard.fail(err)  # the group's collectives are out of step now
            raise

    def barrier(self) -> None:
        self.guard.check()
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

    def _send(self, buf: torch.Tensor, peer: int, tag: int) -> object:
        # NCCL ignores tags: a torch.distributed NCCL group relies on the failed-step
        # refusal alone (its pending work dies with the process group's own timeout).
        return dist.isend(
            buf, dist.get_global_rank(self.group, peer) if self.group else peer, self.group,
            tag,
        )  # fmt: skip

    def _recv(self, buf: torch.Tensor, peer: int, tag: int) -> object:
        return dist.irecv(
            buf, dist.get_global_rank(self.group, peer) if self.group else peer, self.group,
            tag,
        )  # fmt: skip

    def all_gather_object_str(self, value: str) -> list[str]:
        self.guard.check()
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
        self.guard.check()
        dist.barrier(group=self.group)
