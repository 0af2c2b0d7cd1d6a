"""The one plan cache of the checkpoint engines: a plan is built once per process for
each (settings, actor ranks, rollout ranks) and reused.

veRL builds it on its driver in ``build_topology``, which runs every update; NeMo RL
builds it in every worker when the group is joined. Planning a large model takes
seconds, and the plan is deterministic in its key, so neither plans twice.
"""

from __future__ import annotations

import json

from .config import ReshardEngineConfig
from .replicated_plans import FullTensorPlan, plan_full_tensors

# Per process: (settings JSON, actor ranks, rollout ranks) -> the plan.
_PLANS: dict[tuple[str, int, int], FullTensorPlan] = {}


def cached_plan(settings: str, actor_world: int, rollout_world: int) -> FullTensorPlan:
    """The plan for ``settings`` (a :class:`ReshardEngineConfig` as JSON: what every
    worker agreed on), built the first time it is asked for."""
    key = (settings, actor_world, rollout_world)
    if key not in _PLANS:
        config = ReshardEngineConfig(**json.loads(settings))
        _PLANS[key] = plan_full_tensors(config, actor_world, rollout_world)
    return _PLANS[key]
