"""``refit.backend: reshard`` — NeMo RL's ``WeightSynchronizer`` moving local shards only.

GRPO's ``refit_policy_generation`` calls ``policy_generation.weight_synchronizer
.sync_weights(...)``; ``examples/nemo_rl/run_grpo.py`` installs this synchronizer
there after NeMo RL's ``setup``. Lifecycle:

``init_communicator()`` (once)
    every Megatron policy worker (``ReshardMegatronPolicyWorker``) and every vLLM
    worker (our ``refit_describe`` through ``checkpoint_engine_rpc`` ->
    ``llm.collective_rpc``) reports what it holds; the driver plans once
    (``plans.plan_nemo_rl``: sizes from NeMo RL's config, checked against the
    reports), every worker joins one refit group (policy rank ``r`` is refit rank
    ``r``, vLLM rank ``d`` is ``T + d``: NeMo RL's own convention) at policy rank 0's
    node, and each loads its own plan slice (checked against its live tensors,
    fingerprints compared by the group).
``sync_weights()`` (every step)
    one ``reshard_step`` on every policy worker and one ``refit_step`` in every vLLM
    worker, all at once: the policy's live shards go straight into vLLM's live
    parameters, in place. ``is_stale`` is true until a sync succeeds and again from the
    moment one fails. With ``refit.delta`` (carried by the group's endpoint to every
    rank) each message goes in its smallest form (``engine/delta/program.py``); the metrics then
    add the bytes the policy ranks sent and what the same messages weigh dense.

Colocated (``policy.generation.colocated.enabled``, NeMo RL's default): the workers
also report which GPU they are on; each vLLM worker's GPU must hold one policy rank
(``plans.colocation``). The refit group is the policy ranks alone; each hosts the vLLM
worker on its GPU, which connects to it once and unpacks what its host staged
(``integrations/worker/colocated.py``). Every sync runs NeMo RL's colocated lifecycle
around the transfer, as its own IPC synchronizer does: ``offload_before_refit``, wake
vLLM's weights, transfer, then ``offload_after_refit`` and wake the KV cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import ray
from nemo_rl.weight_sync.interfaces import WeightSynchronizer

from ..vllm import (
    refit_close,
    refit_connect_colocated,
    refit_describe,
    refit_join,
    refit_load_plan,
    refit_step,
)
from ..worker import RefitEndpoint
from .config import NemoRlConfigError, RefitConfig
from .plans import NemoRlPlan, plan_nemo_rl

_TP_PP = ["tensor_parallel", "pipeline_parallel"]


def gather(named: list[tuple[str, ray.ObjectRef]], what: str) -> list[Any]:
    """Wait for every call (each worker enforces the refit timeout itself, so this
    ends); if any failed, one error naming each failed worker and its error."""
    refs = [ref for _, ref in named]
    ray.wait(refs, num_returns=len(refs))
    results, failed = [], []
    for who, ref in named:
        try:
            results.append(ray.get(ref))
        except Exception as err:  # noqa: BLE001 - reported with the worker's name
            cause = getattr(err, "cause", None) or err  # a RayTaskError wraps the worker's
            # NeMo RL's SGLang worker notes the server's answer on its HTTPError
            notes = [str(n) for n in getattr(cause, "__notes__", [])]
            lines = "\n".join([str(cause), *notes]).strip().splitlines() or [""]
            shown = "\n    ".join(lines[:12]) + ("\n    ..." if len(lines) > 12 else "")
            failed.append(f"{who}: {type(cause).__name__}: {shown}")
    if failed:
        raise RuntimeError(f"{what} failed on {len(failed)} worker(s):\n  " + "\n  ".join(failed))
    return results


class ReshardWeightSynchronizer(WeightSynchronizer):
    """NeMo RL weight synchronizer for ``refit.backend: reshard``, colocated or not."""

    # Why a route (a subclass: its generation backend) cannot refit deltas; None: it can.
    _delta_refused: str | None = None

    def __init__(
        self,
        policy: Any,
        generation: Any,
        master_config: Mapping[str, Any],
        refit: RefitConfig | None = None,
    ) -> None:
        self._policy = policy
        self._generation = generation
        self._config = master_config
        self._refit = refit or RefitConfig(backend="reshard")
        if self._refit.delta and self._delta_refused is not None:
            raise NemoRlConfigError(self._delta_refused)
        self._stale = True
        self.plan: NemoRlPlan | None = None
        self.steps = 0

    # -- calls on the two worker groups ----------------------------------------------------
    def _policy_call(self, method: str, **kwargs: Any) -> list[tuple[str, ray.ObjectRef]]:
        refs = self._policy.worker_group.run_all_workers_single_data(method, **kwargs)
        return [(f"policy rank {r}", ref) for r, ref in enumerate(refs)]

    def _policy_each(self, method: str, **per_rank: list[Any]) -> list[tuple[str, ray.ObjectRef]]:
        refs = self._policy.worker_group.run_all_workers_multiple_data(method, **per_rank)
        return [(f"policy rank {r}", ref) for r, ref in enumerate(refs)]

    def _rpc(self) -> str:
        async_engine = self._generation.cfg["vllm_cfg"].get("async_engine", False)
        return "checkpoint_engine_rpc_async" if async_engine else "checkpoint_engine_rpc"

    def _vllm_each(self, fn: Any, args: list[tuple[Any, ...]]) -> list[tuple[str, ray.ObjectRef]]:
        """``fn(worker, *args[i])`` in every worker of vLLM engine ``i`` (NeMo RL's
        ``checkpoint_engine_rpc`` forwards a callable to ``llm.collective_rpc``)."""
        refs = self._generation.worker_group.run_all_workers_multiple_data(
            self._rpc(),
            method_args=args,
            run_rank_0_only_axes=_TP_PP,
            common_kwargs={"checkpoint_method": fn},
        )
        return [(f"vLLM engine {i}", ref) for i, ref in enumerate(refs)]

    def _vllm_all(self, fn: Any) -> list[tuple[str, ray.ObjectRef]]:
        refs = self._generation.worker_group.run_all_workers_single_data(
            self._rpc(), checkpoint_method=fn, method_args=(), run_rank_0_only_axes=_TP_PP
        )
        return [(f"vLLM engine {i}", ref) for i, ref in enumerate(refs)]

    # -- WeightSynchronizer -----------------------------------------------------------------
    def init_communicator(self) -> None:
        """Plan on the driver, join the refit group, load every worker's slice."""
        policy_reports = gather(self._policy_call("reshard_describe"), "reshard_describe")
        engine_reports = gather(self._vllm_all(refit_describe), "refit_describe")
        self.plan = plan = plan_nemo_rl(self._config, self._refit, policy_reports, engine_reports)
        print(plan, flush=True)
        engines = len(engine_reports)
        with self._released_on_failure():
            if plan.colocated:
                self._init_colocated(plan, engines)
                return
            endpoint = self._endpoint(plan.train.world_size + plan.infer.world_size)
            firsts = self._engine_first_ranks(engines)
            gather(
                self._policy_call("reshard_join", endpoint_json=endpoint)
                + self._vllm_each(refit_join, [(endpoint, f) for f in firsts]),
                "joining the refit group",
            )
            slices = list(plan.slices[: plan.num_policy])
            gather(
                self._policy_each("reshard_load_plan", slice_json=slices)
                + self._vllm_each(
                    refit_load_plan, [(self._engine_slices(i),) for i in range(engines)]
                ),
                "loading the refit plan",
            )

    @contextmanager
    def _released_on_failure(self) -> Iterator[None]:
        """A failed join leaves nothing behind on the policy ranks: each closes what it
        opened (its group, a colocated host's listening socket and shared-memory staging,
        which would outlive a worker Ray kills), best effort; the synchronizer keeps no
        plan, and the join's own failure is what is raised."""
        try:
            yield
        except BaseException:
            try:
                gather(self._policy_call("reshard_close"), "closing after the failed join")
            except Exception as err:  # noqa: BLE001 - the join's failure matters more
                print(f"after the failed join: {err}", flush=True)
            self.plan = None
            raise

    def _endpoint(self, world_size: int) -> str:
        # Policy rank 0 (refit rank 0) hosts the group's store, so it picks the port, on
        # its own node: this driver may run on another node, whose IP rank 0 cannot
        # bind (engine/rendezvous.py). The run's secret comes with it, shipped to the
        # workers with the endpoint.
        ref = self._policy.worker_group.run_single_worker_single_data(
            "reshard_address", worker_idx=0, host=self._refit.host
        )
        r = gather([("policy rank 0", ref)], "picking the refit group's address")[0]
        return RefitEndpoint(
            r.ip,
            r.port,
            world_size=world_size,
            group_rank=0,
            transport=self._refit.transport,
            timeout_s=self._refit.timeout_s,
            secret=r.secret,
            delta=self._refit.delta_options,  # every rank alike, colocated or not
        ).to_json()

    def _init_colocated(self, plan: NemoRlPlan, engines: int) -> None:
        """The policy ranks form the refit group; each compiles its share and its guest's
        and listens for that vLLM worker, which connects (over loopback: same GPU, same
        node) while the policy ranks join."""
        t = plan.num_policy
        endpoint = self._endpoint(t)
        addresses = self._listen_colocated(plan, endpoint)
        hosts = plan.plan.colocated_hosts
        group = plan.infer.engine_world_size
        firsts = self._engine_first_ranks(engines)
        calls = [
            (endpoint, f, [addresses[hosts[f - t + k]] for k in range(group)],
             self._engine_slices(i), plan.plan.fingerprint)
            for i, f in enumerate(firsts)
        ]  # fmt: skip
        gather(
            self._policy_call("reshard_colocated_join")
            + self._vllm_each(refit_connect_colocated, calls),
            "connecting the colocated refit",
        )

    def _listen_colocated(self, plan: NemoRlPlan, endpoint: str) -> list[str | None]:
        """Every policy rank compiles its share and its guest's and listens for the guest:
        the address each guest connects to (None: no guest on that GPU)."""
        t = plan.num_policy
        return gather(
            self._policy_each(
                "reshard_colocated_listen",
                endpoint_json=[endpoint] * t,
                slices=[plan.host_slices(r) for r in range(t)],
            ),
            "preparing the colocated refit",
        )

    def _engine_first_ranks(self, engines: int) -> list[int]:
        """Refit rank of vLLM engine ``i``'s first worker, minus its data-parallel offset
        (``refit_join`` adds the worker's rank inside the vLLM DP group)."""
        assert self.plan is not None
        inf = self.plan.infer
        t = self.plan.num_policy
        return [t + (i // inf.engine_dp) * inf.engine_world_size for i in range(engines)]

    def _engine_slices(self, i: int) -> dict[str, str]:
        """The slices of vLLM engine ``i``'s workers: its vLLM DP rank's ``tp·pp`` refit ranks
        inside its DP group."""
        assert self.plan is not None
        inf = self.plan.infer
        size = inf.tp * inf.pp
        first = self._engine_first_ranks(i + 1)[i] + (i % inf.engine_dp) * size
        return self.plan.engine_slices(first, size)

    def sync_weights(
        self, *, timer: Any = None, kv_scales: dict[str, float] | None = None
    ) -> dict[str, float]:
        """One refit: every policy worker sends its shards, every vLLM worker receives
        its own in place. Raises naming every failed worker; stays stale then."""
        if kv_scales:
            raise NotImplementedError(
                "refit.backend=reshard does not carry FP8 KV-cache scales (kv_scales); "
                "use refit.backend=nccl for FP8 KV caches"
            )
        if self.plan is None:
            raise RuntimeError("call init_communicator() before sync_weights()")
        self._stale = True
        context = (
            timer.time("prepare_for_generation/transfer_and_update_weights")
            if timer is not None
            else nullcontext()
        )
        try:
            if self.plan.colocated:  # NeMo RL's colocated lifecycle, as its IPC synchronizer
                self._policy.offload_before_refit()
                # NeMo RL's prepare_for_generation reports a failed wake as False only.
                if self._generation.prepare_for_generation(tags=["weights"]) is False:
                    raise RuntimeError(
                        f"{self.plan.engine} did not wake its weights (prepare_for_generation"
                        "(tags=['weights']) returned False; its error is printed above); "
                        "nothing was refit"
                    )
            with context:
                results = self._refit_all()
        finally:
            if self.plan.colocated:
                self._policy.offload_after_refit()
                self._generation.prepare_for_generation(tags=["kv_cache"])
        self._stale = False
        self.steps += 1
        timings = [r for res in results for r in (res if isinstance(res, list) else [res])]
        metrics = {
            "reshard/bytes": float(self.plan.plan.stats.total_bytes),
            "reshard/max_rank_seconds": max(t["seconds"] for t in timings),
        }
        if self._refit.delta:  # the policy ranks send every message: their sums
            sent = results[: self.plan.num_policy]
            metrics["reshard/delta_sent_bytes"] = sum(r["delta_sent_bytes"] for r in sent)
            metrics["reshard/delta_dense_bytes"] = sum(r["delta_dense_bytes"] for r in sent)
        return metrics

    def _refit_all(self) -> list[Any]:
        """One refit on every rank at once: the ranks' timings (policy ranks first)."""
        return gather(
            self._policy_call("reshard_step") + self._vllm_all(refit_step),
            f"refit step {self.steps + 1}",
        )

    @property
    def is_stale(self) -> bool:
        return self._stale

    def shutdown(self) -> None:
        """Leave the refit group on every worker (best effort: workers may be gone)."""
        if self.plan is None:
            return
        try:
            gather(
                self._policy_call("reshard_close") + self._vllm_all(refit_close),
                "closing the refit group",
            )
        finally:
            self.plan = None
            self._stale = True
