"""The worker API of the colocated refit (``plan/colocation.py``), framework neutral.

A training rank in a colocated deployment::

    trainer = ColocatedTrainer(endpoint, dict(model.named_parameters()), plan)
    address = trainer.listen()   # where the worker on this GPU connects (None: no worker)
    # ... ship every worker its host's address, its plan slice and the secret ...
    trainer.join()               # the training ranks' refit group (endpoint: S ranks)
    trainer.accept_worker()      # hands the worker its staging, once
    trainer.refit()              # every step, on every training rank

and the generation worker on the same GPU::

    worker = ColocatedWorker(dict(model.named_parameters()))
    worker.connect(address, secret, plan_slice, group_rank)
    worker.refit()               # every step, while its host refits

Both are versioned like :class:`~.refit_worker.RefitWorker`: the weights are stale from
the start of a step until it completes, and stay so if it fails. Nothing here knows
Megatron, vLLM or Ray.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from multiprocessing.connection import (
    Client,
    Connection,
    answer_challenge,
    deliver_challenge,
)

import torch

from ...engine.colocated import ColocatedGuest, ColocatedHost
from ...engine.delta import DeltaOptions
from ...engine.refit import check_same_fingerprint
from ...plan import Colocation, PlanError, RankPlan, RefitPlan, load_plan_json, rank_plan
from .endpoint import RefitEndpoint
from .refit_worker import RefitWorker
from .weights import WeightsState


def _authkey(secret: str | None) -> bytes:
    if not secret:
        raise ValueError("a colocated refit needs the run's secret (RefitEndpoint.secret)")
    return secret.encode()[:32]


class ColocatedTrainer:
    """A training rank of a colocated refit: a member of the training ranks' group and
    the host of the generation worker on its GPU."""

    def __init__(
        self,
        endpoint: RefitEndpoint,
        tensors: Mapping[str, torch.Tensor],
        plan: RefitPlan | RankPlan,
        device: torch.device | str | None = None,
        weights: WeightsState | None = None,
        guest_plan: RankPlan | None = None,
        delta: DeltaOptions | None = None,
    ) -> None:
        """``endpoint``: the training ranks' group (``world_size`` = S, ``group_rank`` =
        this training rank). ``plan``: the full colocated plan, or this rank's slice with
        ``guest_plan`` the slice of the worker on its GPU (None: no worker there).
        ``delta``: refit with deltas (``engine/delta/colocated.py``), every rank alike
        (default: the endpoint's)."""
        if not plan.colocated_hosts:
            raise PlanError("not a colocated plan: build it with plan_refit(..., colocation=)")
        if endpoint.world_size != plan.num_sources:
            raise ValueError(
                f"a colocated refit group is the {plan.num_sources} training ranks; the "
                f"endpoint says {endpoint.world_size}"
            )
        self.endpoint, self.plan = endpoint, plan
        self.weights = weights if weights is not None else WeightsState()
        # The transport comes from the same code as a separate-pools member's.
        self.net = RefitWorker(endpoint, tensors, device)
        rank = endpoint.group_rank
        guest = Colocation(plan.colocated_hosts).guest_of(rank, plan.num_sources)
        self.guest_rank = guest
        if isinstance(plan, RefitPlan):
            own, guest_plan = (
                rank_plan(plan, rank),
                (rank_plan(plan, guest) if guest is not None else None),
            )
        else:
            own = plan
            if guest_plan is not None and guest_plan.fingerprint != plan.fingerprint:
                raise PlanError(
                    f"training rank {rank}: its slice is of plan {plan.fingerprint[:12]}, its "
                    f"guest's of {guest_plan.fingerprint[:12]}; ship both from one plan"
                )
        self.host = ColocatedHost(
            own,
            guest_plan,
            rank,
            tensors,
            self.net.device,
            delta if delta is not None else endpoint.delta,
        )
        self._listener: socket.socket | None = None

    def listen(self, ip: str = "127.0.0.1") -> str | None:
        """Start listening for the worker on this GPU, on ``ip`` (the worker shares the
        node: the loopback reaches it); its address ``ip:port`` (None when no worker
        shares this GPU)."""
        if self.guest_rank is None:
            return None
        self._listener = socket.create_server((ip, 0))
        return f"{ip}:{self._listener.getsockname()[1]}"

    def join(self) -> None:
        """Rendezvous with the other training ranks, then check that every one holds this
        plan (collective): each packs for its guest from its own plan, so a rank that
        planned otherwise would tear the weights; it is refused on every rank, in one line
        naming the ranks and fingerprints, before any step."""
        self.net.join()
        assert self.net.transport is not None
        try:
            check_same_fingerprint(self.net.transport, self.plan.fingerprint)
        except PlanError:
            self.net.close()
            raise

    def accept_worker(self) -> None:
        """Wait for the worker on this GPU and hand it its staging (once)."""
        if self._listener is None:
            return
        timeout = self.endpoint.connect_timeout_s or self.endpoint.timeout_s
        self._listener.settimeout(timeout)
        try:
            sock, _ = self._listener.accept()
        except TimeoutError as err:
            raise TimeoutError(
                f"colocated refit: no generation worker connected to training rank "
                f"{self.endpoint.group_rank} within {timeout:g} s"
            ) from err
        finally:
            self._listener.close()
            self._listener = None
        sock.setblocking(True)
        conn = Connection(sock.detach())
        # multiprocessing's own handshake (what Listener.accept does): the worker proves
        # it holds the run's secret, and so does this rank.
        key = _authkey(self.endpoint.secret)
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
        self.host.attach(conn, self.endpoint.timeout_s)

    def refit(self, step: int | None = None) -> float:
        """One refit step (collective over the training ranks, and with the worker on this
        GPU); the seconds it took."""
        if self.net.transport is None:
            raise RuntimeError("call join() before refit()")
        step = step if step is not None else (self.weights.step or 0) + 1
        self.weights.begin(step, self.plan.fingerprint)
        t0 = time.perf_counter()
        try:
            self.host.replay(self.net.transport, step)
        except BaseException as err:
            self.weights.failed(step, err)
            raise
        self.weights.done(step, self.plan.fingerprint)
        return time.perf_counter() - t0

    def abort(self, err: BaseException) -> None:
        """This step fails before it starts (``err``): tell the worker on this GPU now, so
        that it stops waiting for the staging instead of running into its timeout."""
        if self.host.signals is not None:
            self.host.signals.abort(err)

    def close(self) -> None:
        """Leave the group and release the worker's staging (the shared segment or CUDA
        buffer). Idempotent; the worker keeps its own mapping until it closes."""
        try:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            if self.host.signals is not None:
                self.host.signals.conn.close()
            self.net.close()
        finally:
            self.host.close()


class ColocatedWorker:
    """The generation worker of a colocated refit: unpacks its host's staging."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device | str | None = None,
        weights: WeightsState | None = None,
    ) -> None:
        self.tensors = tensors
        first = next(iter(tensors.values()), None)
        self.device = torch.device(device) if device is not None else (
            first.device if first is not None else torch.device("cpu")
        )  # fmt: skip
        self.weights = weights if weights is not None else WeightsState()
        self.guest: ColocatedGuest | None = None
        self._conn: Connection | None = None
        self.fingerprint: str | None = None

    def connect(
        self,
        address: str,
        secret: str | None,
        plan: RefitPlan | RankPlan | str,
        group_rank: int,
        timeout_s: float,
        connect_timeout_s: float | None = None,
    ) -> None:
        """Connect to the training rank on this GPU (``ip:port``), open its staging and
        compile this rank's unpack of ``plan`` (its slice or the full plan)."""
        if isinstance(plan, str):
            plan = load_plan_json(plan)
        self.close()
        ip, _, port = address.rpartition(":")
        deadline = time.monotonic() + (connect_timeout_s or timeout_s)
        while True:  # the host listens once it has planned: slow on a loaded machine
            try:
                self._conn = Client((ip, int(port)), authkey=_authkey(secret))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"colocated refit: the training rank at {address} did not accept "
                        f"generation rank {group_rank} within {connect_timeout_s or timeout_s:g} s"
                    ) from None
                time.sleep(0.1)
        self.guest = ColocatedGuest(plan, group_rank, self.tensors, self.device)
        self.guest.attach(self._conn, timeout_s)
        self.fingerprint = plan.fingerprint

    def refit(self, step: int | None = None) -> float:
        """One refit step on this worker (with its host's); the seconds it took."""
        if self.guest is None or self.fingerprint is None:
            raise RuntimeError("call connect() before refit()")
        step = step if step is not None else (self.weights.step or 0) + 1
        self.weights.begin(step, self.fingerprint)
        t0 = time.perf_counter()
        try:
            self.guest.replay(step)
        except BaseException as err:
            self.weights.failed(step, err)
            raise
        self.weights.done(step, self.fingerprint)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self.guest is not None:
            self.guest.close()
            self.guest = None


__all__ = ["ColocatedTrainer", "ColocatedWorker"]
