"""The worker side of vLLM's weight-transfer API: the ``reshard`` ``WeightTransferEngine``.

vLLM builds one weight-transfer engine per worker from
``WeightTransferConfig(backend="reshard")`` (``WeightTransferEngineFactory.create_engine``)
once the model is loaded, then drives it through the four phases its trainer
weight-transfer engine sends over a ``VLLMWeightSyncClient``:

* ``init_weight_transfer_engine(ReshardInitInfo)``: join the refit group as rank
  ``first_rank + engine rank``, check this rank's plan slice against the live
  parameters and the trainer's plan fingerprint, compile its program (once); in a
  colocated refit, connect to the training rank on this GPU and open its staging
  instead (as vLLM's ``ipc`` backend serves colocated deployments);
* ``start_weight_update()``: open a session (the weights are written in place, so
  there is nothing to prepare);
* ``update_weights(ReshardUpdateInfo)``: replay the compiled program, writing the live
  parameters in place, concurrently with the trainer ranks' own replay;
* ``finish_weight_update()``: commit the update's version — only if the replay
  completed; a failed update leaves the last committed version in place.

Everything is the vLLM worker-side code of ``worker.py`` (this weight-transfer engine
stands in for vLLM's ``Worker`` there: it holds ``vllm_config`` and the model); nothing
is forked.
Refused at creation (vLLM start-up, before any trainer connects) by the same
``check_engine`` as there: quantization other than block FP8, an FP8 KV cache, EPLB,
context parallel, MoE and block-FP8 kernels that re-lay weights after loading, and
derived tensors a refit cannot recompute in place (``derived.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...engine.rendezvous import store_client, take_text
from ..worker import RefitEndpoint, StaleWeightsError
from .worker import (
    check_engine,
    refit_close,
    refit_connect_colocated,
    refit_engine_rank,
    refit_join,
    refit_load_plan,
    refit_status,
    refit_step,
)

BACKEND = "reshard"


@dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    """What the trainer decided, shipped to every worker of the vLLM engine alike.

    ``endpoint``: the refit group's :class:`RefitEndpoint` JSON (rendezvous, secret,
    transport, timeouts; its ``group_rank`` is ignored). ``first_rank``: the refit rank
    of this vLLM engine's rank 0 (the S training ranks come first). ``plan``: refit rank (as
    a string) -> that rank's plan slice JSON, or one JSON text / path template as
    ``refit_load_plan`` takes; None with ``plan_key``: this worker reads its own slice
    from the refit group's store, under ``plan_key/<refit rank>`` (vLLM hands every
    worker the same arguments: shipping every slice to each would send each worker
    all D slices). ``fingerprint``: the full plan the trainer built.
    ``colocated``: for a colocated refit (each worker on a training rank's GPU), the
    address of the training rank hosting each engine rank, in engine-rank order; the
    worker connects there instead of joining the group (``endpoint``: the training
    ranks' group, for its secret and timeouts).
    """

    endpoint: str
    first_rank: int
    plan: str | dict[str, str] | None
    fingerprint: str
    colocated: list[str] | None = None
    plan_key: str | None = None


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """One update: the trainer's step number and the version it will commit."""

    step: int
    weight_version: str | None = None


@dataclass
class _Session:
    step: int | None = None
    version: str | None = None
    updated: bool = False


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """vLLM worker weight-transfer engine ``reshard``: the trainer's local shards straight
    into this rank's live parameters (fused ones included), in place, on a plan built
    once."""

    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    # The plan covers the target model; a draft model would need its own plan.
    supports_draft_weight_update = False

    def __init__(
        self,
        config: Any,
        vllm_config: Any,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        # Refuse at creation (vLLM start-up), before any trainer connects.
        import vllm

        check_engine(model, vllm_config, vllm.__version__)
        self.weight_version: str | None = None  # the last committed update's
        self.refit_rank: int | None = None
        self._session: _Session | None = None

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        """Join the refit group and compile this rank's program. Collective with every
        trainer rank and every other worker (they all load the plan together)."""
        if init_info.colocated is not None:
            rank = init_info.first_rank + refit_engine_rank(self)
            self.refit_rank = refit_connect_colocated(
                self, init_info.endpoint, init_info.first_rank, init_info.colocated,
                self._plan_of(init_info, rank), init_info.fingerprint,
            )  # fmt: skip
            return
        self.refit_rank = refit_join(self, init_info.endpoint, init_info.first_rank)
        refit_load_plan(self, self._plan_of(init_info, self.refit_rank), init_info.fingerprint)

    @staticmethod
    def _plan_of(init_info: ReshardInitInfo, rank: int) -> str | dict[str, str]:
        """The plan as shipped, or (``plan=None``) this rank's own slice, read from the
        refit group's store: the only plan bytes this worker receives."""
        if init_info.plan is not None:
            return init_info.plan
        if init_info.plan_key is None:
            raise ValueError("ReshardInitInfo has neither plan nor plan_key: nothing to load")
        e = RefitEndpoint.from_json(init_info.endpoint)
        who = f"vLLM worker (refit rank {rank})"
        store = store_client(e.host, e.port, e.connect_timeout_s or e.timeout_s, e.secret, who)
        return {str(rank): take_text(store, init_info.plan_key, rank)}

    def start_weight_update(self) -> None:
        if self.refit_rank is None:
            raise RuntimeError("init_weight_transfer_engine must come before a weight update")
        self._session = _Session()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # As the base class, but the device sync only where there is a device queue:
        # the program's unpack already ran on this thread on CPU.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        """Replay this rank's program: the parameters are written in place. A failure
        leaves them marked stale and the session uncommittable."""
        if self._session is None:
            raise RuntimeError("start_weight_update must come before update_weights")
        self._session.updated = False
        refit_step(self, update_info.step)
        self._session.step, self._session.version = update_info.step, update_info.weight_version
        self._session.updated = True

    def finish_weight_update(self) -> None:
        """Commit the session's version; refused if its replay did not complete."""
        session, self._session = self._session, None
        if session is None or not session.updated:
            raise StaleWeightsError(
                f"refit rank {self.refit_rank}: no completed update to commit; the weights "
                f"stay at version {self.weight_version!r} ({refit_status(self)['stale']})"
            )
        self.weight_version = session.version if session.version is not None else str(session.step)

    def status(self) -> dict[str, object]:
        """The committed version and the weights' state (last complete step, staleness)."""
        return {"weight_version": self.weight_version, **refit_status(self)}

    def shutdown(self) -> None:
        refit_close(self)
        self.refit_rank = None
