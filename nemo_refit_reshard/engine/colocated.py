"""Colocated replay: a training rank and the vLLM worker on its GPU (``plan/colocation.py``).

The refit group is the training ranks alone. Each training rank ``s`` (the *host*) runs

* its own share of the plan, as a source: packs its outgoing messages; a message for
  a worker on another GPU goes over the network to that worker's host, one for its own
  co-located worker (the *guest*) never leaves the device;
* the receiving half of its guest's share: the guest's incoming messages land in the
  guest's staging — the other hosts' messages straight from the network, its own
  packed straight into their staging spans by its pack (``RankProgram``'s
  ``outgoing_into``): one device copy per byte, as a separate-pools sender's pack.

The guest (the vLLM worker process) runs only its unpack: per round, once the host says
the staging holds round ``k``, it copies the staged spans into its live parameters and
says so; the host then reuses the staging for a later round. A round with bytes from
both sides is handed over in two parts: the host packs its own bytes first and says so
(``L``), so the guest unpacks them while the host packs for the wire and exchanges;
then the network's (``F``). The guest's unpack of the device-local half is thus off the
step's critical path (``docs/benchmarks.md``, issue 40 item 10). Both sides compile the
guest's share with the same code (``RankProgram``), so they agree on every offset; the
attach handshake compares their plans' fingerprints.

Step identity: both sides count the steps they began since attach (the connection's
sequence, equal on both while no step failed) and every signal names it with the round
(``F<sequence>:<round>``), so a signal left over from a failed step is an error naming
both steps, never a hand-over. After a failed step either side refuses every later one
(``GroupUnusableError``) and tells the other: the pair is re-made (a new trainer and
worker connection) before the next refit.

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
import os
import re
import socket
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection

import torch

from ..plan import Colocation, PlanError, RankPlan, RefitPlan
from .delta import DeltaOptions
from .delta.colocated import ColocatedDelta
from .program import TORCH_DTYPES, RankProgram, copy_pairs
from .staging import SharedBuffer, create_shared_buffer, open_shared_buffer
from .transport import GroupUnusableError, Transport, TransportError, first_line


def _meta_tensors(plan: RefitPlan | RankPlan, group_rank: int) -> dict[str, torch.Tensor]:
    """The guest's live tensors as shapes only: the host binds the receiving half of the
    guest's program, never its unpack."""
    return {
        name: torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta")
        for name, (shape, dtype) in plan.expected_tensors(group_rank).items()
    }


ABORT = "abort:"  # a failed step, with the error that failed it
REFUSED = "refused: "  # the guest refuses the attach, with why


def send_at_once(conn: Connection) -> None:
    """Turn off Nagle's algorithm on a TCP connection (no-op on pipes and Unix sockets).

    Signals are a few bytes each and two can follow each other (``L`` then ``F``): with
    Nagle the second waits until the peer acknowledges the first, which a peer with
    nothing to send delays (Linux: up to 40 ms) — measured 6-13 ms per hand-over here."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return  # not a socket (a pipe)
    with sock:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Signals:
    """Round-by-round hand-over between a host and its guest over a local connection:
    raw bytes (``L<sequence>:<round>``: the host's own bytes staged; ``F<sequence>:<round>``:
    all staged; ``C<sequence>:<round>``: consumed, where ``sequence`` counts the steps
    since attach), never pickled objects. Every wait is bounded."""

    def __init__(self, conn: Connection, timeout_s: float, peer: str) -> None:
        self.conn, self.timeout_s, self.peer = conn, timeout_s, peer
        send_at_once(conn)

    def send(self, kind: str, sequence: int, round_index: int) -> None:
        self.conn.send_bytes(f"{kind}{sequence}:{round_index}".encode())

    def wait(self, kind: str, sequence: int, round_index: int, step: int | None = None) -> None:
        """Wait for ``<kind><sequence>:<round>``; ``step``: the caller's number of this
        step (named in errors)."""
        got = self._next(f"did not signal round {round_index}")
        if got.startswith(ABORT):
            raise TransportError(
                f"colocated refit: the {self.peer} failed in round {round_index}: "
                f"{got[len(ABORT) :]}"
            )
        want = f"{kind}{sequence}:{round_index}"
        if got == want:
            return
        seen = re.fullmatch(r"([LFC])(\d+):(\d+)", got)
        this = f"step {step if step is not None else sequence} (refit #{sequence} here)"
        if seen is not None and int(seen[2]) != sequence:
            raise TransportError(
                f"colocated refit {this}: the {self.peer} sent {got}, a signal of refit "
                f"#{seen[2]} on this connection: a stale signal of a failed step; re-connect "
                "the worker"
            )
        raise TransportError(
            f"colocated refit {this}: expected {want} from the {self.peer}, got {got!r}"
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


def _handed_over_in_two(recvs: list[tuple[int, torch.Tensor]], host: int) -> bool:
    """Whether a round of the guest's (its ``recvs``) holds bytes from its ``host`` and
    from the network: then the host hands its own over first (``L``), the rest with ``F``."""
    peers = {peer for peer, _ in recvs}
    return host in peers and len(peers) > 1


class ColocatedHost:
    """Training rank ``rank``: its own sends and its guest's receiving half."""

    def __init__(
        self,
        own: RefitPlan | RankPlan,
        guest: RefitPlan | RankPlan | None,
        rank: int,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
        delta: DeltaOptions | None = None,
    ) -> None:
        """``delta``: send each message in its smallest form (``engine/delta/program.py``); the
        host holds the messages it receives for its guest in host memory, so the guest
        re-packs nothing and a guest that lost its weights (sleep mode) still gets whole
        messages (every host of the group alike)."""
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
        self.staging: SharedBuffer | None = None
        self.guest: RankProgram | None = None
        self.fingerprint = own.fingerprint
        if guest is not None:
            assert self.guest_rank is not None

            def make(nbytes: int) -> torch.Tensor:
                self.staging = create_shared_buffer(nbytes, self.device)
                return self.staging.tensor

            try:
                self.guest = RankProgram(
                    guest, self.guest_rank, _meta_tensors(guest, self.guest_rank), "meta",
                    make_recv_buffer=make,
                )  # fmt: skip
            except BaseException:
                self.close()  # the staging may exist already: never leave it behind
                raise
        # The message for its own guest is packed straight into the guest's staging
        # span (a device copy per byte, as for a message that leaves the GPU), never into
        # the send buffer and then copied over.
        into = {}
        if self.guest is not None:
            for k, phase in enumerate(self.guest.rounds):
                for peer, span in phase.recvs:
                    if peer == rank:
                        into[(k, self.guest_rank)] = span
        try:
            self.own = RankProgram(own, rank, tensors, self.device, outgoing_into=into)
        except BaseException:
            self.close()
            raise
        self.delta: ColocatedDelta | None = None
        if delta is not None:
            guest_share = None
            if guest is not None and self.guest is not None:
                guest_share = (self.guest, guest)
            self.delta = ColocatedDelta(
                rank, hosts, (self.own, own), guest_share, self.device, delta
            )
        self.signals: Signals | None = None
        self.waited = 0.0  # the last step's seconds waiting for the guest
        self.exchange_seconds = 0.0  # the last step's seconds on the network and the guest
        self.sequence = 0  # steps begun since attach (the guest counts the same)
        self.failed: str | None = None  # why the pair is unusable, after a failed step
        self.closed = False

    def attach(self, conn: Connection, timeout_s: float) -> None:
        """Hand the guest its staging (a handle it opens once) over ``conn``."""
        self.signals = Signals(conn, timeout_s, f"vLLM worker on training rank {self.rank}'s GPU")
        assert self.staging is not None
        hello = {"staging": self.staging.handle, "fingerprint": self.fingerprint}
        self.signals.send_text(json.dumps(hello))
        reply = self.signals.recv_text()
        if reply.startswith(REFUSED):
            raise PlanError(reply[len(REFUSED) :])
        if reply != "opened":
            raise TransportError("colocated refit: the worker could not open the staging")

    def replay(self, network: Transport, step: int | None = None) -> float:
        """One refit step (the caller's ``step``, named in errors; the network group's
        and the guest's step identity are their sequences); returns seconds spent
        waiting for the guest. Any failure makes the pair and the network group
        unusable: every later step raises ``GroupUnusableError`` naming this one."""
        if self.closed:
            raise RuntimeError("colocated refit: this host is closed (its staging released)")
        try:
            if self.failed is not None:
                raise GroupUnusableError(self.failed)
            self.sequence += 1
            network.begin_step(step)
            return self._replay(network, step)
        except BaseException as err:
            network.fail_step(err)
            if self.failed is None and not isinstance(err, GroupUnusableError):
                self.failed = (
                    f"colocated refit unusable: step {step if step is not None else self.sequence}"
                    f" failed on training rank {self.rank} ({type(err).__name__}: "
                    f"{first_line(err)}); re-join (a new trainer, its worker re-connected)"
                )
            if self.signals is not None:
                self.signals.abort(err)
            raise

    def _replay(self, network: Transport, step: int | None) -> float:
        s, hosts, waited, exchanged = self.num_sources, self.hosts, 0.0, 0.0
        delta = self.delta.begin(network) if self.delta is not None else None
        with torch.no_grad():
            self.own.prepare()
            for k, mine in enumerate(self.own.rounds):
                incoming = self.guest.rounds[k].recvs if self.guest is not None else []
                mine.pack_local()  # the bytes for its own guest land in the staging here
                if _handed_over_in_two(incoming, self.rank):
                    assert self.signals is not None, "attach() the guest first"
                    if self.device.type == "cuda":
                        torch.cuda.current_stream(self.device).synchronize()
                    self.signals.send("L", self.sequence, k)
                mine.pack_wire()
                t0 = time.perf_counter()
                if delta is not None:
                    delta.round(network, k)
                else:
                    sends = [(hosts[peer - s], buf) for peer, buf in mine.sends]
                    assert all(host != self.rank for host, _ in sends), "own guest on the wire"
                    recvs = [(peer, buf) for peer, buf in incoming if peer != self.rank]
                    if sends or recvs:
                        network.exchange(sends, recvs, k)
                exchanged += time.perf_counter() - t0
                if incoming:
                    assert self.signals is not None, "attach() the guest first"
                    if self.device.type == "cuda":
                        torch.cuda.current_stream(self.device).synchronize()
                    t0 = time.perf_counter()
                    self.signals.send("F", self.sequence, k)
                    self.signals.wait("C", self.sequence, k, step)
                    waited += time.perf_counter() - t0
        if delta is not None:
            delta.done()
        self.waited = waited
        self.exchange_seconds = exchanged + waited
        return waited

    @property
    def staging_bytes(self) -> int:
        extra = self.staging.tensor.numel() if self.staging is not None else 0
        return self.own.staging_bytes + extra

    def close(self) -> None:
        """Release the guest's staging: the OS segment is removed now (CPU), the CUDA
        buffer goes back to this process's allocator once the guest's program, whose
        views hold it, is dropped too. Idempotent; the host cannot replay afterwards."""
        self.closed, self.guest = True, None  # the guest program: views into the staging
        if self.staging is not None:
            self.staging.close()
            self.staging = None


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
        self.sequence = 0  # steps begun since attach (the host counts the same)
        self.failed: str | None = None  # why the pair is unusable, after a failed step

    def attach(self, conn: Connection, timeout_s: float) -> None:
        """Open the host's staging (once) and compile the unpack over it."""
        self.signals = Signals(conn, timeout_s, "training rank on this GPU")
        hello = json.loads(self.signals.recv_text())
        handle = hello["staging"]
        if hello.get("fingerprint") != self.plan.fingerprint:
            why = (
                f"colocated refit: the training rank on this GPU holds plan "
                f"{str(hello.get('fingerprint'))[:16]}, generation rank {self.group_rank} "
                f"plan {self.plan.fingerprint[:16]}; ship both from one plan"
            )
            self.signals.send_text(REFUSED + why)
            raise PlanError(why)

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
        host = self.plan.colocated_hosts[self.group_rank - self.plan.num_sources]
        # Per round: the copies from its host's own bytes, and the rest (both
        # everything when the round is handed over at once).
        self.parts: list[tuple[list, list]] = []
        for phase in self.program.rounds:
            assert len(phase.copies_in_from) == len(phase.copies_in)
            if _handed_over_in_two(phase.recvs, host):
                pairs = list(zip(phase.copies_in, phase.copies_in_from))
                local = [pair for pair, peer in pairs if peer == host]
                self.parts.append((local, [pair for pair, peer in pairs if peer != host]))
            else:
                self.parts.append(([], phase.copies_in))
        self.signals.send_text("opened")

    def replay(self, step: int | None = None) -> float:
        """One refit step (the caller's ``step``, named in errors): per round with
        messages for this worker, wait, unpack, answer. Returns the seconds spent waiting
        for the host. Any failure makes the pair unusable: every later step raises
        ``GroupUnusableError`` naming this one (and tells the host)."""
        assert self.program is not None and self.signals is not None, "attach() first"
        try:
            if self.failed is not None:
                raise GroupUnusableError(self.failed)
            self.sequence += 1
            return self._replay(step)
        except BaseException as err:
            if self.failed is None and not isinstance(err, GroupUnusableError):
                self.failed = (
                    f"colocated refit unusable: step {step if step is not None else self.sequence}"
                    f" failed on generation rank {self.group_rank} ({type(err).__name__}: "
                    f"{first_line(err)}); re-connect the worker to a new trainer"
                )
            # The host must know now (a failed unpack, a timeout, a refusal), not at its
            # own timeout: it may be about to hand over a round of this step.
            self.signals.abort(err)
            raise

    def _replay(self, step: int | None) -> float:
        assert self.program is not None and self.signals is not None
        waited = 0.0
        with torch.no_grad():
            for k, phase in enumerate(self.program.rounds):
                if not phase.recvs:
                    continue
                local, rest = self.parts[k]
                for job in phase.before_in:
                    job()
                if local:  # the host's own bytes, while it packs and exchanges the rest
                    t0 = time.perf_counter()
                    self.signals.wait("L", self.sequence, k, step)
                    waited += time.perf_counter() - t0
                    copy_pairs(local)
                t0 = time.perf_counter()
                self.signals.wait("F", self.sequence, k, step)
                waited += time.perf_counter() - t0
                copy_pairs(rest)
                for job in phase.after_in:
                    job()
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                self.signals.send("C", self.sequence, k)
            self.program.finish()
        self.waited = waited
        return waited

    def close(self) -> None:
        """Unmap the host's staging (the host removes it). Idempotent."""
        self.program = None  # its compiled views into the staging
        if self.staging is not None:
            self.staging.close()
            self.staging = None


__all__ = ["ColocatedGuest", "ColocatedHost", "Signals"]
