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
set -euo pipefail
SRC="${1:?usage: scripts/setup_nemo_rl_cpu.sh SRC [VENV] (SRC: a NeMo RL clone or git URL)}"
VENV="${2:-.venv-nemo-rl}"
COMMIT="${NEMO_RL_COMMIT:-7ea279abfbeb698b092856d0dab61e7cf39bc909}"
HERE="$(cd "$(dirname "$0")" && pwd)"

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
source "$HERE/venv_lib.sh"
make_venv "$VENV"
quiet "${PIP[@]}" "transformers>=5.5,<5.9" accelerate pillow pyzmq nvidia-ml-py uvicorn fastapi
# Editable: NeMo RL's wheel lists only its top-level package.
quiet "${PIP[@]}" --no-deps --ignore-requires-python -e "$SRC"
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
