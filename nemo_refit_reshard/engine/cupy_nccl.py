"""CuPy NCCL transport: one NCCL communicator spanning training and inference GPUs.

Joining. Every step of the init path is bounded by the connect timeout and names who is
missing; none can hang a rank:

1. :func:`share_unique_id` — refit rank 0 makes the NCCL unique id and publishes its 128
   raw bytes in the ``TCPStore`` the gloo transport also uses (so processes that run
   their own ``torch.distributed`` worlds join without touching them); every rank then
   posts an arrival key and waits for all W (``"refit ranks [3, 5] never joined within
   600 s"``), and reads the id back in the form its own CuPy takes: a tuple of signed
   chars for CuPy 13, ``bytes`` for CuPy 14 (decided by the type its ``get_unique_id()``
   returns, so ranks on different CuPy releases meet; the raw bytes on the wire are the
   same for both).
2. :func:`open_communicator` — ``NcclCommunicator`` (``ncclCommInitRank``) in a watchdog
   thread: past the timeout the caller gets :class:`TransportError`, and a communicator
   that forms later is aborted by that thread.

Each round's sends and receives are issued inside one ``ncclGroupStart/End`` on a
dedicated CUDA stream (:func:`issue_round`; the group is closed even when a launch
raises, or this thread's next NCCL call, vLLM's own TP collectives included, would be
swallowed into the open group); buffers are byte tensors, so bf16/fp8 travel as bytes.
Ordering is by CUDA events, not host synchronisation: ``start_exchange`` makes the NCCL
stream wait for everything queued so far on torch's current stream (the packs, and the
unpack that last read the receive buffers) and records a completion event after the
group; ``wait`` polls that event against ``timeout_s``, asking the communicator for an
asynchronous error every 50 ms (a dead peer surfaces in seconds, with NCCL's message), and
makes torch's stream wait on it before the unpacks are queued. On a timeout or an async
error the communicator is aborted and :class:`TransportError` raised.

Gathers and barriers go through the store, not NCCL: a barrier over NCCL would open a
connection to each of the W-1 peers on every rank. Each is one *sync* ``n``: every rank
sets ``sync/<n>/<rank>``, waits for all W keys (one request, bounded by ``timeout_s``,
naming the ranks that never came), and a gather reads them with one ``multi_get``. The
store keeps no history: a rank sets its key of sync ``n`` only after it left sync ``n-1``
(its ``multi_get`` done), so once all W keys of ``n`` exist nobody can still read sync
``n-1``, and each rank then deletes its own key of ``n-1``.

Step identity without tags. NCCL matches a pair's point-to-point messages in the
order they were issued on the communicator, and has no tags; the bytes on the wire are
exactly the staging spans (no header). What keeps a message of a failed step from
pairing with a later step is the communicator itself: any failure on a rank — a
timeout here, or an error of the step reported with ``fail_step`` (a pack that raised,
a check that failed) — aborts this rank's communicator, so nothing it issued can still
land, and every later step, barrier and gather is refused with ``GroupUnusableError``
naming the failed step (``engine/transport.py``'s ``StepGuard``). Its peers, waiting
for it, see NCCL's async error or time out and abort theirs. The group is thus poisoned
on every rank after any failure, and is re-joined (a new communicator) before the next
refit.

CuPy is imported lazily: importing this module never needs a GPU.
"""

from __future__ import annotations

import datetime
import threading
import time
from types import ModuleType
from typing import Any

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

UID_KEY = "uid"
JOINED_KEY = "joined"
ASYNC_CHECK_S = 0.05  # how often a wait asks NCCL for an asynchronous error

NCCL_HINT = "pip install nvidia-nccl-cu12 (CUDA 12) or nvidia-nccl-cu13 (CUDA 13)"
CUPY_HINT = "pip install cupy-cuda12x (CUDA 12) or cupy-cuda13x (CUDA 13)"


def cupy_unavailable_reason() -> str | None:
    """Why the cupy-nccl transport cannot run in this process, or None when it can.

    CuPy imports without NCCL's libraries (``cupy.cuda.nccl.available`` is then False)
    and without a device, so each is checked by name: the error then says what to
    install, not just "unavailable"."""
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as err:  # noqa: BLE001 - any import failure means "not installed"
        return f"CuPy does not import ({first_line(err)}): {CUPY_HINT}"
    if not getattr(nccl, "available", False):
        return f"CuPy {cupy.__version__} cannot load NCCL's library: {NCCL_HINT}"
    try:
        usable = bool(cupy.cuda.is_available())
    except Exception as err:  # noqa: BLE001 - CuPy 13 raises where 14 returns False
        return f"no CUDA device ({first_line(err)})"
    return None if usable else "no CUDA device (cupy.cuda.is_available() is False)"


def cupy_available() -> bool:
    """Whether CuPy, NCCL's library and a CUDA device are all there."""
    return cupy_unavailable_reason() is None


# -- joining: the unique id, the arrival wait, the communicator --------------------------


def encode_unique_id(uid: bytes | tuple[int, ...]) -> bytes:
    """The id's 128 raw bytes, whichever form the CuPy that made it returns (CuPy 13: a
    tuple of signed chars; 14: bytes)."""
    return bytes(b & 0xFF for b in uid)


_ID_TYPES: dict[int, type] = {}


def native_id_type(nccl: ModuleType) -> type:
    """The type this process's CuPy uses for an NCCL id: what its ``get_unique_id()``
    returns. Probed once per process: each call also starts an NCCL bootstrap root (a
    listening socket and thread) that no one will join."""
    key = id(nccl)
    if key not in _ID_TYPES:
        _ID_TYPES[key] = type(nccl.get_unique_id())
    return _ID_TYPES[key]


def decode_unique_id(raw: bytes, nccl: ModuleType) -> bytes | tuple[int, ...]:
    """``raw`` (:func:`encode_unique_id`) in the form this process's CuPy takes."""
    if native_id_type(nccl) is bytes:
        return bytes(raw)
    return tuple(b - 256 if b > 127 else b for b in raw)  # C chars are signed


def _store_failed(rank: int, what: str, err: BaseException) -> TransportError:
    return TransportError(
        f"refit rank {rank}: {what}: the refit group's store (hosted by refit rank 0) "
        f"failed ({first_line(err)})"
    )


def wait_for_ranks(
    store: dist.Store, key: str, rank: int, world_size: int, timeout_s: float, what: str
) -> list[str]:
    """Wait up to ``timeout_s`` until every rank's ``<key>/<rank>`` exists; the keys.

    On expiry the :class:`TransportError` names the ranks whose key is missing: "refit
    ranks [3, 5] never joined within 600 s" (``what`` = "joined")."""
    keys = [f"{key}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return keys
    except RuntimeError as err:  # DistStoreError: a timeout, or the store is gone
        try:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
        except RuntimeError as check_err:
            raise _store_failed(rank, what, check_err) from err
        if not missing:
            return keys  # every rank came just as the wait gave up
        raise TransportError(
            f"refit ranks {missing} never {what} within {timeout_s:g} s (seen from refit "
            f"rank {rank}): the process died, hangs, or was never started"
        ) from err


def share_unique_id(
    store: dist.Store, nccl: ModuleType, rank: int, world_size: int, timeout_s: float
) -> bytes | tuple[int, ...]:
    """Refit rank 0's NCCL unique id, on every rank, in the form its CuPy takes.

    Rank 0 publishes the raw bytes before it arrives, so once every rank's arrival key
    exists the id is there too; the arrival wait is what bounds a missing peer (NCCL's
    own init would wait for it forever). Collective over the group."""
    if rank == 0:
        uid = nccl.get_unique_id()
        store.set(UID_KEY, encode_unique_id(uid))
    store.set(f"{JOINED_KEY}/{rank}", b"")
    wait_for_ranks(store, JOINED_KEY, rank, world_size, timeout_s, "joined")
    if rank == 0:
        return uid
    return decode_unique_id(store.get(UID_KEY), nccl)


def _use_device(device: int) -> None:
    """Make CUDA device ``device`` current on this thread (the watchdog's own: a new
    thread runs on device 0 until it sets another, so 0 needs no call)."""
    if device != 0:
        import cupy

        cupy.cuda.runtime.setDevice(device)


def open_communicator(
    nccl: ModuleType,
    uid: bytes | tuple[int, ...],
    rank: int,
    world_size: int,
    device: int,
    timeout_s: float,
) -> Any:
    """``nccl.NcclCommunicator(world_size, uid, rank)`` on ``device``, bounded by
    ``timeout_s``.

    ``ncclCommInitRank`` blocks until every rank has called it, and a blocking call
    cannot be interrupted: it runs in a daemon thread the caller stops waiting for. Past
    the timeout the caller gets :class:`TransportError`; if the communicator forms later
    after all, that thread aborts it (nobody holds it). Any init error (CuPy's
    ``NcclError``, ``CUDARuntimeError``) becomes a :class:`TransportError` whose cause it
    is."""
    lock = threading.Lock()
    box: dict[str, Any] = {}

    def init() -> None:
        try:
            _use_device(device)
            comm = nccl.NcclCommunicator(world_size, uid, rank)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            with lock:
                box["error"] = err
            return
        with lock:
            if box.get("abandoned"):
                comm.abort()  # the caller gave up: free what no one will use
            else:
                box["comm"] = comm

    thread = threading.Thread(target=init, name=f"refit-nccl-init-{rank}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    with lock:
        if "comm" in box:
            return box["comm"]
        if "error" not in box:
            box["abandoned"] = True
            raise TransportError(
                f"refit rank {rank}: NCCL init did not finish within {timeout_s:g} s: a peer "
                "died or cannot be reached after joining (abandoned; aborted if it forms)"
            )
    err = box["error"]
    raise TransportError(f"refit rank {rank}: NCCL init failed ({first_line(err)})") from err


# -- one round ----------------------------------------------------------------------------


ABORT_JOIN_S = 5.0  # how long an aborted connecting round is given to return


def issue_round(
    nccl: ModuleType, comm: Any, sends: Messages, recvs: Messages, stream_ptr: int
) -> None:
    """Every receive and send of a round inside one NCCL group on ``stream_ptr``.

    The group is closed on every path: an error inside an open group would leave it
    open on this thread, and its next NCCL call (vLLM's own TP collectives included)
    would be swallowed into it. The launch error is the one raised, not the close's."""
    nccl.groupStart()
    try:
        for peer, buf in recvs:
            comm.recv(buf.data_ptr(), buf.numel(), nccl.NCCL_UINT8, peer, stream_ptr)
        for peer, buf in sends:
            comm.send(buf.data_ptr(), buf.numel(), nccl.NCCL_UINT8, peer, stream_ptr)
    except BaseException:
        try:
            nccl.groupEnd()
        except Exception:  # noqa: BLE001, S110 - the launch error is the one to report
            pass
        raise
    nccl.groupEnd()


class _CudaOrder:
    """Orders the NCCL stream against torch's current stream with CUDA events, never
    with a host synchronisation. ``stream``: the CuPy stream NCCL runs on (kept alive
    here: torch's ``ExternalStream`` does not own it)."""

    def __init__(self, device: torch.device, stream: Any) -> None:
        self.device = device
        self.stream = stream
        self.ptr: int = stream.ptr
        self._torch_stream = torch.cuda.ExternalStream(stream.ptr, device=device)

    def before_issue(self) -> None:
        """The NCCL stream waits for the work queued on torch's stream (packs, unpacks)."""
        queued = torch.cuda.Event()
        queued.record(torch.cuda.current_stream(self.device))
        self._torch_stream.wait_event(queued)

    def record_done(self) -> Any:
        """An event recorded after the round on the NCCL stream."""
        done = torch.cuda.Event()
        done.record(self._torch_stream)
        return done

    def after_done(self, done: Any) -> None:
        """Work queued on torch's stream from now on runs after the round."""
        torch.cuda.current_stream(self.device).wait_event(done)


class _PendingNccl:
    def __init__(self, transport: CupyNcclTransport, done: Any, round_index: int):
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
        """``timeout_s`` bounds every exchange, gather and barrier; ``connect_timeout_s``
        (default: the same) the rendezvous, the arrival of every rank and NCCL's init."""
        reason = cupy_unavailable_reason()
        if reason is not None:
            raise TransportError(
                f"the cupy-nccl transport cannot run here: {reason}; use the gloo transport on CPU"
            )
        import cupy
        from cupy.cuda import nccl

        index = device if device is not None else torch.cuda.current_device()
        connect_s = connect_timeout_s or timeout_s
        if store is None:
            store = refit_store(host, port, rank, world_size, connect_s, secret)
        group_store = dist.PrefixStore(prefix, store)
        uid = share_unique_id(group_store, nccl, rank, world_size, connect_s)
        with cupy.cuda.Device(index):
            order = _CudaOrder(torch.device("cuda", index), cupy.cuda.Stream(non_blocking=True))
        comm = open_communicator(nccl, uid, rank, world_size, index, connect_s)
        self._attach(nccl, comm, order, group_store, rank, world_size, timeout_s)

    @classmethod
    def from_parts(
        cls,
        nccl: Any,
        comm: Any,
        order: Any,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> CupyNcclTransport:
        """A transport over a communicator opened elsewhere (:func:`open_communicator`),
        its stream ordering (``_CudaOrder``) and the group's store; the tests' stand-ins
        for what needs a GPU come in here."""
        transport = cls.__new__(cls)
        transport._attach(nccl, comm, order, store, rank, world_size, timeout_s)
        return transport

    def _attach(
        self,
        nccl: Any,
        comm: Any,
        order: Any,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
    ) -> None:
        self._nccl, self.comm, self._order, self.store = nccl, comm, order, store
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.device = getattr(order, "device", None)
        self.guard = StepGuard(rank)
        self._syncs = 0  # store syncs (gathers, barriers) this rank has begun
        self._aborted = False
        self._connected: set[int] = set()  # peers a round has already reached

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

    def _fail(self, message: str) -> TransportError:
        """A :class:`TransportError` of this rank's current step, the group poisoned."""
        error = TransportError(message)
        self.fail_step(error)
        return error

    def start_exchange(
        self,
        sends: Messages,
        recvs: Messages,
        round_index: int = 0,
    ) -> _PendingNccl:
        self.guard.check()
        self._order.before_issue()
        peers = {p for p, _ in [*sends, *recvs]}
        try:
            if peers <= self._connected:
                issue_round(self._nccl, self.comm, sends, recvs, self._order.ptr)
            else:
                self._issue_connecting(sends, recvs, peers - self._connected, round_index)
        except TransportError:
            raise
        except Exception as err:  # noqa: BLE001 - NCCL errors have several types
            raise self._fail(
                f"refit rank {self.rank}: {self.guard.where(round_index)}NCCL launch failed "
                f"({first_line(err)})"
            ) from err
        self._connected |= peers
        return _PendingNccl(self, self._order.record_done(), round_index)

    def _issue_connecting(
        self, sends: Messages, recvs: Messages, new: set[int], round_index: int
    ) -> None:
        """A round that reaches a peer for the first time. NCCL connects a pair lazily,
        inside ``ncclGroupEnd``, which waits on the host for the peer's side: a peer that
        lives but never reaches this round would hang the rank there, out of reach of
        every timeout. So the group is issued on a watchdog thread; past ``timeout_s``
        the communicator is aborted (which releases the blocked call) and the step
        fails, naming the peers."""
        box: dict[str, BaseException] = {}
        index = self.device.index if self.device is not None else 0

        def issue() -> None:
            try:
                _use_device(index)
                issue_round(self._nccl, self.comm, sends, recvs, self._order.ptr)
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = err

        thread = threading.Thread(target=issue, name=f"refit-nccl-connect-{self.rank}")
        thread.daemon = True
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            error = self._fail(
                f"refit rank {self.rank}: {self.guard.where(round_index)}NCCL could not "
                f"connect to refit ranks {sorted(new)} within {self.timeout_s:g} s: they "
                "never reached this round (communicator aborted)"
            )
            thread.join(ABORT_JOIN_S)  # the abort releases the blocked group end
            raise error
        if "error" in box:
            raise box["error"]

    def _poll(self, done: Any, round_index: int = 0) -> None:
        start = time.monotonic()
        deadline, next_check = start + self.timeout_s, start + ASYNC_CHECK_S
        while not done.query():
            now = time.monotonic()
            if now >= next_check:
                self._check_async_error(round_index)
                next_check = now + ASYNC_CHECK_S
            if now > deadline:
                raise self._fail(
                    f"refit rank {self.rank}: {self.guard.where(round_index)}NCCL exchange "
                    f"did not finish within {self.timeout_s:g} s; a peer has died or stopped "
                    "responding (communicator aborted)"
                )
            time.sleep(0.0005)
        # Unpacks queued after this read what NCCL wrote: order them on the GPU.
        self._order.after_done(done)

    def _check_async_error(self, round_index: int) -> None:
        """NCCL's asynchronous error (a peer that died, a broken connection) as a
        :class:`TransportError`, in seconds rather than at the timeout."""
        try:
            self.comm.check_async_error()
        except Exception as err:  # noqa: BLE001 - CuPy's NcclError, or any other
            raise self._fail(
                f"refit rank {self.rank}: {self.guard.where(round_index)}NCCL reported an "
                f"asynchronous error ({first_line(err)}); a peer has died or the network "
                "failed (communicator aborted)"
            ) from err

    def all_gather_object_str(self, value: str) -> list[str]:
        self.guard.check()
        return [v.decode() for v in self._sync("gather", value.encode(), read=True)]

    def barrier(self) -> None:
        self.guard.check()
        self._sync("barrier", b"", read=False)

    def _sync(self, kind: str, value: bytes, read: bool) -> list[bytes]:
        """One store sync (module docstring): set this rank's key, wait for all W, delete
        this rank's key of the previous sync (no one can read it any more), and with
        ``read`` get every rank's value in one request."""
        self._syncs += 1
        n = self._syncs
        what = f"{kind} {n}"
        try:
            self.store.set(f"sync/{n}/{self.rank}", value)
            keys = wait_for_ranks(
                self.store, f"sync/{n}", self.rank, self.world_size, self.timeout_s,
                f"reached {what}",
            )  # fmt: skip
            if n > 1:
                self.store.delete_key(f"sync/{n - 1}/{self.rank}")
            return [bytes(v) for v in self.store.multi_get(keys)] if read else []
        except TransportError as err:
            self.fail_step(err)
            raise
        except RuntimeError as err:
            error = _store_failed(self.rank, what, err)
            self.fail_step(error)
            raise error from err

    def close(self) -> None:
        if not self._aborted:  # an aborted communicator is already freed
            self.comm.destroy()
