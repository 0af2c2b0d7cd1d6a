"""SGLang 0.5.23's scheduler-side weight-update path on CPU, for one tp rank whose model
``tests/helpers/sglang_cpu.build_model`` built (run under ``.venv-sglang``'s Python).

:func:`scheduler_weight_updater` builds SGLang's own ``SchedulerWeightUpdaterManager``
over SGLang's own ``WeightUpdater``; :func:`deserialize_own_rank` is SGLang's
``TpModelWorker.deserialize_own_rank``; :func:`derived_tensors` finds what SGLang's
``post_load_weights`` derives (MLA's ``w_kc``/``w_vc``). Shared by
``tests/programs/sglang_receiver_job.py`` and ``tests/programs/sglang_http_stand_in.py``.
"""

from __future__ import annotations

from typing import Any


def derived_tensors(model: Any) -> dict[str, Any]:
    """Every tensor SGLang derives in ``post_load_weights`` (MLA's ``w_kc``/``w_vc``),
    by module name: plain attributes, not parameters."""
    import torch

    out = {}
    for name, module in model.named_modules():
        for attr in ("w_kc", "w_vc"):
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor):
                out[f"{name}.{attr}"] = t
    return out


def deserialize_own_rank(payloads: list[bytes]) -> Any:
    """``TpModelWorker.deserialize_own_rank``, line for line: its module imports the
    scheduler, which needs ``setproctitle`` (not in the CPU venv)."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.deserialize(payloads[get_parallel().tp_rank])


def scheduler_weight_updater(
    model: Any, rank: int, custom_weight_loaders: list[str]
) -> tuple[Any, list[str]]:
    """SGLang's own ``SchedulerWeightUpdaterManager`` (what the scheduler dispatches
    ``BeginWeightUpdateReqInput`` / ``UpdateWeightsFromTensorReqInput`` /
    ``EndWeightUpdateReqInput`` to) over SGLang's own per-runner ``WeightUpdater``, with
    ``custom_weight_loaders`` registered as ``--custom-weight-loader`` registers them and
    our plugin's hook applied as ``load_plugins()`` applies it. Stand-ins (no GPU, no
    scheduler process): the ``ModelRunner`` and ``TpModelWorker`` are namespaces holding
    what the tensor path reads (:func:`deserialize_own_rank`); the scheduler records
    weight versions in a list (returned with the manager); ``flush_cache`` has no cache
    to flush; the runner callbacks the tensor path never calls raise."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.plugins.hook_registry import HookRegistry

    from nemo_refit_reshard.integrations.sglang import plugin

    plugin.register()
    HookRegistry.apply_hooks()

    def unused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("not on SGLang's update_weights_from_tensor path")

    updater = WeightUpdater(
        tp_rank=rank,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders=list(custom_weight_loaders),
        get_model=lambda: model,
        update_model_fields=unused,
        recapture_cuda_graph=unused,
        get_model_runner=unused,
    )
    runner = SimpleNamespace(weight_updater=updater, model=model)
    worker = SimpleNamespace(
        model_runner=runner,
        weight_update_runners=lambda: [("target", runner)],
        deserialize_own_rank=deserialize_own_rank,
    )
    versions: list[str] = []
    scheduler = SimpleNamespace(
        record_weight_version_change=lambda new_version: versions.append(new_version)
    )
    manager = SchedulerWeightUpdaterManager(
        tp_worker=worker,
        draft_worker=None,
        memory_saver_adapter=None,
        flush_cache=lambda empty_cache=False: True,
        is_fully_idle=lambda: True,
        scheduler=scheduler,
    )
    return manager, versions
