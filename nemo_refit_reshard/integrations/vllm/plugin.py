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
"""

from __future__ import annotations

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
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, target in (
        (WeightTransferEngineFactory, WORKER_ENGINE),
        (WeightTransferTrainerFactory, TRAINER_ENGINE),
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
