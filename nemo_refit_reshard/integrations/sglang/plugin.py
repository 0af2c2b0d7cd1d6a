"""SGLang general plugin: a failed refit command answers ``success=False`` to the driver.

The custom weight loader (``loader.py``) cannot fail SGLang's
``update_weights_from_tensor`` without raising, and a raise ends the scheduler process
(SGLang does not catch a loader's exception). This plugin wraps SGLang's own
``WeightUpdater.update_weights_from_tensor`` (``ModelRunner.update_weights_from_tensor``
before SGLang moved it out, e.g. 0.5.12.post1) with an AROUND hook of SGLang's
``HookRegistry``: for ``load_format=LOADER`` only, an error the loader recorded during
the call turns the answer into ``(False, error)``, which SGLang passes up unchanged to
``Engine.update_weights_from_tensor`` (and skips recording the weight version). Every
other load format goes through untouched.

SGLang runs it in every process through its entry-point group ``sglang.srt.plugins``
(``load_plugins()`` in the engine, scheduler, ...), once the distribution declares::

    [project.entry-points."sglang.srt.plugins"]
    nemo_refit_reshard = "nemo_refit_reshard.integrations.sglang.plugin:register"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import receiver
from .loader import LOADER

TARGET = (
    "sglang.srt.model_executor.model_runner_components.weight_updater."
    "WeightUpdater.update_weights_from_tensor"
)
# SGLang before the weight updater moved out of ModelRunner (0.5.12.post1, NeMo RL's pin):
# the same call, with the same arguments and answer, on the runner itself.
TARGET_BEFORE_UPDATER = (
    "sglang.srt.model_executor.model_runner.ModelRunner.update_weights_from_tensor"
)


def hook_target() -> str:
    """The method this SGLang answers ``update_weights_from_tensor`` with, per rank."""
    from importlib.util import find_spec

    try:
        found = find_spec(TARGET.rsplit(".", 2)[0]) is not None
    except ModuleNotFoundError:  # its package (model_runner_components) is missing too
        found = False
    return TARGET if found else TARGET_BEFORE_UPDATER


def report_refit_errors(
    original: Callable[..., tuple[bool, str]], updater: Any, *args: Any, **kwargs: Any
) -> tuple[bool, str]:
    """The AROUND hook: run SGLang's method; fail it with what the loader caught."""
    load_format = kwargs.get("load_format", args[1] if len(args) > 1 else None)
    if load_format != LOADER:
        return original(updater, *args, **kwargs)
    # 0.5.23's WeightUpdater hands out the model; 0.5.12's ModelRunner holds it
    model = updater.get_model() if hasattr(updater, "get_model") else updater.model
    before = len(receiver.refit_status(model)["errors"])
    ok, message = original(updater, *args, **kwargs)
    caught = receiver.refit_status(model)["errors"][before:]
    if ok and caught:
        return False, "; ".join(caught)
    return ok, message


def register() -> None:
    """The plugin's entry point: register the hook (SGLang applies it after loading)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(hook_target(), report_refit_errors, HookType.AROUND)
