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

    def _reshard_before_step(self) -> None:
        # With overlap_param_gather, Megatron gathers the updated parameters lazily, in
        # the next forward's pre-hook: after an optimizer step the local shards are stale
        # until then. Gather now, as NeMo RL's own Megatron generation does before it
        # reads the training parameters.
        if self.should_disable_forward_pre_hook and self._forward_pre_hook_enabled():
            self._disable_forward_pre_hook_until_next_train_step(param_sync=True)


@ray.remote(runtime_env=get_runtime_env_for_policy_worker("megatron_policy_worker"))
class ReshardMegatronPolicyWorker(ReshardMegatronPolicyWorkerImpl):  # pragma: no cover
    pass
