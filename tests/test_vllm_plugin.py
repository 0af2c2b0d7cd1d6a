"""The ``vllm.general_plugins`` entry point: a fresh vLLM process with the package's
metadata selects ``WeightTransferConfig(backend="reshard")`` through vLLM's own
``load_general_plugins()``.

The entry point is read from ``pyproject.toml`` and written as the package's
``entry_points.txt`` in a ``.dist-info`` on the path, as ``pip install`` writes it: the
checkout's own editable install may predate it, and the test must not depend on that.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import vllm_env
from tests.test_vllm_truth import MODELS

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (the vLLM venv is 3.11)
_SKIP = vllm_env.skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]


def entry_points_txt() -> str:
    project = tomllib.loads((vllm_env.REPO / "pyproject.toml").read_text())["project"]
    groups = project["entry-points"]
    return "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
        for group, eps in groups.items()
    )


def test_entry_point_declared() -> None:
    assert (
        "[vllm.general_plugins]\nreshard = nemo_refit_reshard.integrations.vllm.plugin:register"
        in (entry_points_txt())
    )


def test_fresh_process_selects_reshard(tmp_path: Path) -> None:
    dist = tmp_path / "site" / "nemo_refit_reshard_plugin-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nemo-refit-reshard-plugin\nVersion: 0.1.0\n"
    )
    (dist / "entry_points.txt").write_text(entry_points_txt())
    config, result = tmp_path / "config.json", tmp_path / "result.json"
    config.write_text(json.dumps(MODELS["qwen3_moe"]))
    env = vllm_env.vllm_env()
    env["PYTHONPATH"] = os.pathsep.join([str(dist.parent), env["PYTHONPATH"]])
    python = vllm_env.vllm_python()
    assert python is not None
    done = subprocess.run(
        [python, *vllm_env.program("vllm_plugin_check"), str(result), str(config)],
        cwd=vllm_env.REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["engine"] == (
        "nemo_refit_reshard.integrations.vllm.transfer_worker.ReshardWeightTransferEngine"
    )
    assert r["trainer"] == "ReshardTrainerWeightTransferEngine"
    # vLLM's own error for an unknown backend, listing ours among the available ones
    assert r["unknown"].startswith("Invalid weight transfer backend: resharrd."), r["unknown"]
    assert "'reshard'" in r["unknown"]
    assert r["quantized"].startswith("UnsupportedVllmOption: this vLLM engine uses options"), r
    assert "quantization='fp8'" in r["quantized"]
