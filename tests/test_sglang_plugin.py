"""The ``sglang.srt.plugins`` entry point: a fresh SGLang process, with the package
installed by ``pip install`` (the README's command), runs our plugin through SGLang's
own ``load_plugins()``, which wraps SGLang's ``WeightUpdater.update_weights_from_tensor``
with our hook (``integrations/sglang/plugin.py``)."""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import distribution

import pytest

from nemo_refit_reshard.integrations.sglang.plugin import TARGET, TARGET_BEFORE_UPDATER
from tests.helpers import vllm_env
from tests.helpers.requires import requires

ENTRY_POINT = "nemo_refit_reshard.integrations.sglang.plugin:register"
# torchvision: the stand-in tests/helpers/sglang_cpu.py names (PyPI's does not load on CPU
# torch 2.13); SGLang's weight updater imports its multimodal modules.
PROBE = """
import importlib, json
from tests.helpers.sglang_cpu import stub_torchvision
stub_torchvision()
import sglang
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from nemo_refit_reshard.integrations.sglang.plugin import hook_target
module, cls, method = hook_target().rsplit(".", 2)
owner = getattr(importlib.import_module(module), cls)
# an id: SGLang rebinds every module global that held the original function
before = id(getattr(owner, method))
load_plugins()
after = id(getattr(owner, method))
hooks = [
    (target, t.name, f"{h.__module__}.{h.__qualname__}", src.plugin_name if src else None)
    for target, entries in HookRegistry._hooks.items() for t, h, src in entries
]
print(json.dumps({"version": sglang.__version__, "hooks": hooks, "wrapped": after != before}))
"""


def test_installed_metadata_declares_the_entry_point() -> None:
    """What pip wrote for this package (stale after a pyproject change: reinstall)."""
    eps = distribution("nemo-refit-reshard").entry_points.select(group="sglang.srt.plugins")
    assert {(ep.name, ep.value) for ep in eps} == {("nemo_refit_reshard", ENTRY_POINT)}, (
        "the installed metadata lacks the SGLang entry point: run pip install -e ."
    )


@pytest.mark.slow
@requires(vllm_env.sglang_skip_reason)
def test_sglangs_own_load_plugins_registers_our_hook() -> None:
    python = vllm_env.sglang_python()
    assert python is not None
    done = subprocess.run(
        [python, "-c", PROBE],
        cwd=vllm_env.REPO,
        env=vllm_env.vllm_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    # where each SGLang answers update_weights_from_tensor (plugin.hook_target)
    target = {"0.5.23": TARGET, "0.5.12.post1": TARGET_BEFORE_UPDATER}[r["version"]]
    assert r["hooks"] == [
        [
            target,
            "AROUND",
            "nemo_refit_reshard.integrations.sglang.plugin.report_refit_errors",
            "nemo_refit_reshard",
        ]
    ]
    assert r["wrapped"] is True
