"""The cupy-nccl transport's host-side logic, on CPU: the NCCL id's wire form, the
arrival wait and the init watchdog, the group closed after a failed launch, NCCL's
asynchronous errors while waiting, and the gathers and barriers through the store.

Stores are real (``torch.distributed`` ``HashStore`` / ``TCPStore``); what needs a GPU
is a minimal stand-in below: ``FakeNccl`` for ``cupy.cuda.nccl`` (it logs the group
calls), ``FakeComm`` for its ``NcclCommunicator``, ``FakeOrder`` for the CUDA-event
ordering. The real CuPy wheels run the init path in ``tests/test_cupy_wheels.py``.
"""

from __future__ import annotations

import datetime
import random
import struct
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nemo_refit_reshard.engine import cupy_nccl
from nemo_refit_reshard.engine.cupy_nccl import (
    CupyNcclTransport,
    cupy_unavailable_reason,
    open_communicator,
    share_unique_id,
)
from nemo_refit_reshard.engine.rendezvous import free_port
from nemo_refit_reshard.engine.transport import GroupUnusableError, TransportError

CUPY14_ID = bytes((i * 37) % 256 for i in range(128))  # an id as CuPy 14 has it
CUPY13_ID = struct.unpack("128b", CUPY14_ID)  # the same id as CuPy 13 has it: signed chars


class FakeNcclError(RuntimeError):
    """Stands in for CuPy's ``NcclError``."""


class FakeComm:
    """Stands in for ``NcclCommunicator``: logs sends and receives into ``log``;
    ``send_error`` makes every send raise it, ``async_error`` the ``async_after``-th
    ``check_async_error`` and every later one."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.send_error: Exception | None = None
        self.async_error: Exception | None = None
        self.async_after = 1
        self.async_checks = 0
        self.aborts = 0

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self.log.append(f"recv {peer} {count}")

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self.log.append(f"send {peer} {count}")
        if self.send_error is not None:
            raise self.send_error

    def check_async_error(self) -> None:
        self.async_checks += 1
        if self.async_error is not None and self.async_checks >= self.async_after:
            raise self.async_error

    def abort(self) -> None:
        self.aborts += 1

    def destroy(self) -> None:
        self.log.append("destroy")


class FakeNccl(types.ModuleType):
    """Stands in for ``cupy.cuda.nccl``: ``uid`` is what ``get_unique_id`` returns (its
    type is the CuPy release's); ``make_comm`` builds the communicator."""

    NCCL_UINT8 = 0

    def __init__(self, uid: Any = CUPY14_ID, make_comm: Callable[..., Any] | None = None):
        super().__init__("fake_nccl")
        self.uid = uid
        self.log: list[str] = []
        self.available = True
        self.comm = FakeComm(self.log)
        self.make_comm = make_comm or (lambda world, uid, rank: self.comm)

    def get_unique_id(self) -> Any:
        return self.uid

    def groupStart(self) -> None:  # noqa: N802 - CuPy's name
        self.log.append("groupStart")

    def groupEnd(self) -> None:  # noqa: N802 - CuPy's name
        self.log.append("groupEnd")

    def NcclCommunicator(self, world: int, uid: Any, rank: int) -> Any:  # noqa: N802
        return self.make_comm(world, uid, rank)


class FakeEvent:
    """A CUDA event that completes after ``polls`` queries (None: never)."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls

    def query(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0


class FakeOrder:
    """Stands in for the CUDA-event ordering of the NCCL stream (``_CudaOrder``)."""

    ptr = 1234
    device = None

    def __init__(self, polls: int | None = 0) -> None:
        self.polls = polls
        self.after: list[FakeEvent] = []

    def before_issue(self) -> None:
        pass

    def record_done(self) -> FakeEvent:
        return FakeEvent(self.polls)

    def after_done(self, done: FakeEvent) -> None:
        self.after.append(done)


def transport(
    rank: int = 0, world: int = 2, store: Any = None, timeout_s: float = 60.0, polls: int = 0
) -> tuple[CupyNcclTransport, FakeNccl]:
    nccl = FakeNccl()
    store = store if store is not None else dist.HashStore()
    t = CupyNcclTransport.from_parts(
        nccl, nccl.comm, FakeOrder(polls), store, rank, world, timeout_s
    )
    return t, nccl


def in_threads(fn: Callable[[int], Any], ranks: list[int]) -> dict[int, Any]:
    """``fn(rank)`` for each rank in its own thread: its result, or the error it raised."""
    out: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except Exception as err:  # noqa: BLE001 - returned for the test to judge
            out[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


# -- 1. the NCCL id -----------------------------------------------------------------------


def test_id_travels_as_raw_bytes_between_cupy_13_and_14() -> None:
    """Rank 0 on CuPy 13 (a tuple of signed chars), rank 1 on CuPy 14 (bytes), rank 2 on
    13 again, through a real TCPStore: each gets rank 0's id in its own CuPy's form."""
    port = free_port()
    nccls = {0: FakeNccl(CUPY13_ID), 1: FakeNccl(bytes(128)), 2: FakeNccl((0,) * 128)}
    stores: dict[int, dist.Store] = {}  # alive until every rank has read: rank 0 hosts

    def join(rank: int) -> Any:
        timeout = datetime.timedelta(seconds=30)
        stores[rank] = dist.TCPStore(
            "127.0.0.1", port, 3, rank == 0, timeout, wait_for_workers=False
        )
        return share_unique_id(stores[rank], nccls[rank], rank, 3, 30.0)

    ids = in_threads(join, [0, 1, 2])
    assert ids == {0: CUPY13_ID, 1: CUPY14_ID, 2: CUPY13_ID}
    assert [type(ids[r]) for r in range(3)] == [tuple, bytes, tuple]


def test_cupy14_id_reaches_the_communicator_as_bytes() -> None:
    """What the constructor receives on a CuPy 14 rank that is not rank 0."""
    store = dist.HashStore()
    seen: list[Any] = []
    nccl = FakeNccl(CUPY14_ID, lambda world, uid, rank: seen.append(uid) or FakeComm([]))
    ids = in_threads(lambda r: share_unique_id(store, nccl, r, 2, 10.0), [0, 1])
    open_communicator(nccl, ids[1], 1, 2, 0, 10.0)
    assert seen == [CUPY14_ID]


# -- 2. NCCL's library missing ------------------------------------------------------------


def fake_cupy(monkeypatch: pytest.MonkeyPatch, nccl_available: bool, device: bool) -> None:
    """``cupy`` 14.2.0 with ``cupy.cuda.nccl`` as the wheel has it without NCCL's
    library (``available`` False) or with it."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = nccl_available  # type: ignore[attr-defined]
    cupy.__version__ = "14.2.0"  # type: ignore[attr-defined]
    cuda.is_available = lambda: device  # type: ignore[attr-defined]
    cuda.nccl = nccl  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, module)


def test_cupy_without_nccl_library_is_not_available_and_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cupy(monkeypatch, nccl_available=False, device=True)
    reason = (
        "CuPy 14.2.0 cannot load NCCL's library: pip install nvidia-nccl-cu12 (CUDA 12) or "
        "nvidia-nccl-cu13 (CUDA 13)"
    )
    assert cupy_unavailable_reason() == reason
    assert cupy_nccl.cupy_available() is False
    with pytest.raises(TransportError) as err:
        CupyNcclTransport("127.0.0.1", 1, 0, 1, device=0)
    assert str(err.value) == (
        f"the cupy-nccl transport cannot run here: {reason}; use the gloo transport on CPU"
    )


def test_cupy_with_nccl_and_device_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy(monkeypatch, nccl_available=True, device=True)
    assert cupy_unavailable_reason() is None
    fake_cupy(monkeypatch, nccl_available=True, device=False)
    assert cupy_unavailable_reason() == "no CUDA device (cupy.cuda.is_available() is False)"


def test_no_cupy_names_the_wheels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert cupy_unavailable_reason() == (
        "CuPy does not import (import of cupy halted; None in sys.modules): pip install "
        "cupy-cuda12x (CUDA 12) or cupy-cuda13x (CUDA 13)"
    )


# -- 3. the group closed after a failed launch ---------------------------------------------


def test_a_send_that_raises_inside_the_group_still_closes_it() -> None:
    t, nccl = transport(rank=0)
    nccl.comm.send_error = FakeNcclError("NCCL_ERROR_INVALID_ARGUMENT: invalid argument")
    buf = torch.zeros(8, dtype=torch.uint8)
    t.begin_step(7)
    with pytest.raises(TransportError) as err:
        t.start_exchange([(1, buf)], [(1, buf)], round_index=3)
    assert str(err.value) == (
        "refit rank 0: step 7 round 3: NCCL launch failed "
        "(NCCL_ERROR_INVALID_ARGUMENT: invalid argument)"
    )
    assert isinstance(err.value.__cause__, FakeNcclError)
    assert nccl.log == ["groupStart", "recv 1 8", "send 1 8", "groupEnd"]
    assert nccl.comm.aborts == 1
    with pytest.raises(GroupUnusableError):
        t.begin_step(8)


def test_a_good_round_is_one_group() -> None:
    t, nccl = transport(rank=1, world=3, polls=2)
    a, b = torch.zeros(4, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8)
    t.begin_step()
    t.exchange([(0, a), (2, b)], [(2, a)], round_index=0)
    assert nccl.log == ["groupStart", "recv 2 4", "send 0 4", "send 2 6", "groupEnd"]
    assert (nccl.comm.aborts, len(t._order.after)) == (0, 1)


def test_a_peer_that_never_reaches_the_round_cannot_hang_the_first_connection() -> None:
    """NCCL connects a pair inside ``groupEnd`` the first time the pair is used, blocking
    on the host until the peer comes: a live peer that never reaches the round would
    hang the rank there. The first round to a peer is issued on a watchdog thread; past
    the timeout the communicator is aborted (releasing the blocked call) and the step
    fails naming the peer. Rounds to connected peers are issued inline."""
    t, nccl = transport(rank=0, world=3, timeout_s=0.5)
    released = threading.Event()
    blocking = {"on": False}

    def group_end() -> None:
        nccl.log.append("groupEnd")
        if blocking["on"]:
            released.wait(30)  # NCCL's host wait for the peer's connection

    def abort() -> None:
        nccl.comm.aborts += 1
        released.set()  # ncclCommAbort releases the blocked group end

    nccl.groupEnd = group_end  # type: ignore[method-assign]
    nccl.comm.abort = abort  # type: ignore[method-assign]
    buf = torch.zeros(4, dtype=torch.uint8)
    t.begin_step(1)
    t.exchange([(1, buf)], [(1, buf)], round_index=0)  # peer 1 connects
    assert t._connected == {1}
    blocking["on"] = True
    start = time.monotonic()
    with pytest.raises(TransportError) as err:
        t.start_exchange([(1, buf), (2, buf)], [], round_index=1)
    assert time.monotonic() - start < 10
    assert str(err.value) == (
        "refit rank 0: step 1 round 1: NCCL could not connect to refit ranks [2] within "
        "0.5 s: they never reached this round (communicator aborted)"
    )
    assert nccl.comm.aborts == 1 and released.is_set()
    with pytest.raises(GroupUnusableError):
        t.begin_step(2)


# -- 4. no hang at join, at init, or while a peer is dead ----------------------------------


def test_ranks_that_never_join_are_named() -> None:
    store = dist.HashStore()
    nccl = FakeNccl()
    out = in_threads(lambda r: share_unique_id(store, nccl, r, 6, 1.0), [0, 1, 2, 4])
    for rank in (0, 1, 2, 4):
        assert isinstance(out[rank], TransportError), out[rank]
        assert str(out[rank]) == (
            f"refit ranks [3, 5] never joined within 1 s (seen from refit rank {rank}): the "
            "process died, hangs, or was never started"
        )


def test_an_init_that_never_returns_is_abandoned_and_aborted_if_it_forms() -> None:
    release = threading.Event()
    late = FakeComm([])

    def hang(world: int, uid: Any, rank: int) -> FakeComm:
        release.wait(30)
        return late

    nccl = FakeNccl(make_comm=hang)
    start = time.monotonic()
    with pytest.raises(TransportError) as err:
        open_communicator(nccl, CUPY14_ID, 1, 2, 0, 0.3)
    assert time.monotonic() - start < 5
    assert str(err.value) == (
        "refit rank 1: NCCL init did not finish within 0.3 s: a peer died or cannot be "
        "reached after joining (abandoned; aborted if it forms)"
    )
    release.set()  # the communicator forms after all: nobody holds it
    deadline = time.monotonic() + 10
    while late.aborts == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late.aborts == 1


def test_an_init_error_is_a_transport_error_with_nccls_message() -> None:
    def fail(world: int, uid: Any, rank: int) -> FakeComm:
        raise FakeNcclError("NCCL_ERROR_SYSTEM_ERROR: unhandled system error")

    with pytest.raises(TransportError) as err:
        open_communicator(FakeNccl(make_comm=fail), CUPY14_ID, 0, 2, 0, 10.0)
    assert str(err.value) == (
        "refit rank 0: NCCL init failed (NCCL_ERROR_SYSTEM_ERROR: unhandled system error)"
    )
    assert isinstance(err.value.__cause__, FakeNcclError)


def test_an_async_nccl_error_fails_the_wait_in_a_fraction_of_the_timeout() -> None:
    t, nccl = transport(rank=2, world=4, timeout_s=60.0, polls=None)  # never completes
    nccl.comm.async_error = FakeNcclError(
        "NCCL_ERROR_REMOTE_ERROR: remote process exited or there was a network error"
    )
    nccl.comm.async_after = 3
    t.begin_step(5)
    pending = t.start_exchange([], [(0, torch.zeros(4, dtype=torch.uint8))], round_index=1)
    start = time.monotonic()
    with pytest.raises(TransportError) as err:
        pending.wait()
    took = time.monotonic() - start
    assert str(err.value) == (
        "refit rank 2: step 5 round 1: NCCL reported an asynchronous error "
        "(NCCL_ERROR_REMOTE_ERROR: remote process exited or there was a network error); "
        "a peer has died or the network failed (communicator aborted)"
    )
    assert nccl.comm.async_checks == 3
    assert 0.1 <= took < 2.0, took  # three checks 50 ms apart, not the 60 s timeout
    assert nccl.comm.aborts == 1
    with pytest.raises(GroupUnusableError):
        t.begin_step(6)


# -- 5. gathers and barriers through the store ----------------------------------------------


class CountingStore:
    """A real store, its calls counted by name; ``slow_reads`` delays each ``multi_get``
    (a rank slow to read the keys its peers may already be deleting)."""

    def __init__(self, store: dist.Store, slow_reads: float = 0.0) -> None:
        self.store, self.slow_reads = store, slow_reads
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            if name == "multi_get" and self.slow_reads:
                time.sleep(random.uniform(0, self.slow_reads))
            return method(*args)

        return counted


def test_gathers_cost_a_few_store_requests_and_leave_no_history() -> None:
    world, rounds = 4, 12
    port = free_port()
    timeout = datetime.timedelta(seconds=20)
    master = dist.TCPStore("127.0.0.1", port, world, True, timeout, wait_for_workers=False)
    stores = {
        r: CountingStore(
            dist.PrefixStore("refit-nccl", master if r == 0 else dist.TCPStore(
                "127.0.0.1", port, world, False, timeout)),
            slow_reads=0.02 if r == 3 else 0.0,
        )
        for r in range(world)
    }  # fmt: skip
    parts = {r: transport(r, world, stores[r], timeout_s=20.0) for r in range(world)}

    def run(rank: int) -> list[list[str]]:
        t = parts[rank][0]
        seen = []
        for i in range(rounds):
            seen.append(t.all_gather_object_str(f"r{rank}-g{i}" * (1 + rank)))
            if i % 4 == 3:
                t.barrier()
        return seen

    out = in_threads(run, list(range(world)))
    want = [[f"r{r}-g{i}" * (1 + r) for r in range(world)] for i in range(rounds)]
    assert out == {r: want for r in range(world)}
    syncs = rounds + rounds // 4
    for r in range(world):
        # Per sync: one set, one wait, one delete (none the first), one multi_get per
        # gather; never a get per peer.
        assert stores[r].calls == {
            "set": syncs, "wait": syncs, "delete_key": syncs - 1, "multi_get": rounds,
        }, stores[r].calls  # fmt: skip
        assert parts[r][1].log == []  # no NCCL call for a gather or a barrier
    group = dist.PrefixStore("refit-nccl", master)
    # Only the last sync's keys are left; every earlier one was deleted by its owner.
    left = [
        (n, r) for n in range(1, syncs + 1) for r in range(world) if group.check([f"sync/{n}/{r}"])
    ]
    assert left == [(syncs, r) for r in range(world)]


def test_a_barrier_names_the_rank_that_never_came() -> None:
    store = dist.HashStore()
    parts = {r: transport(r, 3, store, timeout_s=0.5) for r in (0, 1)}
    out = in_threads(lambda r: parts[r][0].barrier(), [0, 1])
    for rank in (0, 1):
        assert isinstance(out[rank], TransportError), out[rank]
        assert str(out[rank]) == (
            f"refit ranks [2] never reached barrier 1 within 0.5 s (seen from refit rank "
            f"{rank}): the process died, hangs, or was never started"
        )
        t, nccl = parts[rank]
        assert nccl.comm.aborts == 1
        assert nccl.log == []
        with pytest.raises(GroupUnusableError):
            t.barrier()
