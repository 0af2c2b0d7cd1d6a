"""Where the CPU vLLM (and veRL, NeMo RL, SGLang) installs live, and running a program
under them.

The vLLM tests run vLLM in its own processes, with the Python of the environment
``scripts/setup_vllm_cpu.sh`` made (``.venv-vllm``, or ``$NRR_VLLM_PYTHON``): vLLM
changes process-wide state on import (logging, torch custom ops, platform), which
the rest of the suite should not see.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SETUP_HINT = (
    "run bash scripts/test.sh, which builds .venv-vllm (about 1 minute; or "
    "scripts/setup_vllm_cpu.sh alone), to install vLLM for these tests"
)


def _venv_python(env_var: str, venv: str) -> str | None:
    """``$env_var``, else ``<repo>/<venv>/bin/python`` if it exists, else None."""
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit
    path = REPO / venv / "bin" / "python"
    return str(path) if path.exists() else None


def _missing(python: str | None, what: str, probe: str, hint: str) -> str | None:
    """Why ``python`` cannot run ``probe`` (a skip reason), or None when it can."""
    if python is None:
        return f"{what} is not installed for the CPU tests: {hint}"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    except OSError as err:
        return f"{python} cannot run ({err}): {hint}"
    return None if done.returncode == 0 else f"{python} cannot import {what}: {hint}"


def vllm_python() -> str | None:
    """The interpreter with vLLM installed (``.venv-vllm`` or ``$NRR_VLLM_PYTHON``)."""
    return _venv_python("NRR_VLLM_PYTHON", ".venv-vllm")


def installed_vllm_version() -> str | None:
    """The vLLM version of :func:`vllm_python`, or None."""
    python = vllm_python()
    if python is None:
        return None
    probe = subprocess.run(
        [python, "-c", "from importlib.metadata import version; print(version('vllm'))"],
        capture_output=True,
        text=True,
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def skip_reason() -> str | None:
    probe = "from importlib.metadata import version; version('vllm')"  # fast: no import
    return _missing(vllm_python(), "vLLM", probe, SETUP_HINT)


SGLANG_SETUP_HINT = (
    "run bash scripts/test.sh, which builds .venv-sglang (about 2 minutes; or "
    "scripts/setup_sglang_cpu.sh alone), to install SGLang for these tests"
)


def sglang_python() -> str | None:
    """The interpreter with SGLang installed (``.venv-sglang`` or ``$NRR_SGLANG_PYTHON``)."""
    return _venv_python("NRR_SGLANG_PYTHON", ".venv-sglang")


def installed_sglang_version() -> str:
    """The SGLang version of :func:`sglang_python` (its tests skip when there is none)."""
    python = sglang_python()
    assert python is not None
    probe = "from importlib.metadata import version; print(version('sglang'))"
    return subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip()


def sglang_skip_reason() -> str | None:
    probe = "from importlib.metadata import version; version('sglang')"  # fast: no import
    return _missing(sglang_python(), "SGLang", probe, SGLANG_SETUP_HINT)


VERL_SETUP_HINT = (
    "run bash scripts/test.sh, which builds .venv-verl (about 2-3 minutes; or "
    "scripts/setup_verl_cpu.sh alone), to install veRL for these tests"
)


def verl_python() -> str | None:
    """The interpreter with veRL installed (``.venv-verl`` or ``$NRR_VERL_PYTHON``)."""
    return _venv_python("NRR_VERL_PYTHON", ".venv-verl")


def verl_skip_reason() -> str | None:
    return _missing(verl_python(), "veRL", "import verl.checkpoint_engine", VERL_SETUP_HINT)


NEMO_RL_SETUP_HINT = (
    "run NEMO_RL_SOURCE=<NeMo RL clone or git URL> bash scripts/test.sh (or "
    "scripts/setup_nemo_rl_cpu.sh <clone or URL> alone; about 3 minutes) to install NeMo RL "
    "for these tests; NeMo RL is not on the package index"
)


def nemo_rl_python() -> str | None:
    """The interpreter with NeMo RL and vLLM 0.25.1 (``.venv-nemo-rl`` or
    ``$NRR_NEMO_RL_PYTHON``)."""
    return _venv_python("NRR_NEMO_RL_PYTHON", ".venv-nemo-rl")


def nemo_rl_skip_reason() -> str | None:
    probe = "import nemo_rl.utils.checkpoint_engines.base"
    return _missing(nemo_rl_python(), "NeMo RL", probe, NEMO_RL_SETUP_HINT)


def nemo_rl_grpo_python() -> str | None:
    """The interpreter with NeMo RL on Python >= 3.12 (its GRPO module needs it):
    ``$NRR_NEMO_RL_PYTHON``, else ``.venv-nemo-rl312``, else ``.venv-nemo-rl``."""
    return _venv_python("NRR_NEMO_RL_PYTHON", ".venv-nemo-rl312") or nemo_rl_python()


def nemo_rl_grpo_skip_reason() -> str | None:
    """NeMo RL's GRPO module (``refit_policy_generation``) imports on Python >= 3.12 only."""
    probe = "import nemo_rl.algorithms.grpo, megatron.core"
    hint = (
        "NeMo RL's GRPO module needs Python >= 3.12: NEMO_RL_SOURCE=<NeMo RL clone or git "
        "URL> bash scripts/test.sh builds .venv-nemo-rl312 on python3.12 (or NEMO_RL_PYTHON; "
        "about 10 minutes, most of it a ~2.6 GB torch download)"
    )
    return _missing(nemo_rl_grpo_python(), "NeMo RL's GRPO", probe, hint)


def vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    # the repository first: ``tests.programs.*`` and this checkout's package
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def program(name: str) -> list[str]:
    """The command line tail that runs ``tests/programs/<name>.py`` as a module."""
    return ["-m", f"tests.programs.{name}"]


def start(name: str, *args: str, python: str | None = None) -> subprocess.Popen[str]:
    """Start the program ``tests.programs.<name>`` under vLLM's Python, or ``python``
    (output captured), from the repository's root."""
    python = python or vllm_python()
    assert python is not None, SETUP_HINT
    return subprocess.Popen(
        [python, *program(name), *args],
        cwd=REPO,
        env=vllm_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen[str], what: str) -> None:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed (exit {proc.returncode}):\n{out[-6000:]}")


def run_job(job: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run one ``tests.programs.vllm_cpu_job`` job and return its result."""
    job_path, result_path = workdir / "job.json", workdir / "result.json"
    job_path.write_text(json.dumps(job))
    finish(start("vllm_cpu_job", str(job_path), str(result_path)), "vLLM CPU job")
    return json.loads(result_path.read_text())
