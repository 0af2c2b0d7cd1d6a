"""The cupy-nccl transport's own init path against the real CuPy wheels, on CPU.

CuPy 13 takes the NCCL unique id as a tuple of signed chars, CuPy 14 as bytes; only the
real wheels say which, and both install (with nvidia-nccl-cu12) on a machine without a
GPU, where ``get_unique_id()`` works and the first CUDA call fails. In each venv of
``scripts/setup_cupy_cpu.sh`` a subprocess (``tests/programs/cupy_init_path.py``) shares
the id through a real ``TCPStore`` with our ``share_unique_id`` and opens the
communicator with our ``open_communicator``: the path must get as far as NCCL's own
first CUDA call (CuPy's ``NcclError``), never stop at an argument's type.

``scripts/test.sh`` always builds both venvs, so under CI a missing one fails the test;
elsewhere it skips, saying how to build it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers.vllm_env import REPO

pytestmark = pytest.mark.slow

VENVS = {"13.6.0": ".venv-cupy13", "14.2.0": ".venv-cupy14"}
ID_TYPES = {"13.6.0": "tuple", "14.2.0": "bytes"}  # what each CuPy's get_unique_id returns
NCCL_NO_DEVICE = (
    "NCCL_ERROR_UNHANDLED_CUDA_ERROR: unhandled cuda error (run with NCCL_DEBUG=INFO for details)"
)
NO_DEVICE_REASON = re.compile(
    r"no CUDA device \((cudaError\w+: .+|cupy\.cuda\.is_available\(\) is False)\)"
)


def cupy_python(version: str) -> str:
    """The venv's Python; under CI (always built there by scripts/test.sh) its absence is
    a failure, elsewhere a skip."""
    venv = VENVS[version]
    python = REPO / venv / "bin" / "python"
    if not python.exists():
        why = f"{venv} is missing: bash scripts/setup_cupy_cpu.sh {version} {venv} builds it"
        if os.environ.get("CI"):
            pytest.fail(f"{why} (scripts/test.sh builds it before the tests in CI)")
        pytest.skip(why)
    return str(python)


@functools.cache
def run_init_path(version: str) -> dict:
    """The program's record in the venv of CuPy ``version`` (run once a session)."""
    out = Path(tempfile.mkdtemp(prefix="nrr-cupy-")) / "result.json"
    done = subprocess.run(
        [cupy_python(version), "-m", "tests.programs.cupy_init_path", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("version", sorted(VENVS))
def test_init_path_reaches_ncclcomminitrank(version: str) -> None:
    """Both ranks get the id in their CuPy's form and fail at the first CUDA call inside
    NCCL's init, with CuPy's NcclError as the cause (a tuple id on CuPy 14 stops at a
    TypeError, before any CUDA call)."""
    result = run_init_path(version)
    for rank, record in enumerate(result["ranks"]):
        assert record["error"] == {
            "type": "TransportError",
            "module": "nemo_refit_reshard.engine.transport",
            "message": f"refit rank {rank}: NCCL init failed ({NCCL_NO_DEVICE})",
        }, record
        assert record["cause"] == {
            "type": "NcclError",
            "module": "cupy_backends.cuda.libs.nccl",
            "message": NCCL_NO_DEVICE,
        }, record
        assert record["uid"] == {"type": ID_TYPES[version], "len": 128}, record


@pytest.mark.parametrize("version", sorted(VENVS))
def test_cupy_unavailable_without_a_device(version: str) -> None:
    """NCCL loads there, but there is no device: cupy_available() is False, saying so."""
    result = run_init_path(version)
    assert result["cupy_available"] is False
    assert NO_DEVICE_REASON.fullmatch(result["reason"]), result["reason"]
