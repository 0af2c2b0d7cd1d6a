#!/usr/bin/env bash
# Install a real CuPy wheel and NCCL's wheel into a CPU-torch virtual environment, for the
# test that runs the cupy-nccl transport's own init path against them
# (tests/test_cupy_wheels.py).
#
#   scripts/setup_cupy_cpu.sh [CUPY_VERSION] [VENV]      # defaults: 14.2.0 .venv-cupy14
#   scripts/setup_cupy_cpu.sh 13.6.0 .venv-cupy13
#
# Why: the transport's NCCL unique id changed type between CuPy 13 (a tuple of signed
# chars) and CuPy 14 (bytes); only the real wheels show which one a release wants. Both
# install from PyPI on a machine without a GPU, and cupy.cuda.nccl.get_unique_id() runs
# there (NCCL makes the id without a device); the first CUDA call then fails with CuPy's
# own error. The venv sees the packages of the environment that runs the tests
# (scripts/venv_lib.sh: the CPU torch, this project). About 30 s and 0.75 GB each
# (installed: NCCL ~470 MB, CuPy ~300 MB). Idempotent.
set -euo pipefail
VERSION="${1:-14.2.0}"
VENV="${2:-.venv-cupy14}"
# shellcheck source=scripts/venv_lib.sh
source "$(dirname "$0")/venv_lib.sh"

# Kept as it is when this script finished there last (is_done, scripts/venv_lib.sh).
if is_done "$VENV" "cupy-$VERSION"; then
    echo "CuPy $VERSION already in $VENV"
    exit 0
fi
make_venv "$VENV"
# NCCL's wheel is what cupy.cuda.nccl loads (CuPy's wheel has no NCCL of its own).
quiet "${PIP[@]}" "cupy-cuda12x==$VERSION" nvidia-nccl-cu12
# The check the test relies on: CuPy imports, NCCL loads, an id can be made.
quiet "$PY" - <<'PYEOF'
from cupy.cuda import nccl

assert nccl.available, "cupy.cuda.nccl did not load NCCL"
nccl.get_unique_id()
PYEOF
mark_done "$VENV" "cupy-$VERSION"
echo "CuPy $VERSION with NCCL in $VENV"
