#!/usr/bin/env bash
# Install veRL into a CPU-torch virtual environment, for the veRL adapter tests
# (tests/test_verl_engine.py).
#
#   scripts/setup_verl_cpu.sh [VERSION] [VENV]      # defaults: 0.9.1 .venv-verl
#
# The venv sees this machine's packages (--system-site-packages: the CPU torch, ray, this
# project); veRL pins its own transformers, which therefore stays inside the venv. veRL's
# extras (vllm, megatron, ...) pin CUDA torch and are not installed. About 2-3 minutes.
# Idempotent.
set -euo pipefail
VERSION="${1:-0.9.1}"
VENV="${2:-.venv-verl}"
PY="$VENV/bin/python"

if [ -x "$PY" ] && [ "$("$PY" -c 'from importlib.metadata import version; print(version("verl"))' 2>/dev/null)" = "$VERSION" ]; then
    echo "veRL $VERSION already in $VENV"
    exit 0
fi
python3 -m venv --system-site-packages "$VENV"
TORCH="$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')"
CONSTRAINTS="$(mktemp)"
LOG="$(mktemp)"
trap 'rm -f "$CONSTRAINTS" "$LOG"' EXIT
echo "torch==$TORCH" > "$CONSTRAINTS"
"$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" \
    "verl==$VERSION" uvicorn fastapi pyzmq cachetools >"$LOG" 2>&1 || { cat "$LOG"; exit 1; }
"$PY" -c "import verl.checkpoint_engine, verl; print(f'veRL {verl.__version__} checkpoint engines import on CPU')"
