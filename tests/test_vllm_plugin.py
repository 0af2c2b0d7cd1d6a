"""The ``vllm.general_plugins`` entry point: a fresh vLLM process, with the package
installed by ``pip install`` (the README's command; CI runs it first), selects
``WeightTransferConfig(backend="reshard")`` through vLLM's own ``load_general_plugins()``.
"""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import distribution
from pathlib import Path

import pytest

from tests.helpers import vllm_env
from tests.test_vllm_truth import MODELS

_SKIP = vllm_env.skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]
ENTRY_POINT = "nemo_refit_reshard.integrations.vllm.plugin:register"


def test_installed_metadata_declares_the_entry_point() -> None:
    """What pip wrote for this package (stale after a pyproject change: reinstall)."""
    eps = distribution("nemo-refit-reshard").entry_points.select(group="vllm.general_plugins")
    assert {(ep.name, ep.value) for ep in eps} == {("reshard", ENTRY_POINT)}, (
        "the installed metadata lacks the vLLM entry point: run pip install -e ."
    )


def test_fresh_process_selects_reshard(tmp_path: Path) -> None:
    config, result = tmp_path / "config.json", tmp_path / "result.json"
    config.write_text(json.dumps(MODELS["qwen3_moe"]))
    python = vllm_env.vllm_python()
    assert python is not None
    done = subprocess.run(
        [python, *vllm_env.program("vllm_plugin_check"), str(result), str(config)],
        cwd=vllm_env.REPO,
        env=vllm_env.vllm_env(),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["plugin_loaded_by_vllm"] is True
    assert r["engine_loaded_early"] is False  # registered lazily
    assert r["engine"] == (
        "nemo_refit_reshard.integrations.vllm.transfer_worker.ReshardWeightTransferEngine"
    )
    assert r["trainer"] == "ReshardTrainerWeightTransferEngine"
    # vLLM's own error for an unknown backend, listing ours among the available ones
    assert r["unknown"].startswith("Invalid weight transfer backend: resharrd."), r["unknown"]
    assert "'reshard'" in r["unknown"]
    assert r["quantized"].startswith("UnsupportedVllmOption: this vLLM engine uses options"), r
    assert "quantization='fp8'" in r["quantized"]
    assert r["conflict"] == (
        "nemo-refit-reshard cannot register vLLM's 'reshard' weight-transfer backend: another "
        "package registered that name first (Weight transfer engine 'reshard' is already "
        "registered.). Uninstall it, or stop it from registering the name."
    )
