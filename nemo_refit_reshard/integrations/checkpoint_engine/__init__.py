"""The core shared by the veRL and NeMo RL checkpoint engines (handed full tensors).

``config.py``: the engine's settings (:class:`ReshardEngineConfig`), the model they
name, and the settings every worker must agree on. ``replicated_plans.py``: the
replicated full-tensor actor layouts and the plan from them to the rollout GPUs' vLLM
shards. ``plan_cache.py``: the one per-process plan cache. ``engine_rank.py``: one
rank's engine logic (:class:`CheckpointEngineRank`). ``rebuild.py``: the rollout side's
full-shape tensors. ``address.py``: the refit group's rendezvous (its address
and secret, on this node's IP). Framework-neutral: neither veRL nor NeMo RL is imported.
"""

from .address import group_rendezvous, node_address, offered_rendezvous
from .config import (
    MODES,
    ReshardEngineConfig,
    check_same_settings,
    engine_spec,
    planning_settings,
)
from .engine_rank import CheckpointEngineRank, worker_metadata
from .plan_cache import cached_plan
from .rebuild import canonical_tensors
from .replicated_plans import (
    FullTensorPlan,
    broadcast_bytes,
    broadcast_tensors,
    build_broadcast_plan,
    engine_layouts,
    plan_full_tensors,
    replicated_layout,
    rollout_parallel,
)

__all__ = [
    "MODES",
    "CheckpointEngineRank",
    "FullTensorPlan",
    "ReshardEngineConfig",
    "broadcast_bytes",
    "broadcast_tensors",
    "build_broadcast_plan",
    "cached_plan",
    "canonical_tensors",
    "check_same_settings",
    "engine_layouts",
    "engine_spec",
    "group_rendezvous",
    "node_address",
    "offered_rendezvous",
    "plan_full_tensors",
    "planning_settings",
    "replicated_layout",
    "rollout_parallel",
    "worker_metadata",
]
