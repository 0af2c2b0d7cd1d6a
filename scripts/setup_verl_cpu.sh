#!/usr/bin/env bash
# Install veRL into a CPU-torch virtual environment, for the veRL adapter tests
# (tests/test_verl_engine.py).
#
#   scripts/setup_verl_cpu.sh [VERSION] [VENV]      # defaults: 0.9.1 .venv-verl
#
# The venv sees the packages of the environment that runs the tests (python3 on PATH: a
# venv, conda or the system Python; see scripts/venv_lib.sh): the CPU torch, ray, this
# project. veRL pins its own transformers, which therefore stays inside the venv. veRL's
# extras (vllm, megatron, ...) pin CUDA torch and are not installed. About 2-3 minutes.
# Idempotent.
set -euo pipefail
VERSION="${1:-0.9.1}"
VENV="${2:-.venv-verl}"
# shellcheck source=scripts/venv_lib.sh
source "$(dirname "$0")/venv_lib.sh"

# Kept as it is when this script finished there last (is_done, scripts/venv_lib.sh).
if is_done "$VENV" "verl-$VERSION"; then
    echo "veRL $VERSION already in $VENV"
    exit 0
fi
make_venv "$VENV"
quiet "${PIP[@]}" "verl==$VERSION" uvicorn fastapi pyzmq cachetools
# The machine's transformers may require a newer `kernels` than the venv's pinned
# transformers accepts (kernels 0.19 rejects the LayerRepository calls of transformers
# 5.10 at import); its `kernels` extra puts the matching version inside the venv.
quiet "${PIP[@]}" "transformers[kernels]==$(installed "$PY" transformers)"
quiet "$PY" -c "import verl.checkpoint_engine"
mark_done "$VENV" "verl-$VERSION"
echo "veRL $VERSION checkpoint engines import on CPU"
