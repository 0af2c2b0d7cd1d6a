"""NeMo RL adapter.

The drop-in checkpoint engine: ``policy.generation.refit_transport:
"nemo_refit_reshard.integrations.nemo_rl:ReshardCheckpointEngine"``, its settings in
``policy.generation.refit_cfg`` under the same key (a YAML overlay:
``configs/nemo_rl/``). Importing this package needs NeMo RL installed.
"""

from .checkpoint_engine import ENGINE, ReshardCheckpointEngine

__all__ = ["ENGINE", "ReshardCheckpointEngine"]
