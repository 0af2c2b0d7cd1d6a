"""scripts/test.sh, the one test command, with its setup scripts and pytest stubbed; and
the install command that comes before it (CI's, and the README's Quick start).

A copy of the script runs in a scratch tree whose ``scripts/setup_*_cpu.sh`` only log
their arguments and whose ``python3`` (first on PATH) only logs its own: what is checked
is which venvs it asks for, the one line it prints when NeMo RL's source is not given,
and that pytest receives the caller's arguments unchanged. No venv is built here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP_LINE = "NeMo RL tests skipped: set NEMO_RL_SOURCE=<clone or git URL> (NeMo RL is not on PyPI)"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SETUPS = (
    "setup_vllm_cpu.sh",
    "setup_verl_cpu.sh",
    "setup_sglang_cpu.sh",
    "setup_cupy_cpu.sh",
    "setup_nemo_rl_cpu.sh",
)
# The line test.sh prints before each venv it builds (none here is built: every one is).
BUILD_LINES = [
    "building .venv-vllm (vLLM 0.33.0 model classes, ~1 min, first run only)",
    "building .venv-verl (veRL 0.9.1, ~3 min, first run only)",
    "building .venv-sglang (SGLang 0.5.23 model classes, ~2 min, first run only)",
    "building .venv-cupy13 (CuPy 13.6.0 + NCCL wheels, ~30 s, first run only)",
    "building .venv-cupy14 (CuPy 14.2.0 + NCCL wheels, ~30 s, first run only)",
]


def _tree(tmp_path: Path) -> Path:
    """A scratch repository root: the real test.sh and venv_lib.sh, stub setup scripts,
    and a stub python3 in ``bin/`` that logs its arguments as one JSON line."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("test.sh", "venv_lib.sh"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    for name in SETUPS:
        stub = root / "scripts" / name
        stub.write_text(
            '#!/usr/bin/env bash\necho "$(basename "$0") $* ${NEMO_RL_PYTHON:-}" >>"$STUB_LOG"\n'
        )
    python3 = tmp_path / "bin" / "python3"
    python3.parent.mkdir()
    python3.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "with open(os.environ['STUB_LOG'], 'a') as log:\n"
        "    log.write('python3 ' + json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    python3.chmod(0o755)
    return root


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[str, list[str]]:
    """Run the copied test.sh with ``args``; its stdout and the stubs' log lines."""
    root = _tree(tmp_path)
    log = tmp_path / "log"
    full = {k: v for k, v in os.environ.items() if k not in ("NEMO_RL_SOURCE", "NEMO_RL_PYTHON")}
    full.update(env, STUB_LOG=str(log), PATH=f"{tmp_path / 'bin'}{os.pathsep}{full['PATH']}")
    done = subprocess.run(
        ["bash", str(root / "scripts" / "test.sh"), *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, log.read_text().splitlines()


def _pytest_args(lines: list[str]) -> list[str]:
    """What the last python3 call (pytest, run by exec) received."""
    assert lines[-1].startswith("python3 "), lines
    return json.loads(lines[-1].removeprefix("python3 "))


def test_without_nemo_rl_source_one_line_says_how_and_the_rest_runs(tmp_path: Path) -> None:
    out, lines = _run(tmp_path)
    assert out.splitlines() == [*BUILD_LINES, SKIP_LINE]
    assert [line.split()[0] for line in lines if line.startswith("setup_")] == [
        "setup_vllm_cpu.sh",
        "setup_verl_cpu.sh",
        "setup_sglang_cpu.sh",
        "setup_cupy_cpu.sh",
        "setup_cupy_cpu.sh",
    ]
    assert _pytest_args(lines) == ["-m", "pytest", "-q"]


def test_arguments_reach_pytest_unchanged(tmp_path: Path) -> None:
    _, lines = _run(tmp_path, "-x", "-k", "a and not b", "tests/test_cli.py")
    assert _pytest_args(lines) == [
        "-m",
        "pytest",
        "-q",
        "-x",
        "-k",
        "a and not b",
        "tests/test_cli.py",
    ]


def test_fast_selects_not_slow_and_passes_the_rest(tmp_path: Path) -> None:
    _, lines = _run(tmp_path, "--fast", "--co", "-q")
    assert _pytest_args(lines) == ["-m", "pytest", "-q", "-m", "not slow", "--co", "-q"]


def test_nemo_rl_source_builds_both_nemo_rl_venvs(tmp_path: Path) -> None:
    out, lines = _run(tmp_path, NEMO_RL_SOURCE="/src/RL", NEMO_RL_PYTHON=sys.executable)
    assert SKIP_LINE not in out
    nemo = [line.split() for line in lines if line.startswith("setup_nemo_rl_cpu.sh")]
    python = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True
    ).stdout.strip()
    assert nemo == [
        ["setup_nemo_rl_cpu.sh", "/src/RL", ".venv-nemo-rl"],
        ["setup_nemo_rl_cpu.sh", "/src/RL", ".venv-nemo-rl312", python],
    ]


def test_ci_runs_exactly_the_test_command() -> None:
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert lines[-2:] == [
        'python3 -m pip install -q torch==2.13.0 -e ".[test]"',
        "bash scripts/test.sh",
    ]


def test_readme_quick_start_installs_what_ci_installs_from_the_cpu_index_too() -> None:
    """A newcomer copies the README's one line: the same torch pin and extras as CI's
    install, plus PyTorch's CPU index (PyPI's torch on Linux x86_64 is the CUDA build;
    an index pip cannot reach only costs retries, so the line works offline too)."""
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if "pip install" in line]
    assert len(ci) == 1, ci
    requirements = ci[0].split("pip install -q ", 1)[1]
    quick_start = (REPO / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ")[0]
    first = re.findall(r"```bash\n(.*?)```", quick_start, re.S)[0]
    assert first.splitlines() == [
        f"pip install {requirements} --extra-index-url {CPU_INDEX} && nemo-refit-reshard demo"
    ]
