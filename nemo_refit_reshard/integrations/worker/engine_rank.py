"""What one rank of a generation engine keeps from one refit call to the next.

An engine calls its ranks one operation at a time (vLLM's ``collective_rpc``, SGLang's
custom weight loader), so a rank keeps its refit membership on an object the engine
owns between calls: ``integrations/vllm/worker.py`` on vLLM's worker,
``integrations/sglang/receiver.py`` on SGLang's model. How a rank joins the refit
group, connects to its colocated host, checks a plan against its live parameters and
closes does not depend on the engine: :class:`EngineRankState` does it once for both,
and each engine's state adds what only it knows (vLLM's layout and derived weights,
the errors SGLang's loader caught).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from ...engine.program import live_tensor_problems
from ...plan import RankPlan, RefitPlan
from .colocated import ColocatedWorker
from .endpoint import RefitEndpoint
from .refit_worker import RefitWorker
from .weights import WeightsState


@dataclass(kw_only=True)
class EngineRankState:
    """One engine rank's refit memberships (keyword-only: engines add fields of their own)."""

    engine_rank: int
    params: dict[str, torch.Tensor]  # written in place
    refit: RefitWorker | None = None
    colocated: ColocatedWorker | None = None  # a colocated refit's, instead of ``refit``
    weights: WeightsState = field(default_factory=WeightsState)  # across memberships
    steps: int = 0

    def join(self, endpoint_json: str, first_rank: int) -> int:
        """Join the refit group as rank ``first_rank + engine rank``; returns that rank.
        Every rank of an engine receives the same endpoint (one call for the whole
        engine), so its ``group_rank`` is ignored. Joining again replaces the previous
        membership."""
        self.close()
        endpoint = replace(
            RefitEndpoint.from_json(endpoint_json), group_rank=first_rank + self.engine_rank
        )
        self.refit = RefitWorker(endpoint, self.params, weights=self.weights)
        self.refit.join()
        return endpoint.group_rank

    def load_plan(self, check: Callable[[int], RefitPlan | RankPlan]) -> int:
        """Compile this rank's program from ``check(refit rank)``: the plan for this rank,
        checked by the engine against its live parameters. Collective over the refit
        group. Returns the number of parameters the plan writes."""
        if self.refit is None:
            raise RuntimeError("call refit_join before refit_load_plan")
        rank = self.refit.endpoint.group_rank
        loaded = check(rank)
        self.refit.load_plan(loaded)
        return len(loaded.expected_tensors(rank))

    def connect_colocated(
        self, endpoint_json: str, address: str, plan: RefitPlan | RankPlan, rank: int
    ) -> int:
        """Connect, as refit rank ``rank``, to the training rank listening at ``address``
        on this rank's GPU, with the training ranks' secret and timeouts from
        ``endpoint_json``, and compile the unpack of ``plan`` (checked by the caller).
        Returns ``rank``."""
        e = RefitEndpoint.from_json(endpoint_json)
        self.colocated = ColocatedWorker(self.params, weights=self.weights)
        self.colocated.connect(address, e.secret, plan, rank, e.timeout_s, e.connect_timeout_s)
        return rank

    def plan_problems(self, expected: Mapping[str, tuple[tuple[int, ...], str]]) -> list[str]:
        """How the tensors a plan writes (``expected``) differ from the live parameters:
        one missing from either side, or another shape or dtype (the device is checked
        when the plan is loaded)."""
        problems = [
            f"{n}: live, but the plan does not write it"
            for n in sorted(set(self.params) - set(expected))
        ]
        return problems + live_tensor_problems(expected, self.params, None)

    def close(self) -> None:
        """Leave the refit group and any colocated host; the weights' state stays."""
        if self.refit is not None:
            self.refit.close()
            self.refit = None
        if self.colocated is not None:
            self.colocated.close()
            self.colocated = None


__all__ = ["EngineRankState"]
