#!/usr/bin/env bash
# Everything CI tests, in one command (.ci/run runs exactly this after the install):
# builds the framework venvs the tests need and lacks, then runs the suite.
#
#   bash scripts/test.sh [PYTEST ARGS...]          # the whole suite (~22 min on 2 cores)
#   bash scripts/test.sh --fast [PYTEST ARGS...]   # -m "not slow": the tier for editing
#
# Run it with the Python the project is installed in (`pip install torch==2.13.0 -e
# ".[test]"`, in a venv, conda or the system Python): the tests run under `python3` on
# PATH, and the framework venvs see its packages (scripts/venv_lib.sh).
#
# The venvs are built once and reused while they work (a few seconds each to check; the
# first run builds them all, ~10 min and ~3 GB, one line before each); one made for
# another Python environment is rebuilt:
#   .venv-vllm        vLLM 0.33.0's model classes on CPU     scripts/setup_vllm_cpu.sh, ~1 min
#   .venv-verl        veRL 0.9.1                             scripts/setup_verl_cpu.sh, ~3 min
#   .venv-sglang      SGLang 0.5.23's model classes on CPU   scripts/setup_sglang_cpu.sh, ~2 min,
#                                                            1.4 GB (triton)
#   .venv-cupy13      CuPy 13.6.0 + NCCL (no GPU needed)     scripts/setup_cupy_cpu.sh, ~30 s,
#   .venv-cupy14      CuPy 14.2.0 + NCCL                     0.75 GB each
#   .venv-nemo-rl     NeMo RL + vLLM 0.25.1                  scripts/setup_nemo_rl_cpu.sh, ~3 min
#   .venv-nemo-rl312  the same on Python 3.12 (NeMo RL's     ~10 min, most of it a ~2.6 GB
#                     GRPO module needs it)                  torch download
# NeMo RL is not on the package index: its two venvs are built only when NEMO_RL_SOURCE
# names a clone or git URL of it (NVIDIA-NeMo/RL); without it, and without the venvs, its
# tests skip, saying why. The 3.12 venv is built on NEMO_RL_PYTHON (default python3.12,
# looked up on PATH and through pyenv; or a path).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv_lib.sh
source scripts/venv_lib.sh
# make_venv's switch to an isolated venv, set below for the 3.12 venv only.
unset VENV_PYTHON

MARKERS=()
if [ "${1:-}" = "--fast" ]; then
    shift
    MARKERS=(-m "not slow")
fi

if ! python3 -c 'import torch, nemo_refit_reshard' >/dev/null 2>&1; then
    echo "error: $(command -v python3) cannot import torch and nemo_refit_reshard:" \
        'install first: pip install torch==2.13.0 -e ".[test]"' >&2
    exit 1
fi

# setup VENV WHAT ABOUT SCRIPT [ARGS...]: runs scripts/SCRIPT unless VENV is done (its
# own is_done check, run with the script as $0 so the stamp is the script's), saying in
# one line what it builds first; a venv already done costs no line at all.
setup() {
    local venv="$1" what="$2" about="$3" script="scripts/$4"
    shift 4
    if bash -c 'source scripts/venv_lib.sh && is_done "$1" "$2"' "$script" "$venv" "$what"; then
        return 0
    fi
    echo "building $venv ($about, first run only)"
    bash "$script" "$@"
}
setup .venv-vllm vllm-0.33.0 "vLLM 0.33.0 model classes, ~1 min" setup_vllm_cpu.sh 0.33.0 .venv-vllm
setup .venv-verl verl-0.9.1 "veRL 0.9.1, ~3 min" setup_verl_cpu.sh 0.9.1 .venv-verl
setup .venv-sglang sglang-0.5.23 "SGLang 0.5.23 model classes, ~2 min" \
    setup_sglang_cpu.sh 0.5.23 .venv-sglang
setup .venv-cupy13 cupy-13.6.0 "CuPy 13.6.0 + NCCL wheels, ~30 s" setup_cupy_cpu.sh 13.6.0 .venv-cupy13
setup .venv-cupy14 cupy-14.2.0 "CuPy 14.2.0 + NCCL wheels, ~30 s" setup_cupy_cpu.sh 14.2.0 .venv-cupy14
if [ -n "${NEMO_RL_SOURCE:-}" ]; then
    # The Python 3.11 one over the running environment: NEMO_RL_PYTHON is for the other.
    # Its done check needs the source's commit: the line is for a venv not there at all.
    [ -x .venv-nemo-rl/bin/python ] || echo "building .venv-nemo-rl (NeMo RL + vLLM 0.25.1, ~3 min, first run only)"
    NEMO_RL_PYTHON="" bash scripts/setup_nemo_rl_cpu.sh "$NEMO_RL_SOURCE" .venv-nemo-rl
    # Resolved here so that a machine without Python 3.12 still runs everything else.
    if PY312="$(resolve_python NEMO_RL_PYTHON "${NEMO_RL_PYTHON:-python3.12}" 2>/dev/null)"; then
        [ -x .venv-nemo-rl312/bin/python ] || echo "building .venv-nemo-rl312 (NeMo RL on Python 3.12, ~10 min with a ~2.6 GB torch download, first run only)"
        NEMO_RL_PYTHON="$PY312" bash scripts/setup_nemo_rl_cpu.sh "$NEMO_RL_SOURCE" .venv-nemo-rl312
    else
        echo "NeMo RL GRPO tests skipped: no ${NEMO_RL_PYTHON:-python3.12} (set NEMO_RL_PYTHON=<path of a Python >= 3.12>)"
    fi
elif [ ! -x .venv-nemo-rl/bin/python ] || [ ! -x .venv-nemo-rl312/bin/python ]; then
    echo "NeMo RL tests skipped: set NEMO_RL_SOURCE=<clone or git URL> (NeMo RL is not on PyPI)"
fi

exec python3 -m pytest -q "${MARKERS[@]}" "$@"
