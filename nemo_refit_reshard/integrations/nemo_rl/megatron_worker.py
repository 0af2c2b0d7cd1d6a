"""NeMo RL's Megatron policy worker with the refit methods (``refit.backend: reshard``).

``Policy(..., worker_extension_cls_fqn=WORKER_FQN)`` makes NeMo RL start this class
instead of its ``MegatronPolicyWorker``: everything NeMo RL does with the worker is
unchanged; :class:`~.policy_worker.ReshardPolicyWorkerMixin` adds ``reshard_*``.
Importing this module needs NeMo RL's Megatron environment (Megatron-Bridge).
"""

from __future__ import annotations

import ray
from nemo_rl.models.policy.utils import get_runtime_env_for_policy_worker
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl

from .policy_worker import ReshardPolicyWorkerMixin


class ReshardMegatronPolicyWorkerImpl(ReshardPolicyWorkerMixin, MegatronPolicyWorkerImpl):
    """``MegatronPolicyWorkerImpl`` + the ``reshard_*`` refit methods."""


@ray.remote(runtime_env=get_runtime_env_for_policy_worker("megatron_policy_worker"))
class ReshardMegatronPolicyWorker(ReshardMegatronPolicyWorkerImpl):  # pragma: no cover
    pass
