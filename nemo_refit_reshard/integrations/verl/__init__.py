"""veRL adapter: the ``reshard`` checkpoint engine.

``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module:
nemo_refit_reshard.integrations.verl`` imports this package in veRL's driver, actor
workers and checkpoint-engine workers; importing it registers the backend
``reshard``. Without veRL installed only the framework-neutral planning
(:mod:`nemo_refit_reshard.integrations.checkpoint_engine`) is available.
"""

from importlib.util import find_spec

from ..checkpoint_engine import (
    FullTensorPlan,
    ReshardEngineConfig,
    canonical_tensors,
    plan_full_tensors,
)

__all__ = ["ReshardEngineConfig", "FullTensorPlan", "plan_full_tensors", "canonical_tensors"]

if find_spec("verl") is not None:  # an installed but broken veRL raises here, loudly
    from .engine import ReshardCheckpointEngine

    __all__ += ["ReshardCheckpointEngine"]
