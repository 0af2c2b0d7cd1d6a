#!/usr/bin/env bash
# Install vLLM's model classes into a CPU-torch virtual environment, for the vLLM truth
# and worker-side tests (tests/test_vllm_truth.py, tests/test_vllm_worker.py).
#
#   scripts/setup_vllm_cpu.sh [VERSION] [VENV]      # defaults: 0.33.0 .venv-vllm
#
# The venv sees the packages of the environment that runs the tests (python3 on PATH: a
# venv, conda or the system Python; see scripts/venv_lib.sh): the CPU torch, this project,
# transformers. vLLM's wheel goes in with --no-deps, plus only its pure-Python
# requirements. No CUDA torch, flashinfer, triton or other kernel package is installed:
# vLLM's CUDA kernels do not load, its model classes and weight loaders do.
# About 1 minute and 1 GB (the wheel is 336 MB). Idempotent.
set -euo pipefail
VERSION="${1:-0.33.0}"
VENV="${2:-.venv-vllm}"
# shellcheck source=scripts/venv_lib.sh
source "$(dirname "$0")/venv_lib.sh"

# What vLLM's quantization registry imports (its FP8 classes, built by the FP8 truth
# tests): compressed-tensors at the version this vLLM pins, and loguru, which it needs.
quantization_deps() {
    local pin
    pin="$("$PY" - <<'PYEOF'
from importlib.metadata import requires
print(next((r.split(";")[0].replace(" ", "") for r in requires("vllm") or []
            if r.startswith("compressed-tensors")), "compressed-tensors"))
PYEOF
)"
    quiet "${PIP[@]}" --no-deps "$pin" loguru
}

# Kept as it is when this script finished there last (is_done, scripts/venv_lib.sh).
if is_done "$VENV" "vllm-$VERSION"; then
    echo "vLLM $VERSION already in $VENV"
    exit 0
fi
make_venv "$VENV"
# pip warns that vLLM's declared requirements (CUDA torch, kernels) are not met: that is
# the point. Its output is shown only when an install fails.
# Leaf packages and the ones whose own requirements would pull torch or triton: no deps.
# cloudpickle, py-cpuinfo, orjson: imported by vLLM's modules; a system Python may have
# them, a fresh venv does not.
quiet "${PIP[@]}" --no-deps "vllm==$VERSION" "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11" \
    psutil cbor2 pybase64 cachetools msgspec uvloop prometheus_client \
    partial-json-parser llguidance einops cloudpickle py-cpuinfo orjson
# Pure-Python requirements with their own (pure-Python) dependencies.
quiet "${PIP[@]}" aiohttp openai oss-harmony pillow fastapi pyzmq
quantization_deps
VLLM_TARGET_DEVICE=cpu VLLM_LOGGING_LEVEL=ERROR quiet "$PY" - <<'PYEOF'
import vllm.model_executor.models.deepseek_v2, vllm.model_executor.models.qwen3_moe  # noqa
import vllm
PYEOF
mark_done "$VENV" "vllm-$VERSION"
echo "vLLM $VERSION model classes import on CPU"
