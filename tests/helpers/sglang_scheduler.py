"""SGLang's scheduler-side weight-update path on CPU, for one tp rank whose model
``tests/helpers/sglang_cpu.build_model`` built (run under the SGLang venv's Python).

:func:`scheduler_weight_updater` (0.5.23) builds SGLang's own
``SchedulerWeightUpdaterManager`` over SGLang's own ``WeightUpdater``;
:func:`deserialize_own_rank` is SGLang's ``TpModelWorker.deserialize_own_rank``;
:func:`scheduler_weight_updater_0512` is the same path of 0.5.12.post1 (NeMo RL's pin),
where the scheduler mixin calls ``TpModelWorker`` and then ``ModelRunner`` directly;
:func:`derived_tensors` finds what SGLang's ``post_load_weights`` derives (MLA's
``w_kc``/``w_vc``). Shared by ``tests/programs/sglang_receiver_job.py`` and
``tests/programs/sglang_http_stand_in.py``.
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


def scheduler_weight_updater_0512(
    model: Any, rank: int, custom_weight_loaders: list[str]
) -> tuple[Any, list[str]]:
    """SGLang 0.5.12.post1's scheduler side of ``UpdateWeightsFromTensorReqInput``: SGLang's
    own ``SchedulerUpdateWeightsMixin.update_weights_from_tensor`` (answer, cache flush,
    tp barrier) calling the ``TpModelWorker`` stand-in, which calls SGLang's own
    ``ModelRunner.update_weights_from_tensor`` -- the class attribute after our plugin's
    hook is applied as ``load_plugins()`` applies it -- on a namespace holding what that
    method reads. No weight-update session exists in this version. Returns an object whose
    ``update_weights_from_tensor(request)`` gives the scheduler's answer, and the list of
    weight versions recorded.

    Stand-ins: ``TpModelWorker.update_weights_from_tensor`` is copied line for line (its
    module imports the scheduler, which needs ``setproctitle``, absent from the CPU venv);
    the ``ModelRunner`` is a namespace (model, tp rank, device, the global ``ServerArgs``
    with ``custom_weight_loaders`` in ``custom_weight_loader`` as ``--custom-weight-loader``
    puts them); the ``Scheduler`` is the mixin with its tp worker, no draft worker, the tp
    group's CPU group and a ``flush_cache`` with no cache to flush. The weight version is
    recorded on the tokenizer side in this version (``TokenizerControlMixin``, after the
    scheduler's answer): its condition (``success`` and a version given) is copied, its
    ``_update_weight_version_if_provided`` is SGLang's own, on a namespace holding
    ``server_args``; each value it sets is appended to the returned list."""
    from types import SimpleNamespace

    from sglang.srt.distributed import get_tp_group
    from sglang.srt.managers.scheduler_update_weights_mixin import SchedulerUpdateWeightsMixin
    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import get_global_server_args
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    from nemo_refit_reshard.integrations.sglang import plugin

    plugin.register()
    HookRegistry.apply_hooks()
    server_args = get_global_server_args()  # the one build_model set for this rank
    server_args.custom_weight_loader = [*server_args.custom_weight_loader, *custom_weight_loaders]

    class Runner(SimpleNamespace):
        """The fields of ``ModelRunner`` its ``update_weights_from_tensor`` reads."""

        def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
            # looked up at call time: the class attribute, as hooked
            return ModelRunner.update_weights_from_tensor(self, *args, **kwargs)

    class TpWorker:
        """``TpModelWorker``'s tensor path, line for line."""

        def __init__(self) -> None:
            self.tp_rank = rank
            self.model_runner = Runner(
                model=model, tp_rank=rank, device="cpu", server_args=server_args
            )

        def update_weights_from_tensor(self, recv_req: Any) -> tuple[bool, str]:
            monkey_patch_torch_reductions()
            success, message = self.model_runner.update_weights_from_tensor(
                named_tensors=MultiprocessingSerializer.deserialize(
                    recv_req.serialized_named_tensors[self.tp_rank]
                ),
                load_format=recv_req.load_format,
            )
            return success, message

    class Scheduler(SchedulerUpdateWeightsMixin):
        """What the mixin reads of the scheduler."""

        def __init__(self) -> None:
            self.tp_worker = TpWorker()
            self.draft_worker = None
            self.tp_cpu_group = get_tp_group().cpu_group

        def flush_cache(self, empty_cache: bool = False) -> bool:
            return True

    versions: list[str] = []
    tokenizer = SimpleNamespace(server_args=SimpleNamespace(weight_version=None))

    class Updater:
        """The scheduler's dispatch of the request, then the tokenizer's version record."""

        def update_weights_from_tensor(self, request: Any) -> Any:
            answer = scheduler.update_weights_from_tensor(request)
            if answer.success and request.weight_version is not None:
                TokenizerControlMixin._update_weight_version_if_provided(
                    tokenizer, request.weight_version
                )
                versions.append(tokenizer.server_args.weight_version)
            return answer

    scheduler = Scheduler()
    return Updater(), versions
