"""What a NeMo RL Megatron policy worker gains for ``refit.backend: reshard``.

:class:`ReshardPolicyWorkerMixin` is mixed into NeMo RL's ``MegatronPolicyWorkerImpl``
(``megatron_worker.py``) and reads only what that worker has: ``self.model`` (the
Megatron-core model, wrapped in DDP / ``Float16Module``, or a list of VPP chunks) and
``self.rank``. It sends from the **local shards** — the live parameters — with no
gather: no Megatron-Bridge export, no collective inside Megatron's groups. The driver
(:class:`~.synchronizer.ReshardWeightSynchronizer`) calls, on every policy worker::

    reshard_describe()            -> parallel position, model options, live tensors
    reshard_join(endpoint_json)   -> joins the refit group as refit rank self.rank
    reshard_load_plan(slice_json) -> checks the slice against the live tensors, compiles
    reshard_step()                -> one refit (collective); timing
    reshard_close()

Nothing here imports NeMo RL, so it is tested on a CPU Megatron-core model directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...engine.program import live_tensor_problems
from ...plan import PlanError, load_plan_json
from ..megatron import live_megatron_options, live_megatron_position, megatron_live_tensors
from ..worker import RefitEndpoint, RefitWorker, describe_tensors


@dataclass
class _PolicyRefit:
    live: dict[str, torch.Tensor]
    worker: RefitWorker
    steps: int = 0


class ReshardPolicyWorkerMixin:
    """Refit methods for a Megatron policy worker (``self.model``, ``self.rank``)."""

    model: Any
    rank: int
    _reshard: _PolicyRefit | None = None

    def _reshard_live(self) -> dict[str, torch.Tensor]:
        return megatron_live_tensors(self.model)

    def _reshard_before_step(self) -> None:
        """Make the live parameters current before they are read (a framework hook)."""

    def reshard_describe(self) -> dict[str, Any]:
        """Where this worker sits and what it holds, for the driver to plan and check."""
        live = self._reshard_live()
        return {
            "rank": int(self.rank),
            "position": live_megatron_position(),
            "options": live_megatron_options(self.model),
            "tensors": describe_tensors(live),
            "parameters": sorted(n for n, t in live.items() if isinstance(t, torch.nn.Parameter)),
        }

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
        expected = plan.expected_tensors(me)
        problems = live_tensor_problems(expected, state.live, None)
        if problems:
            raise PlanError.listing(
                f"Megatron policy rank {me}: live tensors do not match the plan",
                problems,
                "check policy.megatron_cfg and the refit block against the model",
            )
        state.worker.load_plan(plan)
        return len(expected)

    @torch.no_grad()
    def reshard_step(self) -> dict[str, float]:
        """Send this rank's shards for one refit (collective over the refit group)."""
        state = self._require_joined()
        if state.worker.refitter is None:
            raise RuntimeError("call reshard_load_plan before reshard_step")
        t0 = time.perf_counter()
        self._reshard_before_step()
        timing = state.worker.refit()
        state.steps += 1
        return {
            "group_rank": float(state.worker.endpoint.group_rank),
            "seconds": time.perf_counter() - t0,
            "exchange_seconds": timing.exchange_seconds,
            "host_seconds": timing.host_seconds,
        }

    def reshard_close(self) -> None:
        if self._reshard is not None:
            self._reshard.worker.close()
            self._reshard = None

    def _require_joined(self) -> _PolicyRefit:
        if self._reshard is None:
            raise RuntimeError("call reshard_join before loading a plan or refitting")
        return self._reshard
