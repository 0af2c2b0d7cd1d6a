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
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires

pytestmark = [pytest.mark.slow, requires(vllm_env.skip_reason)]
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


@requires(vllm_env.nemo_rl_skip_reason)
def test_plugin_leaves_a_vllm_without_trainer_factories_working() -> None:
    """vLLM 0.25.1 (NeMo RL's pin, in its venv) has no ``WeightTransferTrainerFactory``:
    vLLM's own ``load_general_plugins()`` runs our entry point, which registers nothing
    and warns once; vLLM's own backends stay as they were. (Before this, the plugin's
    ImportError failed vLLM's model inspection in every such process.)"""
    probe = """
import json, logging
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
from vllm.plugins import load_general_plugins
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F
before = sorted(F._registry)
load_general_plugins(); load_general_plugins()
print(json.dumps({"before": before, "after": sorted(F._registry)}))
"""
    python = vllm_env.nemo_rl_python()
    assert python is not None
    done = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, env=vllm_env.vllm_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["after"] == out["before"] and "reshard" not in out["after"]
    warnings = [ln for ln in done.stderr.splitlines() if "nemo-refit-reshard:" in ln]
    assert warnings == [
        "nemo_refit_reshard.integrations.vllm.plugin: nemo-refit-reshard: vLLM 0.25.1 has no "
        "WeightTransferTrainerFactory, so the 'reshard' weight-transfer backend is not "
        "registered (it needs a vLLM with trainer-side weight-transfer engines, e.g. 0.33); "
        "refits through worker_extension_cls, NeMo RL and veRL are unaffected"
    ]
