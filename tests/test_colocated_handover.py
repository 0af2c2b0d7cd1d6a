"""The colocated hand-over (issue 40, item 10): the worker unpacks its host's own bytes
while the host is still on the network, and the signals leave at once.

A round of the worker's that holds bytes from its own host and from the network is
handed over in two parts (``L`` then ``F``, ``engine/colocated.py``). The host's network
here is a stand-in (``TwoHostNetwork``): training rank 1's packed bytes copied into rank
0's receive spans, in one process, so the test can look at the worker's tensors while
rank 0's exchange is in progress.
"""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import torch

from nemo_refit_reshard.engine.colocated import ColocatedGuest, ColocatedHost, Signals
from nemo_refit_reshard.engine.materialize import empty_like_layout, materialize, mismatches
from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import Colocation, plan_refit, rank_plan
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.hf_models import TINY_CONFIGS

SPEC = spec_from_hf_config(dict(TINY_CONFIGS["llama"], torch_dtype="float32"))
SOURCES = [megatron_layout(SPEC, TrainParallel(tp=2), r) for r in range(2)]
DESTS = [vllm_layout(SPEC, InferParallel(tp=1, dp=2), r) for r in range(2)]
PLAN = plan_refit(SPEC, SOURCES, DESTS, bucket_mb=64, colocation=Colocation((0, 1)))
TRUTH = {t.name: torch.randn(t.shape, generator=torch.Generator().manual_seed(7)) for t in SPEC}


def _from(src: int) -> list[tuple[str, tuple[slice, ...]]]:
    """(live tensor, region) of worker 0 (group rank 2) that training rank ``src`` fills."""
    return [
        (t.dst_tensor, t.dst_box.slices())
        for m in PLAN.messages_of(2)
        if m.src == src
        for t in m.transfers
    ]


class TwoHostNetwork:
    """Rank 0's network, stood in: its receives get what training rank 1 packs for them;
    its exchange first waits (bounded) until ``ready()`` holds, recording whether it did."""

    def __init__(self, peer: ColocatedHost, ready) -> None:
        self.peer, self.ready, self.saw_ready = peer, ready, None

    def begin_step(self, step: int | None = None) -> int:
        return step or 1

    def fail_step(self, err: BaseException) -> None:
        pass

    def exchange(self, sends, recvs, round_index: int = 0) -> None:
        deadline = time.monotonic() + 60
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.001)
        self.saw_ready = self.ready()
        phase = self.peer.own.rounds[round_index]
        phase.pack()  # its own worker's bytes too (into its staging): harmless
        theirs = dict(phase.sends)
        for peer, buf in recvs:
            assert peer == 1
            buf.copy_(theirs[2])


def test_the_worker_unpacks_its_hosts_bytes_while_the_host_is_on_the_network() -> None:
    """Worker 0's one round holds bytes from training rank 0 (its host) and rank 1. By
    the time rank 0's exchange runs, the worker has already written rank 0's bytes into
    its live tensors (before: it waited for the whole round, so they were still NaN);
    after the step every tensor is bit-exact."""
    assert PLAN.num_rounds == 1 and _from(0) and _from(1)
    host = ColocatedHost(rank_plan(PLAN, 0), rank_plan(PLAN, 2), 0, materialize(SOURCES[0], TRUTH))
    other = ColocatedHost(rank_plan(PLAN, 1), rank_plan(PLAN, 3), 1, materialize(SOURCES[1], TRUTH))
    live = empty_like_layout(DESTS[0])
    want = materialize(DESTS[0], TRUTH)
    guest = ColocatedGuest(rank_plan(PLAN, 2), 2, live)
    a, b = Pipe()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            guest.attach(b, 60)
            guest.replay(1)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def own_bytes_landed() -> bool:
        return all(torch.equal(live[n][box], want[n][box]) for n, box in _from(0))

    thread = threading.Thread(target=worker)
    thread.start()
    network = TwoHostNetwork(other, own_bytes_landed)
    try:
        host.attach(a, 60)
        host.replay(network, 1)  # type: ignore[arg-type]
        thread.join(60)
        assert errors == []
        assert network.saw_ready is True  # before: False (all NaN until the whole round)
        assert mismatches(DESTS[0], live, TRUTH) == []
    finally:
        host.close()
        other.close()
        guest.close()


def _tcp_pair() -> tuple[Connection, Connection]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    return Connection(accepted.detach()), Connection(client.detach())


def _no_delay(conn: Connection) -> int:
    sock = socket.socket(fileno=conn.fileno())
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.detach()  # the connection still owns the descriptor


def test_signals_turn_off_nagle_on_tcp_connections() -> None:
    """An ``L`` right after a ``F`` of the same round must not wait for the peer's
    delayed ACK (6-13 ms per hand-over, measured): both ends send at once. A pipe is
    left as it is."""
    host_end, worker_end = _tcp_pair()
    try:
        assert (_no_delay(host_end), _no_delay(worker_end)) == (0, 0)
        Signals(host_end, 5, "worker")
        Signals(worker_end, 5, "host")
        assert (_no_delay(host_end), _no_delay(worker_end)) == (1, 1)
        # the descriptors still work after the option was set through a duplicate
        Signals(host_end, 5, "worker").send("L", 1, 0)
        assert worker_end.recv_bytes() == b"L1:0"
    finally:
        host_end.close()
        worker_end.close()
    a, b = Pipe()
    Signals(a, 5, "worker").send("F", 1, 0)
    assert b.recv_bytes() == b"F1:0"
