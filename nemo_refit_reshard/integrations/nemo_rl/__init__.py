"""NeMo RL adapter: two routes.

Drop-in checkpoint engine (NeMo RL's own ``examples/run_grpo.py``):
``policy.generation.refit_transport:
"nemo_refit_reshard.integrations.nemo_rl:ReshardCheckpointEngine"``, its settings in
``policy.generation.refit_cfg`` under the same key (a YAML overlay: ``configs/nemo_rl/``).

Full reshard (``examples/nemo_rl/run_grpo.py``, ``refit.backend: reshard``):
:class:`ReshardWeightSynchronizer` with the Megatron worker of ``megatron_worker.py``.

The NeMo RL classes are imported on first use, so ``config``, ``plans`` and
``policy_worker`` work without NeMo RL installed.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "ENGINE": ".checkpoint_engine",
    "ReshardCheckpointEngine": ".checkpoint_engine",
    "ReshardWeightSynchronizer": ".synchronizer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name], __name__), name)
