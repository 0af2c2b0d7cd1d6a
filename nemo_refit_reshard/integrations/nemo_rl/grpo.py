"""Wire ``refit.backend`` into NeMo RL's GRPO ``setup`` (used by examples/nemo_rl/run_grpo.py).

``reshard``: the policy workers are :data:`WORKER_FQN` (NeMo RL's Megatron worker
plus our refit methods, through ``Policy(worker_extension_cls_fqn=...)``, registered
in NeMo RL's actor-environment registry like its own Megatron worker), and after
``setup`` our :class:`~.synchronizer.ReshardWeightSynchronizer` becomes
``policy_generation.weight_synchronizer``, which GRPO's ``refit_policy_generation``
calls every step. ``nccl`` and ``nccl_reshard`` leave NeMo RL's own refits in place
(``policy.generation.refit_transport`` null or ``"nccl_reshard"``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from .config import NemoRlConfigError, RefitConfig, check_generation, check_megatron
from .sglang_config import SGLANG_DELTA

WORKER_FQN = "nemo_refit_reshard.integrations.nemo_rl.megatron_worker.ReshardMegatronPolicyWorker"


def refit_config(config: MutableMapping[str, Any]) -> RefitConfig:
    """Read the ``refit:`` block and set NeMo RL's own switch to match ``backend``:
    ``policy.generation.refit_transport`` becomes ``"nccl_reshard"`` for
    ``nccl_reshard`` and stays null otherwise (a conflicting value is an error)."""
    refit = RefitConfig.from_config(config.get("refit"))
    generation = config["policy"]["generation"]
    transport = generation.get("refit_transport")
    if refit.backend == "nccl_reshard":
        if transport not in (None, "nccl_reshard"):
            raise NemoRlConfigError(
                f"policy.generation.refit_transport={transport!r} conflicts with "
                "refit.backend=nccl_reshard; set it to null"
            )
        generation["refit_transport"] = "nccl_reshard"
    elif transport is not None:
        raise NemoRlConfigError(
            f"policy.generation.refit_transport={transport!r} conflicts with "
            f"refit.backend={refit.backend}; set it to null (or use NeMo RL's own "
            "run_grpo.py for checkpoint engines)"
        )
    return refit


def check_reshard_config(config: Mapping[str, Any]) -> None:
    """The config-only checks of ``reshard``, before any worker starts: Megatron policy,
    vLLM generation (colocated or not, no other refit transport; BF16, or block FP8
    through ``vllm_cfg.precision: fp8``, ``fp8.py``) or colocated SGLang generation
    (``sglang_config.py``). Sizes are checked against the
    workers NeMo RL actually starts, in ``init_communicator``."""
    check_generation(config["policy"]["generation"])
    check_megatron(config["policy"])
    if _backend(config) == "sglang" and RefitConfig.from_config(config.get("refit")).delta:
        raise NemoRlConfigError(SGLANG_DELTA)
    if (config["policy"].get("draft") or {}).get("enabled", False):
        raise NemoRlConfigError(
            "policy.draft.enabled=True: refit.backend=reshard refits the policy's own "
            "weights, not a draft model's; use refit.backend=nccl"
        )


def async_grpo(config: Mapping[str, Any]) -> bool:
    """Whether the config runs NeMo RL's ``async_grpo_train`` (``grpo.async_grpo.enabled``),
    after the checks NeMo RL itself makes there and in its ``examples/run_grpo.py``, each
    as one line naming the key (NeMo RL asserts or raises ``NotImplementedError`` deep in
    its setup). Every refit there is GRPO's ``refit_policy_generation``, so any backend
    serves it; ``reshard`` reaches NeMo RL's async vLLM engine through its async RPC."""
    grpo = config.get("grpo") or {}
    if not (grpo.get("async_grpo") or {}).get("enabled", False):
        return False
    generation = config["policy"]["generation"]
    rules = [
        (
            "policy.generation.vllm_cfg.async_engine",
            (generation.get("vllm_cfg") or {}).get("async_engine", False) is True,
            "async GRPO generates with vLLM's async engine; set it to true",
        ),
        (
            "policy.generation.colocated.enabled",
            not (generation.get("colocated") or {}).get("enabled", False),
            "NeMo RL runs colocated async GRPO with Megatron generation only; give vLLM "
            "its own GPUs (false)",
        ),
        (
            "loss_fn.use_importance_sampling_correction",
            (config.get("loss_fn") or {}).get("use_importance_sampling_correction") is True,
            "async GRPO trains on off-policy samples and needs it; set it to true",
        ),
        ("grpo.use_dynamic_sampling", not grpo.get("use_dynamic_sampling"), _NOT_ASYNC),
        (
            "grpo.reward_scaling.enabled",
            not (grpo.get("reward_scaling") or {}).get("enabled"),
            _NOT_ASYNC,
        ),
        (
            "grpo.reward_shaping.enabled",
            not (grpo.get("reward_shaping") or {}).get("enabled"),
            _NOT_ASYNC,
        ),
        (
            "data.use_multiple_dataloader",
            not (config.get("data") or {}).get("use_multiple_dataloader"),
            _NOT_ASYNC,
        ),
    ]
    for key, ok, why in rules:
        if not ok:
            raise NemoRlConfigError(f"grpo.async_grpo.enabled=True with {key}: {why}")
    return True


_NOT_ASYNC = "NeMo RL's async GRPO does not support it; turn it off"


def policy_factory(
    refit: RefitConfig, config: Mapping[str, Any] | None = None
) -> Callable[..., Any] | None:
    """``setup(policy_factory=...)``: our worker for ``reshard``, NeMo RL's otherwise.
    With SGLang generation (``config``'s ``policy.generation.backend``) NeMo RL's
    ``SGLangGeneration`` is also made to start SGLang with our refit loader
    (``sglang_worker.py``)."""
    if refit.backend != "reshard":
        return None
    if config is not None and _backend(config) == "sglang":
        from .sglang_worker import install_sglang_worker

        install_sglang_worker()
    from nemo_rl.distributed.ray_actor_environment_registry import (
        ACTOR_ENVIRONMENT_REGISTRY,
        MCORE_EXECUTABLE,
    )
    from nemo_rl.models.policy.lm_policy import Policy

    ACTOR_ENVIRONMENT_REGISTRY[WORKER_FQN] = MCORE_EXECUTABLE
    return functools.partial(Policy, worker_extension_cls_fqn=WORKER_FQN)


def install_synchronizer(
    refit: RefitConfig, policy: Any, policy_generation: Any, master_config: Mapping[str, Any]
) -> Any:
    """After ``setup``: make our synchronizer the one GRPO's refit calls (``reshard``)."""
    if refit.backend != "reshard":
        return getattr(policy_generation, "weight_synchronizer", None)
    if _backend(master_config) == "sglang":
        from .sglang_synchronizer import ReshardSGLangWeightSynchronizer as Synchronizer
    else:
        from .synchronizer import ReshardWeightSynchronizer as Synchronizer

    sync = Synchronizer(policy, policy_generation, master_config, refit)
    sync.init_communicator()
    policy_generation.weight_synchronizer = sync
    return sync


def _backend(config: Mapping[str, Any]) -> str:
    return str(config["policy"]["generation"].get("backend", "vllm"))
