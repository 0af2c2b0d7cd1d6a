"""``examples/nemo_rl/run_grpo.py`` on a machine without GPUs: it gets through NeMo RL's
``init_ray`` (a Ray cluster starts) and then stops with one line naming the GPUs the
config needs, exit status 2, no traceback.

Runs under the Python of ``scripts/setup_nemo_rl_cpu.sh`` built on Python >= 3.12 (the
launcher imports ``nemo_rl.algorithms.grpo``); skips, saying how to install it, where that
venv is missing (CI).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import vllm_env
from tests.helpers.requires import requires

# Found, not imported: importing NeMo RL's GRPO module (what nemo_rl_grpo_skip_reason
# probes) takes 15-30 s here, and the launcher imports it anyway; a broken install fails
# the test instead of skipping it.
_PROBE = (
    "import sys, importlib.util as u; sys.exit(sys.version_info < (3, 12) or not all("
    "u.find_spec(m) for m in ('nemo_rl', 'megatron.core', 'ray', 'nemo_refit_reshard')))"
)
_HINT = (
    "the launcher imports NeMo RL's GRPO module, which needs Python >= 3.12: "
    "NEMO_RL_PYTHON=python3.12 bash scripts/setup_nemo_rl_cpu.sh <NeMo RL clone or git URL> "
    ".venv-nemo-rl312"
)


def _skip_reason() -> str | None:
    return vllm_env._missing(
        vllm_env.nemo_rl_grpo_python(), "NeMo RL on Python >= 3.12", _PROBE, _HINT
    )


pytestmark = [pytest.mark.slow, requires(_skip_reason)]


def launch(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``run_grpo.py`` with the Qwen3-8B overlay and ``overrides``, on no GPUs, offline."""
    python = vllm_env.nemo_rl_grpo_python()
    assert python is not None
    env = vllm_env.vllm_env()
    # A Ray cluster of this run's own: NeMo RL's init_ray otherwise joins any cluster
    # running on this machine (another test's, of another Python: a version mismatch).
    env["RAY_ADDRESS"] = "local"
    # No GPU for Ray to see, on any machine; no fake ones either.
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("RAY_OVERRIDE_RESOURCES", None)
    # Nothing may reach the network before the GPU check (it comes before the tokenizer).
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [
            python,
            str(vllm_env.REPO / "examples" / "nemo_rl" / "run_grpo.py"),
            "--config",
            str(vllm_env.REPO / "configs" / "nemo_rl" / "grpo_math_qwen3_8B_megatron_reshard.yaml"),
            f"logger.log_dir={tmp_path / 'logs'}",
            *overrides,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )


ASYNC = (
    "grpo.async_grpo.enabled=true",
    "grpo.async_grpo.in_flight_weight_updates=true",
    "policy.generation.vllm_cfg.async_engine=true",
    "loss_fn.use_importance_sampling_correction=true",
)


@pytest.mark.parametrize("overrides", [(), ASYNC], ids=["sync", "async_grpo"])
def test_run_grpo_without_gpus_stops_in_one_line(tmp_path: Path, overrides: tuple) -> None:
    """Synchronous and async GRPO (``async_grpo_train``) alike get past Ray's start-up."""
    done = launch(tmp_path, *overrides)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ray started: 0 GPUs" in done.stdout.splitlines(), done.stdout[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: this run needs 16 GPUs (cluster.gpus_per_node=8 x cluster.num_nodes=2); Ray sees 0"
    )


def test_async_grpo_without_async_engine_is_one_line_before_ray(tmp_path: Path) -> None:
    done = launch(tmp_path, "grpo.async_grpo.enabled=true")
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ray started" not in done.stdout
    assert done.stderr.strip().splitlines() == [
        "error: grpo.async_grpo.enabled=True with policy.generation.vllm_cfg.async_engine: "
        "async GRPO generates with vLLM's async engine; set it to true"
    ]
