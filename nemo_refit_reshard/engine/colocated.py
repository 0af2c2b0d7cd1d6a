"""Colocated replay: a training rank and the vLLM worker on its GPU (``plan/colocation.py``).

The refit group is the training ranks alone. Each training rank ``s`` (the *host*) runs

* its own share of the plan, as a source: packs its outgoing messages; a message for
  a worker on another GPU goes over the network to that worker's host, one for its own
  co-located worker (the *guest*) never leaves the device;
* the receiving half of its guest's share: the guest's incoming messages land in the
  guest's staging — the other hosts' messages straight from the network, its own by a
  device-local copy.

The guest (the vLLM worker process) runs only its unpack: per round, once the host says
the staging holds round ``k``, it copies the staged spans into its live parameters and
says so; the host then reuses the staging for a later round. Both sides compile the
guest's share with the same code (``RankProgram``), so they agree on every offset.

Why the staging belongs to the host (decided for the GPU path, and the CPU twin does
the same): the training process allocates it once with its ordinary allocator and
exports it once (CUDA IPC; OS shared memory on CPU); the vLLM worker opens it once.
The other choice, the training process opening the worker's parameters, does not hold
up: with vLLM's sleep mode the weights live in its cumem pool (``cuMemCreate``
allocations, which ``cudaIpcGetMemHandle`` cannot export) and are re-backed by new
physical memory at every wake, so any mapping taken before a sleep is stale after it.
The host's staging is untouched by the worker's sleep and wake, so it stays valid for
the whole job; it is bounded by the plan's bucket (``bucket_mb``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection

import torch

from ..plan import Colocation, PlanError, RankPlan, RefitPlan
from .program import TORCH_DTYPES, RankProgram
from .staging import SharedBuffer, create_shared_buffer, open_shared_buffer
from .transport import Transport, TransportError


def _meta_tensors(plan: RefitPlan | RankPlan, group_rank: int) -> dict[str, torch.Tensor]:
    """The guest's live tensors as shapes only: the host binds the receiving half of the
    guest's program, never its unpack."""
    return {
        name: torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta")
        for name, (shape, dtype) in plan.expected_tensors(group_rank).items()
    }


ABORT = "abort:"  # a failed step, with the error that failed it


class Signals:
    """Round-by-round hand-over between a host and its guest over a local connection:
    raw bytes (``F<round>``: staged; ``C<round>``: consumed), never pickled objects. Every
    wait is bounded."""

    def __init__(self, conn: Connection, timeout_s: float, peer: str) -> None:
        self.conn, self.timeout_s, self.peer = conn, timeout_s, peer

    def send(self, kind: str, round_index: int) -> None:
        self.conn.send_bytes(f"{kind}{round_index}".encode())

    def wait(self, kind: str, round_index: int) -> None:
        got = self._next(f"did not signal round {round_index}")
        if got.startswith(ABORT):
            raise TransportError(
                f"colocated refit: the {self.peer} failed in round {round_index}: "
                f"{got[len(ABORT) :]}"
            )
        if got != f"{kind}{round_index}":
            raise TransportError(
                f"colocated refit: expected {kind}{round_index} from the {self.peer}, got {got!r}"
            )

    def abort(self, err: BaseException) -> None:
        """Tell the other side this step failed (so it stops waiting now); best effort."""
        try:
            self.conn.send_bytes(f"{ABORT}{type(err).__name__}: {err}".encode()[:2000])
        except OSError:
            pass  # the other side is gone: it learns by its own wait

    def send_text(self, text: str) -> None:
        self.conn.send_bytes(text.encode())

    def recv_text(self) -> str:
        return self._next("sent nothing")

    def _next(self, what: str) -> str:
        try:
            if not self.conn.poll(self.timeout_s):
                raise TransportError(
                    f"colocated refit: the {self.peer} {what} within {self.timeout_s:g} s "
                    "(it died or hung)"
                )
            return self.conn.recv_bytes().decode()
        except (EOFError, OSError) as err:
            raise TransportError(
                f"colocated refit: the {self.peer} closed its connection ({what})"
            ) from err


class ColocatedHost:
    """Training rank ``rank``: its own sends and its guest's receiving half."""

    def __init__(
        self,
        own: RefitPlan | RankPlan,
        guest: RefitPlan | RankPlan | None,
        rank: int,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
    ) -> None:
        hosts = own.colocated_hosts
        if not hosts:
            raise PlanError("not a colocated plan: build it with plan_refit(..., colocation=)")
        self.rank, self.device = rank, torch.device(device)
        self.num_sources, self.hosts = own.num_sources, hosts
        self.guest_rank = Colocation(hosts).guest_of(rank, own.num_sources)
        if (guest is None) != (self.guest_rank is None):
            planned = "no" if self.guest_rank is None else "an"
            given = "no" if guest is None else "a"
            raise PlanError(
                f"training rank {rank}: the plan puts {planned} inference rank on its GPU, "
                f"the caller gave {given} guest share"
            )
        self.own = RankProgram(own, rank, tensors, self.device)
        self.staging: SharedBuffer | None = None
        self.guest: RankProgram | None = None
        if guest is not None:
            assert self.guest_rank is not None

            def make(nbytes: int) -> torch.Tensor:
                self.staging = create_shared_buffer(nbytes, self.device)
                return self.staging.tensor

            self.guest = RankProgram(
                guest, self.guest_rank, _meta_tensors(guest, self.guest_rank), "meta",
                make_recv_buffer=make,
            )  # fmt: skip
        self.signals: Signals | None = None
        self.waited = 0.0  # the last step's seconds waiting for the guest

    def attach(self, conn: Connection, timeout_s: float) -> None:
        """Hand the guest its staging (a handle it opens once) over ``conn``."""
        self.signals = Signals(conn, timeout_s, f"vLLM worker on training rank {self.rank}'s GPU")
        assert self.staging is not None
        self.signals.send_text(json.dumps({"staging": self.staging.handle}))
        if self.signals.recv_text() != "opened":
            raise TransportError("colocated refit: the worker could not open the staging")

    def replay(self, network: Transport) -> float:
        """One refit step; returns seconds spent waiting for the guest."""
        try:
            return self._replay(network)
        except BaseException as err:
            if self.signals is not None:
                self.signals.abort(err)
            raise

    def _replay(self, network: Transport) -> float:
        s, hosts, waited = self.num_sources, self.hosts, 0.0
        with torch.no_grad():
            self.own.prepare()
            for k, mine in enumerate(self.own.rounds):
                incoming = self.guest.rounds[k].recvs if self.guest is not None else []
                mine.pack()
                sends, local = [], []
                for peer, buf in mine.sends:
                    host = hosts[peer - s]
                    (local if host == self.rank else sends).append((host, buf))
                recvs = [(peer, buf) for peer, buf in incoming if peer != self.rank]
                if sends or recvs:
                    network.exchange(sends, recvs)
                own_spans = [buf for peer, buf in incoming if peer == self.rank]
                for (_, src), dst in zip(local, own_spans, strict=True):
                    dst.copy_(src)  # device-local: never on the interconnect
                if incoming:
                    assert self.signals is not None, "attach() the guest first"
                    if self.device.type == "cuda":
                        torch.cuda.current_stream(self.device).synchronize()
                    t0 = time.perf_counter()
                    self.signals.send("F", k)
                    self.signals.wait("C", k)
                    waited += time.perf_counter() - t0
        self.waited = waited
        return waited

    @property
    def staging_bytes(self) -> int:
        extra = self.staging.tensor.numel() if self.staging is not None else 0
        return self.own.staging_bytes + extra


class ColocatedGuest:
    """The vLLM worker on a host's GPU: unpacks its host's staging into live tensors."""

    def __init__(
        self,
        plan: RefitPlan | RankPlan,
        group_rank: int,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
    ) -> None:
        self.plan, self.group_rank = plan, group_rank
        self.tensors, self.device = tensors, torch.device(device)
        self.program: RankProgram | None = None
        self.signals: Signals | None = None
        self.staging: SharedBuffer | None = None
        self.waited = 0.0  # the last step's seconds waiting for the host

    def attach(self, conn: Connection, timeout_s: float) -> None:
        """Open the host's staging (once) and compile the unpack over it."""
        self.signals = Signals(conn, timeout_s, "training rank on this GPU")
        handle = json.loads(self.signals.recv_text())["staging"]

        def opened(nbytes: int) -> torch.Tensor:
            self.staging = open_shared_buffer(handle, self.device)
            if self.staging.tensor.numel() < nbytes:
                raise PlanError(
                    f"colocated refit: the host's staging holds {self.staging.tensor.numel()} "
                    f"bytes, this worker's share needs {nbytes}: the two sides hold "
                    "different plans"
                )
            return self.staging.tensor

        self.program = RankProgram(
            self.plan, self.group_rank, self.tensors, self.device, make_recv_buffer=opened
        )
        self.signals.send_text("opened")

    def replay(self) -> float:
        """One refit step: per round with messages for this worker, wait, unpack, answer.
        Returns the seconds spent waiting for the host."""
        assert self.program is not None and self.signals is not None, "attach() first"
        try:
            return self._replay()
        except BaseException as err:
            if not isinstance(err, TransportError):  # a failed unpack: the host must know
                self.signals.abort(err)
            raise

    def _replay(self) -> float:
        assert self.program is not None and self.signals is not None
        waited = 0.0
        with torch.no_grad():
            for k, phase in enumerate(self.program.rounds):
                if not phase.recvs:
                    continue
                t0 = time.perf_counter()
                self.signals.wait("F", k)
                waited += time.perf_counter() - t0
                phase.unpack()
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                self.signals.send("C", k)
            self.program.finish()
        self.waited = waited
        return waited

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()


__all__ = ["ColocatedGuest", "ColocatedHost", "Signals"]
