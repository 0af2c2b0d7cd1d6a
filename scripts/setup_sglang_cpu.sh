#!/usr/bin/env bash
# Install SGLang's model classes into a CPU-torch virtual environment, for the SGLang
# layout truth tests (tests/test_sglang_cpu.py).
#
#   scripts/setup_sglang_cpu.sh [VERSION] [VENV]      # defaults: 0.5.23 .venv-sglang
#
# As scripts/setup_vllm_cpu.sh does for vLLM: the venv sees the packages of the
# environment that runs the tests (scripts/venv_lib.sh: the CPU torch, this project,
# transformers); SGLang's wheel goes in with --no-deps (it pins torch 2.14.1, a CUDA
# build, and kernel packages: flashinfer, sglang-kernel, deep-gemm, none of which load
# on a CPU torch), plus only the pure-Python packages its model modules import.
# Idempotent.
set -euo pipefail
VERSION="${1:-0.5.23}"
VENV="${2:-.venv-sglang}"
# shellcheck source=scripts/venv_lib.sh
source "$(dirname "$0")/venv_lib.sh"

if is_done "$VENV" "sglang-$VERSION"; then
    echo "SGLang $VERSION already in $VENV"
    exit 0
fi
make_venv "$VENV"
# What differs per SGLang version: its pins of apache-tvm-ffi and openai, and for
# 0.5.12.post1 (NeMo RL's pin) transformers at its pin 5.6.0: its sglang.srt.configs
# registers "qwen3_asr" with AutoConfig, which transformers >= 5.7 already has (a
# ValueError at import), with the `kernels` range that transformers 5.6 accepts (its
# hub_kernels fails at import on kernels 0.19). 0.5.23 uses the running environment's
# transformers.
case "$VERSION" in
    0.5.12*) TVM_FFI=0.1.9 OPENAI=2.6.1 OWN=("transformers==5.6.0" "kernels>=0.12.0,<0.13") ;;
    *) TVM_FFI=0.1.11 OPENAI=2.8.0 OWN=() ;;
esac
# No deps: SGLang's own pins would pull a CUDA torch. apache-tvm-ffi at SGLang's pin
# (its jit kernels module imports it at import time). The others: imported at module
# level on the way to sglang.srt.models.qwen3 / qwen3_moe (aiohttp, starlette, pyzmq,
# msgspec, pybase64: the server/IPC utils; einops, gguf, compressed-tensors: layers and
# quantization registry; loguru, dill, psutil, pillow, sentencepiece: utils and configs;
# triton: layers import triton kernels at module level, the wheel imports without a GPU;
# orjson, IPython, traitlets: utils; found by building this venv over a fresh venv that
# holds only this project's `.[test]` install).
# torchvision is NOT installed: only CUDA wheels exist here and they fail to load on the
# CPU torch; tests/helpers/sglang_cpu.py stands it in.
quiet "${PIP[@]}" --no-deps "sglang==$VERSION" "apache-tvm-ffi==$TVM_FFI" \
    aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl starlette \
    pyzmq msgspec pybase64 einops gguf compressed-tensors loguru dill psutil pillow \
    sentencepiece triton orjson IPython traitlets
# Pure-Python packages whose own requirements are pure Python too (no torch): with their
# dependencies. The OpenAI protocol types (openai at SGLang's pin, partial-json-parser)
# are imported by the scheduler's batch module, fastapi and uvicorn by ServerArgs' chain.
quiet "${PIP[@]}" "openai==$OPENAI" partial-json-parser fastapi uvicorn ${OWN[@]+"${OWN[@]}"}
PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)" quiet "$PY" -c \
    "from tests.helpers.sglang_cpu import import_sglang_models; import_sglang_models()"
mark_done "$VENV" "sglang-$VERSION"
echo "SGLang $VERSION model classes import on CPU"
