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
# The venvs are built once and reused while they work (a few seconds each to check);
# one made for another Python environment is rebuilt:
#   .venv-vllm        vLLM 0.33.0's model classes on CPU     scripts/setup_vllm_cpu.sh, ~1 min
#   .venv-verl        veRL 0.9.1                             scripts/setup_verl_cpu.sh, ~3 min
#   .venv-sglang      SGLang 0.5.23's model classes on CPU   scripts/setup_sglang_cpu.sh, ~2 min,
#                                                            1.4 GB (triton)
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

bash scripts/setup_vllm_cpu.sh
bash scripts/setup_verl_cpu.sh
bash scripts/setup_sglang_cpu.sh
if [ -n "${NEMO_RL_SOURCE:-}" ]; then
    # The Python 3.11 one over the running environment: NEMO_RL_PYTHON is for the other.
    NEMO_RL_PYTHON="" bash scripts/setup_nemo_rl_cpu.sh "$NEMO_RL_SOURCE" .venv-nemo-rl
    # Resolved here so that a machine without Python 3.12 still runs everything else.
    if PY312="$(resolve_python NEMO_RL_PYTHON "${NEMO_RL_PYTHON:-python3.12}" 2>/dev/null)"; then
        NEMO_RL_PYTHON="$PY312" bash scripts/setup_nemo_rl_cpu.sh "$NEMO_RL_SOURCE" .venv-nemo-rl312
    else
        echo "NeMo RL GRPO tests skipped: no ${NEMO_RL_PYTHON:-python3.12} (set NEMO_RL_PYTHON=<path of a Python >= 3.12>)"
    fi
elif [ ! -x .venv-nemo-rl/bin/python ] || [ ! -x .venv-nemo-rl312/bin/python ]; then
    echo "NeMo RL tests skipped: set NEMO_RL_SOURCE=<clone or git URL> (NeMo RL is not on PyPI)"
fi

exec python3 -m pytest -q "${MARKERS[@]}" "$@"
