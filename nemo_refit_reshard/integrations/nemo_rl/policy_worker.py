"""What a NeMo RL Megatron policy worker gains for ``refit.backend: reshard``.

:class:`ReshardPolicyWorkerMixin` is mixed into NeMo RL's ``MegatronPolicyWorkerImpl``
(``megatron_worker.py``) and reads only what that worker has: ``self.model`` (the
Megatron-core model, wrapped in DDP / ``Float16Module``, or a list of VPP chunks) and
``self.rank``. It sends from the **local shards** — the live parameters — with no
gather: no Megatron-Bridge export, no collective inside Megatron's groups. The driver
(:class:`~.synchronizer.ReshardWeightSynchronizer`) calls, on every policy worker::

    reshard_describe()            -> parallel position, model options, live tensors
    reshard_address(host)         -> (policy rank 0 only) the group's rendezvous: where it
                                     hosts the group's store, and the run's secret
    reshard_join(endpoint_json)   -> joins the refit group as refit rank self.rank
    reshard_load_plan(slice_json) -> checks the slice against the live tensors, compiles
    reshard_step()                -> one refit (collective); timing (and, for a delta
                                     refit, the bytes sent and their dense weight)
    reshard_close()

and, in a colocated deployment (``policy.generation.colocated.enabled``), instead of
``reshard_join`` / ``reshard_load_plan``::

    reshard_colocated_listen(endpoint_json, slices) -> the address the vLLM worker on
                                                       this GPU connects to (or None)
    reshard_colocated_join()      -> joins the training ranks' group, accepts that worker

The tensors a plan is compiled against must stay the live ones: Megatron's DDP offload
(``offload_to_cpu`` / ``reload_from_cpu``, which NeMo RL's colocated refit runs around
every sync) resizes the parameters' storage in place, which keeps them; a model whose
parameters were replaced, or are offloaded at the step, is refused by name before
anything moves (``storage_problems``).

Nothing here imports NeMo RL, so it is tested on a CPU Megatron-core model directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...engine.program import live_tensor_problems
from ...engine.rendezvous import Rendezvous
from ...plan import PlanError, RankPlan, load_plan_json
from ..checkpoint_engine.address import group_rendezvous
from ..megatron import live_megatron_options, live_megatron_position, megatron_live_tensors
from ..worker import ColocatedTrainer, RefitEndpoint, RefitWorker, describe_tensors, device_name


@dataclass
class _PolicyRefit:
    live: dict[str, torch.Tensor]
    worker: RefitWorker | ColocatedTrainer
    steps: int = 0
    # The storages the compiled program reads (StorageImpl identities), by tensor name.
    storages: dict[str, int] | None = None


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def storage_problems(storages: dict[str, int], now: dict[str, torch.Tensor]) -> list[str]:
    """Why the tensors a program was compiled against are no longer the model's live
    ones: a parameter replaced (a new storage: ``model.to(...)``, ``param.data = ...``)
    or offloaded (its storage resized below what it views). A storage resized in place
    and back (Megatron DDP's offload and reload) is the same storage: no problem."""
    problems = []
    for name, want in storages.items():
        t = now.get(name)
        if t is None:
            problems.append(f"{name}: no longer in the model")
        elif _storage_id(t) != want:
            problems.append(f"{name}: replaced by a new tensor since the plan was loaded")
        elif t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
            problems.append(f"{name}: offloaded (its storage holds no data now)")
    return problems


class ReshardPolicyWorkerMixin:
    """Refit methods for a Megatron policy worker (``self.model``, ``self.rank``)."""

    model: Any
    rank: int
    _reshard: _PolicyRefit | None = None

    def _reshard_live(self) -> dict[str, torch.Tensor]:
        return megatron_live_tensors(self.model)

    def _reshard_before_step(self) -> None:
        """Make the live parameters current before they are read (a framework hook)."""

    def set_rollout_num_gpus_per_engine(self, num_gpus_per_engine: int) -> None:
        """NeMo RL's GRPO setup tells every policy worker its SGLang servers' size (its
        DTensor worker keeps it for NeMo RL's own HTTP refit; its Megatron worker raises,
        which ends the setup). The reshard plan takes sizes from the config and checks
        them on every rank, so the size is only recorded."""
        self.rollout_num_gpus_per_engine = int(num_gpus_per_engine)

    def reshard_describe(self) -> dict[str, Any]:
        """Where this worker sits and what it holds, for the driver to plan and check."""
        live = self._reshard_live()
        return {
            "rank": int(self.rank),
            "position": live_megatron_position(),
            "options": live_megatron_options(self.model),
            "tensors": describe_tensors(live),
            "gpu": device_name(next(iter(live.values())).device),
            "parameters": sorted(n for n, t in live.items() if isinstance(t, torch.nn.Parameter)),
        }

    def reshard_address(self, host: str | None = None) -> Rendezvous:
        """The refit group's rendezvous, made by this rank, refit rank 0, which hosts the
        group's store: a port free now on ``host`` (``refit.host``: an IP of this node), or
        on this node's IP, and a new secret for this run. Only the hosting
        rank picks it: no other node can bind its address."""
        return group_rendezvous(host)

    def reshard_join(self, endpoint_json: str) -> int:
        """Join the refit group as refit rank ``self.rank`` (collective rendezvous)."""
        self.reshard_close()
        endpoint = replace(RefitEndpoint.from_json(endpoint_json), group_rank=int(self.rank))
        live = self._reshard_live()
        # gloo with parameters on a GPU: RefitWorker stages messages through host memory.
        worker = RefitWorker(endpoint, live)
        worker.join()
        self._reshard = _PolicyRefit(live, worker)
        return endpoint.group_rank

    def reshard_load_plan(self, slice_json: str) -> int:
        """Check this rank's plan slice against the live tensors — every tensor it sends
        from present, with its shape and dtype — then compile. (Which live parameters
        the layout covers the driver checked; a replicated one may be sent by another
        replica.) Collective: every rank of the refit group calls it. Returns the count
        of tensors this rank sends from."""
        state = self._require_joined()
        plan = load_plan_json(slice_json)
        me = state.worker.endpoint.group_rank
        self._check_live(plan, me, state.live)
        assert isinstance(state.worker, RefitWorker)
        state.worker.load_plan(plan)
        state.storages = self._storages(plan, me, state.live)
        return len(plan.expected_tensors(me))

    def reshard_colocated_listen(self, endpoint_json: str, slices: dict[str, str]) -> str | None:
        """Colocated refit: compile this rank's share (``slices``: refit rank -> slice
        JSON, this rank's and the vLLM worker's on its GPU) and listen for that worker;
        its address (None: no worker on this GPU). ``endpoint_json``: the training ranks'
        group."""
        self.reshard_close()
        endpoint = replace(RefitEndpoint.from_json(endpoint_json), group_rank=int(self.rank))
        me = endpoint.group_rank
        if str(me) not in slices:
            raise PlanError(f"the slices shipped to Megatron policy rank {me} omit its own")
        own = load_plan_json(slices[str(me)])
        assert isinstance(own, RankPlan)
        guests = [load_plan_json(v) for k, v in slices.items() if k != str(me)]
        live = self._reshard_live()
        self._check_live(own, me, live)
        trainer = ColocatedTrainer(
            endpoint,
            live,
            own,
            guest_plan=guests[0] if guests else None,  # type: ignore[arg-type]
        )
        self._reshard = _PolicyRefit(live, trainer, storages=self._storages(own, me, live))
        return trainer.listen()

    def reshard_colocated_join(self) -> int:
        """Join the training ranks' group and hand the vLLM worker on this GPU its staging
        (collective; the worker connects meanwhile). Returns this rank."""
        state = self._require_joined()
        assert isinstance(state.worker, ColocatedTrainer)
        state.worker.join()
        state.worker.accept_worker()
        return state.worker.endpoint.group_rank

    @torch.no_grad()
    def reshard_step(self) -> dict[str, float]:
        """Send this rank's shards for one refit (collective over the refit group)."""
        state = self._require_joined()
        refit = state.worker
        if isinstance(refit, RefitWorker) and refit.refitter is None:
            raise RuntimeError("call reshard_load_plan before reshard_step")
        t0 = time.perf_counter()
        self._reshard_before_step()
        try:
            self._check_storages(state)
        except PlanError as err:
            if isinstance(refit, ColocatedTrainer):  # its worker waits on this rank alone
                refit.abort(err)
            raise
        out = {"group_rank": float(refit.endpoint.group_rank)}
        if isinstance(refit, ColocatedTrainer):
            refit.refit()
            delta = refit.host.delta.stats if refit.host.delta is not None else None
        else:
            timing = refit.refit()
            out["exchange_seconds"] = timing.exchange_seconds
            out["host_seconds"] = timing.host_seconds
            assert refit.refitter is not None
            delta = refit.refitter.delta.last if refit.refitter.delta is not None else None
        if delta is not None:  # what this rank sent, and what it would have sent dense
            out["delta_sent_bytes"] = float(delta.sent_bytes)
            out["delta_dense_bytes"] = float(delta.dense_bytes)
        state.steps += 1
        return {**out, "seconds": time.perf_counter() - t0}

    def _check_live(self, plan: Any, me: int, live: dict[str, torch.Tensor]) -> None:
        problems = live_tensor_problems(plan.expected_tensors(me), live, None)
        if problems:
            raise PlanError.listing(
                f"Megatron policy rank {me}: live tensors do not match the plan",
                problems,
                "check policy.megatron_cfg and the refit block against the model",
            )

    @staticmethod
    def _storages(plan: Any, me: int, live: dict[str, torch.Tensor]) -> dict[str, int]:
        return {n: _storage_id(live[n]) for n in plan.expected_tensors(me)}

    def _check_storages(self, state: _PolicyRefit) -> None:
        if not state.storages:
            return
        problems = storage_problems(state.storages, self._reshard_live())
        if problems:
            raise PlanError.listing(
                f"Megatron policy rank {self.rank}: the parameters the refit reads are not "
                "the model's live ones",
                problems,
                "refit while the model is on its GPU (after prepare_for_training, before "
                "offload_after_refit); move it with Megatron's DDP buffers, or call "
                "init_communicator() again after replacing parameters",
            )

    def reshard_close(self) -> None:
        if self._reshard is not None:
            self._reshard.worker.close()
            self._reshard = None

    def _require_joined(self) -> _PolicyRefit:
        if self._reshard is None:
            raise RuntimeError("call reshard_join before loading a plan or refitting")
        return self._reshard
