#!/usr/bin/env bash
# Install NeMo RL (pinned commit) with vLLM 0.25.1's model classes into a CPU-torch venv,
# for the NeMo RL adapter tests (tests/test_nemo_rl_engine.py).
#
#   scripts/setup_nemo_rl_cpu.sh SRC [VENV]        # VENV default: .venv-nemo-rl
#
# SRC: a local clone of NeMo RL (github NVIDIA-NeMo/RL) or a git URL to clone. NeMo RL
# is not on the package index. The pinned commit is checked out (override with
# NEMO_RL_COMMIT). NeMo RL declares Python >= 3.13 and torch 2.11: it is installed with
# --no-deps --ignore-requires-python; its checkpoint-engine modules import on 3.11 with
# this machine's CPU torch, transformers < 5.9 (its pin) and vLLM 0.25.1 (its pin,
# model classes only, as scripts/setup_vllm_cpu.sh installs them).
#
#   NEMO_RL_PYTHON=python3.12 scripts/setup_nemo_rl_cpu.sh SRC VENV
#
# builds VENV instead as an isolated venv on that interpreter (a name, looked up on PATH
# and then through pyenv, or a path; no system site packages; see VENV_PYTHON in
# scripts/venv_lib.sh), with torch of the same version (the CUDA build from the index
# where no CPU wheel exists: ~2.6 GB, runs on CPU) and everything the system site would
# otherwise provide: this project (editable), megatron-core and ray[default] at the
# system's versions, pytest, and what examples/nemo_rl/run_grpo.py imports (NeMo RL's GRPO,
# data and logger modules; Ray's dashboard, which NeMo RL's init_ray starts). NeMo RL's GRPO
# module needs Python >= 3.12: on 3.11 pydantic rejects its typing.TypedDict configs.
#
# Measured on a shared 2-core machine (the one this project is built on), nothing in pip's
# cache: the default (3.11) flow 2.5 minutes, 1.1 GB (the 336 MB vLLM wheel); the 3.12
# flow 10.5 minutes, 6.9 GB (about 4 of those minutes the torch download and install).
# Idempotent: a finished venv of the pinned commit is kept as it is (a few seconds).
set -euo pipefail
SRC="${1:?usage: scripts/setup_nemo_rl_cpu.sh SRC [VENV] (SRC: a NeMo RL clone or git URL)}"
VENV="${2:-.venv-nemo-rl}"
COMMIT="${NEMO_RL_COMMIT:-7ea279abfbeb698b092856d0dab61e7cf39bc909}"
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$HERE")"
# shellcheck source=scripts/venv_lib.sh
source "$HERE/venv_lib.sh"

if [ -n "${NEMO_RL_PYTHON:-}" ]; then
    # A name (python3.12) or a path; resolved once, here, so that a pyenv shim's failure
    # is one line before anything is built. Read by make_venv here and in setup_vllm_cpu.sh.
    VENV_PYTHON="$(resolve_python NEMO_RL_PYTHON "$NEMO_RL_PYTHON")"
    export VENV_PYTHON
    echo "NEMO_RL_PYTHON: $VENV_PYTHON"
fi
# Kept as it is when this script finished there last for this commit (is_done,
# scripts/venv_lib.sh).
if is_done "$VENV" "nemo_rl-$COMMIT"; then
    echo "NeMo RL ${COMMIT:0:12} already in $VENV"
    exit 0
fi
make_venv "$VENV"
if [ -n "${VENV_PYTHON:-}" ]; then
    # What the default flow takes from the system site for vLLM's modules (imported by
    # setup_vllm_cpu.sh's check and NeMo RL's vLLM backend), in before vLLM itself.
    quiet "${PIP[@]}" "transformers>=5.5,<5.9" packaging requests cloudpickle py-cpuinfo
fi
bash "$HERE/setup_vllm_cpu.sh" 0.25.1 "$VENV"
# The editable install points at a checkout of the pinned commit that lives with the
# venv; the given clone is left as it is.
is_git() { [ -d "$1/.git" ] || [ "$(git -C "$1" rev-parse --is-bare-repository 2>/dev/null)" = true ]; }
if [ ! -d "$SRC" ] || is_git "$SRC"; then
    CHECKOUT="$VENV/src/nemo-rl"
    rm -rf "$CHECKOUT"
    git clone -q "$SRC" "$CHECKOUT"
    git -C "$CHECKOUT" checkout -q "$COMMIT" || {
        echo "commit $COMMIT is not in $SRC: fetch it there, or set NEMO_RL_COMMIT" >&2
        exit 1
    }
    SRC="$CHECKOUT"
elif [ -n "${NEMO_RL_COMMIT:-}" ]; then
    echo "$SRC is not a git checkout: cannot check out $COMMIT" >&2
    exit 1
else
    echo "note: $SRC is not a git checkout; using it as it is (expected: NeMo RL $COMMIT)"
fi
quiet "${PIP[@]}" "transformers>=5.5,<5.9" accelerate pillow pyzmq nvidia-ml-py uvicorn fastapi
# Editable: NeMo RL's wheel lists only its top-level package.
quiet "${PIP[@]}" --no-deps --ignore-requires-python -e "$SRC"
if [ -n "${VENV_PYTHON:-}" ]; then
    # The isolated venv sees none of the system's packages. megatron-core and ray at the
    # system's versions (else this project's test-extra ranges). Ray with its `default`
    # extra, as NeMo RL declares it: init_ray starts a local cluster with the dashboard,
    # which refuses to start without aiohttp_cors, opencensus, ... (ray alone lacks them).
    mcore="$(installed "$(command -v python3)" megatron-core || true)"
    ray="$(installed "$(command -v python3)" ray || true)"
    MCORE_REQ="megatron-core>=0.16,<0.17"
    RAY_REQ="ray[default]>=2.40"
    [ -z "$mcore" ] || MCORE_REQ="megatron-core==$mcore"
    [ -z "$ray" ] || RAY_REQ="ray[default]==$ray"
    # torchdata ... hydra-core: what nemo_rl.algorithms.grpo imports (its loggers, data
    # and config stack). pytest, safetensors: the tests. transformers again so that none
    # of these moves it off NeMo RL's range.
    quiet "${PIP[@]}" torchdata mlflow swanlab wandb tensorboard datasets soundfile tensordict zstandard \
        hydra-core omegaconf "$MCORE_REQ" "$RAY_REQ" safetensors pytest "transformers>=5.5,<5.9"
    # This project, editable, with its runtime dependencies from pyproject.toml (torch
    # stays at the constrained version).
    quiet "${PIP[@]}" --no-deps -e "$REPO"
    mapfile -t DEPS < <("$PY" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' "$REPO/pyproject.toml")
    quiet "${PIP[@]}" "${DEPS[@]}"
fi
# The machine's transformers may require a newer `kernels` than NeMo RL's transformers
# accepts (kernels 0.19 rejects the LayerRepository calls of transformers 5.8 at import,
# seen through --system-site-packages); its `kernels` extra puts the matching version
# inside the venv.
quiet "${PIP[@]}" "transformers[kernels]==$(installed "$PY" transformers)"
VLLM_TARGET_DEVICE=cpu VLLM_LOGGING_LEVEL=ERROR quiet "$PY" - <<'PYEOF'
from nemo_rl.models.generation.vllm.vllm_backend import (  # noqa: F401
    VllmInternalWorkerExtensionWithCheckpointEngine,
)
from nemo_rl.models.policy.workers.checkpoint_engine import PolicyCheckpointEngineMixin  # noqa
from nemo_rl.weight_sync.checkpoint_engine_weight_synchronizer import (  # noqa: F401
    CheckpointEngineWeightSynchronizer,
)
PYEOF
echo "NeMo RL checkpoint-engine classes import on CPU"
if [ -n "${VENV_PYTHON:-}" ]; then
    VLLM_TARGET_DEVICE=cpu VLLM_LOGGING_LEVEL=ERROR quiet "$PY" - <<'PYEOF'
import sys

import megatron.core  # noqa: F401
import nemo_refit_reshard  # noqa: F401
import ray.dashboard.optional_deps  # noqa: F401  (what Ray checks before its dashboard starts)

if sys.version_info >= (3, 12):  # pydantic rejects its typing.TypedDict configs below
    # everything examples/nemo_rl/run_grpo.py imports from NeMo RL
    from nemo_rl.algorithms.grpo import refit_policy_generation, setup  # noqa: F401
    from nemo_rl.algorithms.utils import get_tokenizer  # noqa: F401
    from nemo_rl.data.utils import setup_response_data  # noqa: F401
    from nemo_rl.distributed.virtual_cluster import init_ray  # noqa: F401
    from nemo_rl.models.generation import configure_generation_config  # noqa: F401
    from nemo_rl.utils.logger import get_next_experiment_dir  # noqa: F401

    from nemo_refit_reshard.integrations.nemo_rl.grpo import policy_factory  # noqa: F401
PYEOF
    echo "megatron-core, nemo_refit_reshard, Ray's dashboard (and on Python >= 3.12 what examples/nemo_rl/run_grpo.py imports) import in $VENV"
fi
mark_done "$VENV" "nemo_rl-$COMMIT"
