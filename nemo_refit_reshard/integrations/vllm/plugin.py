"""vLLM plugin entry point: registers the ``reshard`` weight-transfer backend.

``pyproject.toml`` declares ``[project.entry-points."vllm.general_plugins"] reshard =
"nemo_refit_reshard.integrations.vllm.plugin:register"``; vLLM's
``load_general_plugins()`` calls :func:`register` in every process it starts (the
front end, the engine core, each worker), so with the package installed
``WeightTransferConfig(backend="reshard")`` and ``--weight-transfer-config
'{"backend": "reshard"}'`` select our engines with no change to vLLM.

Registration is lazy (vLLM imports the engine modules on first use) and idempotent:
vLLM may load plugins more than once per process, and its registries refuse a name
twice, so the module remembers that it registered. An unknown backend name still gets
vLLM's own error.

A vLLM without the trainer-side factory (``WeightTransferTrainerFactory``; NeMo RL pins
vLLM 0.25.1, which has none) cannot serve the backend: the plugin then registers
nothing and says so once, in a warning, so that every other vLLM path — NeMo RL's
and veRL's routes, ``worker_extension_cls`` — runs unchanged.
"""

from __future__ import annotations

import logging

BACKEND = "reshard"
WORKER_ENGINE = (
    "nemo_refit_reshard.integrations.vllm.transfer_worker",
    "ReshardWeightTransferEngine",
)
TRAINER_ENGINE = (
    "nemo_refit_reshard.integrations.vllm.transfer_trainer",
    "ReshardTrainerWeightTransferEngine",
)


_registered = False  # this process registered both engines (vLLM may call us again)


def register() -> None:
    """Register the ``reshard`` worker and trainer engines with vLLM's factories (once per
    process; later calls do nothing). A ``reshard`` backend that vLLM already has from
    someone else is a conflict, reported with vLLM's own message."""
    global _registered
    if _registered:
        return
    import vllm
    from vllm.distributed.weight_transfer import factory as vllm_factory

    WeightTransferEngineFactory = getattr(vllm_factory, "WeightTransferEngineFactory", None)
    WeightTransferTrainerFactory = getattr(vllm_factory, "WeightTransferTrainerFactory", None)
    if WeightTransferEngineFactory is None or WeightTransferTrainerFactory is None:
        logging.getLogger(__name__).warning(
            "nemo-refit-reshard: vLLM %s has no WeightTransferTrainerFactory, so the %r "
            "weight-transfer backend is not registered (it needs a vLLM with trainer-side "
            "weight-transfer engines, e.g. 0.33); refits through worker_extension_cls, "
            "NeMo RL and veRL are unaffected",
            vllm.__version__,
            BACKEND,
        )
        _registered = True
        return

    from vllm.distributed.weight_transfer import base as vllm_base

    from .api_check import api_problems, incompatible_message, refusing_engine

    targets: tuple[tuple[object, ...], ...] = (WORKER_ENGINE, TRAINER_ENGINE)
    problems = api_problems(vllm_base)
    if problems:
        message = incompatible_message(vllm.__version__, problems)
        logging.getLogger(__name__).warning("%s", message)
        targets = ((refusing_engine(message),), (refusing_engine(message),))
    for factory, target in zip(
        (WeightTransferEngineFactory, WeightTransferTrainerFactory), targets
    ):
        try:
            factory.register_engine(BACKEND, *target)
        except ValueError as err:
            raise ValueError(
                f"nemo-refit-reshard cannot register vLLM's {BACKEND!r} weight-transfer "
                f"backend: another package registered that name first ({err}). Uninstall "
                "it, or stop it from registering the name."
            ) from err
    _registered = True
