"""scripts/test.sh's one line before each venv it builds, and none for a venv already built.

The first run of the test command builds five venvs (~10 min): each build is announced in
one line, what it builds and roughly how long; a venv whose setup already finished (the
setup script's own ``is_done``, scripts/venv_lib.sh) is neither announced nor set up
again. A copy of the script runs in a scratch tree whose ``setup_*_cpu.sh`` only log
their arguments and whose ``python3`` logs a pytest run instead of running it (every
other call goes to the real interpreter: venv_lib.sh's checks need it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP_LINE = "NeMo RL tests skipped: set NEMO_RL_SOURCE=<clone or git URL> (NeMo RL is not on PyPI)"
BUILDS = [
    ("building .venv-vllm (vLLM 0.33.0 model classes, ~1 min, first run only)",
     "setup_vllm_cpu.sh 0.33.0 .venv-vllm"),
    ("building .venv-verl (veRL 0.9.1, ~3 min, first run only)",
     "setup_verl_cpu.sh 0.9.1 .venv-verl"),
    ("building .venv-sglang (SGLang 0.5.23 model classes, ~2 min, first run only)",
     "setup_sglang_cpu.sh 0.5.23 .venv-sglang"),
    ("building .venv-cupy13 (CuPy 13.6.0 + NCCL wheels, ~30 s, first run only)",
     "setup_cupy_cpu.sh 13.6.0 .venv-cupy13"),
    ("building .venv-cupy14 (CuPy 14.2.0 + NCCL wheels, ~30 s, first run only)",
     "setup_cupy_cpu.sh 14.2.0 .venv-cupy14"),
]  # fmt: skip


def _tree(tmp_path: Path) -> Path:
    """A scratch repository root: the real test.sh and venv_lib.sh, a logging stub for
    every setup script, and ``bin/python3``: the real one, except that a pytest run is
    only logged."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("test.sh", "venv_lib.sh"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    for script in (REPO / "scripts").glob("setup_*_cpu.sh"):
        (root / "scripts" / script.name).write_text(
            '#!/usr/bin/env bash\necho "$(basename "$0") $*" >>"$STUB_LOG"\n'
        )
    python3 = tmp_path / "bin" / "python3"
    python3.parent.mkdir()
    python3.write_text(
        f"#!{sys.executable}\nimport os, sys\n"
        "if sys.argv[1:3] == ['-m', 'pytest']:\n"
        "    with open(os.environ['STUB_LOG'], 'a') as log:\n"
        "        log.write('pytest\\n')\n"
        "    sys.exit(0)\n"
        f"os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
    )
    python3.chmod(0o755)
    return root


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NEMO_RL_SOURCE", "NEMO_RL_PYTHON")}
    env.update(STUB_LOG=str(tmp_path / "log"), PATH=f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}")
    return env


def _run(root: Path, env: dict[str, str]) -> list[str]:
    """Run the copied test.sh; its stdout lines."""
    done = subprocess.run(
        ["bash", str(root / "scripts" / "test.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_first_run_announces_each_build_in_one_line(tmp_path: Path) -> None:
    root, env = _tree(tmp_path), _env(tmp_path)
    assert _run(root, env) == [line for line, _ in BUILDS] + [SKIP_LINE]
    log = (tmp_path / "log").read_text().splitlines()
    assert log == [setup for _, setup in BUILDS] + ["pytest"]


def test_a_venv_already_built_costs_no_line_and_no_setup(tmp_path: Path) -> None:
    """.venv-cupy14 made and stamped as its setup script does when it finishes: the
    next run neither announces it nor runs that setup again."""
    root, env = _tree(tmp_path), _env(tmp_path)
    done = subprocess.run(
        ["bash", "-c", 'source scripts/venv_lib.sh && make_venv "$1" && mark_done "$1" "$2"',
         "scripts/setup_cupy_cpu.sh", ".venv-cupy14", "cupy-14.2.0"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert _run(root, env) == [line for line, _ in BUILDS[:4]] + [SKIP_LINE]
    log = (tmp_path / "log").read_text().splitlines()
    assert log == [setup for _, setup in BUILDS[:4]] + ["pytest"]
