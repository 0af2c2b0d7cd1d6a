"""``scripts/gpu_checks.sh`` without CUDA: every GPU check SKIP, one table, exit 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"


@pytest.mark.slow
def test_gpu_checks_script_skips_every_check_without_cuda(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OUT", "TOTAL_S", "NEMO_RL_DIR", "GPU_CHECK_ARGS")
    }
    # Hidden even where a GPU is: the script must then skip, not run the checks.
    env.update(CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_checks.sh"), str(out)],
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
    colocated = (
        NO_CUDA
        if (REPO / "benchmarks" / "gpu_colocated_check.py").exists()
        else "not written yet (benchmarks/gpu_colocated_check.py)"
    )
    table = [line for line in lines if line.startswith("|")]
    assert table == [
        "| check | status | seconds | log | figure / reason |",
        "|---|---|---|---|---|",
        f"| gpu-check | SKIP | - | - | {NO_CUDA} |",
        f"| pytest-gpu | SKIP | - | - | {NO_CUDA} |",
        f"| colocated-demo | SKIP | - | - | {NO_CUDA} |",
        f"| ipc-devices | SKIP | - | - | {NO_CUDA} |",
        f"| vllm-check | SKIP | - | - | {NO_CUDA} |",
        f"| colocated-check | SKIP | - | - | {colocated} |",
        f"| gpu-multi | SKIP | - | - | {NO_CUDA} |",
        f"| nemo-rl-grpo | SKIP | - | - | {NO_CUDA} |",
    ]
    # The same table is kept with the logs; no check ran, so no log was written.
    summary = (out / "summary.md").read_text().splitlines()
    assert [line for line in summary if line.startswith("|")] == table
    assert sorted(p.name for p in out.iterdir()) == ["summary.md"]
