"""``scripts/gpu_checks.sh``: every row PASS, FAIL or SKIP with a true reason.

Without CUDA (the real interpreter, CUDA hidden) every check is SKIP, one table, exit 0.
The rules that need a GPU machine run against a stub ``PYTHON`` (and a stub
``nvidia-smi``): it answers the script's probe as such a machine would, and pip, pytest
and the checks as told — a dependency missing while CUDA is present is a FAIL, a pytest
run in which no test passed is not a PASS, a listed GPU torch cannot use is a FAIL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_checks.sh"
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"
CHECKS = [
    "install", "gpu-check", "pytest-gpu", "colocated-demo", "ipc-devices", "gloo-cuda",
    "vllm-check", "gpu-multi", "nemo-rl-grpo",
]  # fmt: skip
DROPPED = ("OUT", "TOTAL_S", "NEMO_RL_DIR", "GPU_CHECK_ARGS", "CUDA_VISIBLE_DEVICES", "PYTHON")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    env.update(extra)
    return env


def _table(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("|")]


def _rows(stdout: str) -> dict[str, tuple[str, str]]:
    """check -> (status, figure or reason), from the summary table."""
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in _table(stdout)[2:]]
    return {c[0]: (c[1], c[4]) for c in cells}


@pytest.mark.slow
def test_gpu_checks_script_skips_every_check_without_cuda(tmp_path: Path) -> None:
    # Hidden even where a GPU is: the script must then skip, not run the checks.
    env = _env(CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert f"python: {sys.executable} ({sys.version.split()[0]})" in lines
    assert any(line.startswith("torch: ") and "is_available() False" in line for line in lines)
    table = _table(proc.stdout)
    assert table == [
        "| check | status | seconds | log | figure / reason |",
        "|---|---|---|---|---|",
        *(f"| {name} | SKIP | - | - | {NO_CUDA} |" for name in CHECKS),
    ]
    # The same table is kept with the logs; no check ran, so no log was written.
    summary = (out / "summary.md").read_text().splitlines()
    assert [line for line in summary if line.startswith("|")] == table
    assert sorted(p.name for p in out.iterdir()) == ["summary.md"]


STUB_PYTHON = """#!/usr/bin/env bash
echo "$*" >>"$STUB/calls"
case "$1" in
    -) cat >/dev/null; cat "$STUB/probe" ;;
    -m) case "$2" in
            pip) echo "stub pip failed"; exit "$(cat "$STUB/pip_rc")" ;;
            pytest) cat "$STUB/pytest_out"; exit "$(cat "$STUB/pytest_rc")" ;;
            *) echo "stub $2" ;;
        esac ;;
    *) echo "stub $1" ;;
esac
"""
STUB_SMI = """#!/usr/bin/env bash
echo "NVIDIA H100 80GB HBM3, 81559 MiB, 580.82.07"
"""
H100 = "NVIDIA H100 80GB HBM3"


def _probe(cuda: bool, **have: str) -> str:
    """What the script's probe prints on an H100 machine (``have``: name -> version, or
    ``""`` for not installed)."""
    torch = f"2.11.0+cu130 (CUDA 13.0), torch.cuda.is_available() {cuda}, {int(cuda)} device(s)"
    lines = ["python=/stub/python3 (3.12.3)", f"torch={torch}", f"gpus={int(cuda)}"]
    if cuda:
        lines.append(f"gpu0={H100}")
    cupy = have.pop("cupy")
    lines += [f"cupy={cupy}, usable True", "cupy_ok=1"] if cupy else [
        "cupy=not importable (ModuleNotFoundError)", "cupy_ok=0"]  # fmt: skip
    for name, version in have.items():
        lines += [f"{name}={version}", f"{name}_ok=1"] if version else [
            f"{name}=not installed", f"{name}_ok=0"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _run_stubbed(
    tmp_path: Path,
    probe: str,
    pip_rc: int = 0,
    pytest_out: str = "",
    pytest_rc: int = 0,
    **env: str,
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    stub = tmp_path / "stub"
    (stub / "bin").mkdir(parents=True)
    for path, text in ((stub / "python3", STUB_PYTHON), (stub / "bin" / "nvidia-smi", STUB_SMI)):
        path.write_text(text)
        path.chmod(0o755)
    (stub / "probe").write_text(probe)
    (stub / "pip_rc").write_text(str(pip_rc))
    (stub / "pytest_out").write_text(pytest_out)
    (stub / "pytest_rc").write_text(str(pytest_rc))
    path = f"{stub / 'bin'}:{os.environ['PATH']}"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        cwd=tmp_path,
        env=_env(PYTHON=str(stub / "python3"), STUB=str(stub), PATH=path, **env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    calls = (stub / "calls").read_text().splitlines() if (stub / "calls").exists() else []
    return proc, calls


ALL = dict(cupy="14.2.0", vllm="", transformers="4.57.1", pytest="8.4.2", numba="0.62.1")


def test_a_dependency_missing_beside_cuda_is_a_fail_not_a_skip(tmp_path: Path) -> None:
    probe = _probe(True, **dict(ALL, cupy="", pytest=""))
    proc, calls = _run_stubbed(tmp_path, probe)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert list(rows) == CHECKS
    assert rows["gpu-check"] == (
        "FAIL",
        "needs CuPy (pip install -e '.[gpu]'): not importable (ModuleNotFoundError)",
    )
    assert rows["pytest-gpu"] == ("FAIL", "needs pytest: not installed")
    assert {n: rows[n][0] for n in ("install", "colocated-demo", "ipc-devices", "gloo-cuda")} == {
        "install": "PASS", "colocated-demo": "PASS", "ipc-devices": "PASS", "gloo-cuda": "PASS",
    }  # fmt: skip
    assert rows["vllm-check"] == (
        "SKIP",
        "vLLM is not installed (a GPU install of vllm and transformers runs it)",
    )
    assert rows["gpu-multi"] == rows["nemo-rl-grpo"] == ("SKIP", "needs 2 GPUs (1 found)")
    ran = [c for c in calls if c != "-"]
    assert ran == [
        "-m pip install -q --no-deps --no-index --no-build-isolation -e .",
        "-m nemo_refit_reshard.cli demo --colocated --device cuda --timeout 60",
        "-m nemo_refit_reshard.cli.ipc_check cuda",
        "-m nemo_refit_reshard.cli demo --device cuda --train tp=1 --infer tp=1 --timeout 45",
    ]


@pytest.mark.parametrize(
    ("pytest_out", "pytest_rc", "want"),
    [
        ("3 skipped, 40 deselected in 1.10s", 0,
         ("FAIL", "no test passed: 3 skipped, 40 deselected in 1.10s")),
        ("40 deselected in 0.50s", 5, ("FAIL", "pytest selected no test: 40 deselected in 0.50s")),
        ("1 failed, 11 passed in 9.00s", 1, ("FAIL", "exit 1; 1 failed, 11 passed in 9.00s")),
        ("12 passed, 3 skipped, 40 deselected in 50.00s", 0,
         ("PASS", "12 passed, 3 skipped, 40 deselected in 50.00s")),
    ],
    ids=["all-skipped", "none-selected", "one-failed", "passed"],
)  # fmt: skip
def test_a_pytest_run_passes_only_when_a_test_passed(
    tmp_path: Path, pytest_out: str, pytest_rc: int, want: tuple[str, str]
) -> None:
    """pip failing both ways is the install row's FAIL; the other checks still run."""
    out = f"SKIPPED [3] tests/test_gpu.py:45: needs CuPy and 2+ GPUs\n{pytest_out}\n"
    proc, calls = _run_stubbed(tmp_path, _probe(True, **ALL), 1, out, pytest_rc)
    rows = _rows(proc.stdout)
    assert rows["pytest-gpu"] == want
    assert rows["install"] == ("FAIL", "exit 1; stub pip failed")
    assert [c for c in calls if "pip" in c] == [
        "-m pip install -q --no-deps --no-index --no-build-isolation -e .",
        "-m pip install -q --no-deps --timeout 5 --retries 0 -e .",
    ]
    (pytest_call,) = [c for c in calls if c.startswith("-m pytest")]
    assert pytest_call.startswith(
        "-m pytest -q -rs -p no:cacheprovider -m gpu "
        "--deselect tests/test_gpu.py::test_gpu_check_quick_passes tests/"
    )
    assert "tests/test_gpu_parity.py" in pytest_call.split()
    assert rows["gpu-check"][0] == "PASS"
    assert proc.returncode == 1


def test_a_gpu_torch_cannot_use_is_a_fail_on_every_row(tmp_path: Path) -> None:
    """nvidia-smi lists an H100, nothing hides it, torch sees no CUDA (a CPU wheel, a
    driver mismatch): no row may pass as skipped."""
    proc, calls = _run_stubbed(tmp_path, _probe(False, **ALL))
    reason = (
        f"nvidia-smi lists {H100} but torch.cuda.is_available() is False "
        "(torch: 2.11.0+cu130 (CUDA 13.0), torch.cuda.is_available() False, 0 device(s))"
    )
    assert _rows(proc.stdout) == {name: ("FAIL", reason) for name in CHECKS}
    assert proc.returncode == 1 and calls == ["-"]  # the probe, nothing else
