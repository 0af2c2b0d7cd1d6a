#!/usr/bin/env bash
# GPU check (not run here: needs >= 2 GPUs): a short GRPO run with refit.backend=reshard
# and the same run with NeMo RL's default refit (nccl), then a per-step table of refit
# time and trainer-vs-generator logprob error. Shaped like NeMo RL's own
# tests/functional/grpo_nccl_reshard_refit.sh: Qwen3-0.6B, Megatron policy and vLLM on
# disjoint GPUs of one node.
#
#   NEMO_RL_DIR=/path/to/NeMo-RL bash examples/nemo_rl/grpo_refit_check.sh
#   GPUS=4 TRAIN_TP=2 VLLM_TP=1 bash examples/nemo_rl/grpo_refit_check.sh   # a real reshard
#
# Run it in NeMo RL's environment with this package installed there
# (pip install -e /path/to/nemo-refit-reshard cupy-cuda12x; NeMo RL's per-worker venvs
# need it too, or set NEMO_RL_PY_EXECUTABLES_SYSTEM=1). Extra arguments are Hydra
# overrides for both runs.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
NEMO_RL_DIR="${NEMO_RL_DIR:?set NEMO_RL_DIR to a NeMo RL checkout}"
GPUS="${GPUS:-2}"              # one node: training GPUs = GPUS - VLLM_GPUS
VLLM_GPUS="${VLLM_GPUS:-$((GPUS / 2))}"
TRAIN_TP="${TRAIN_TP:-1}"
VLLM_TP="${VLLM_TP:-1}"
STEPS="${STEPS:-3}"
OUT="${OUT:-$REPO/grpo_refit_check}"
rm -rf "$OUT" && mkdir -p "$OUT"

for backend in reshard nccl; do
    (cd "$NEMO_RL_DIR" && uv run python "$REPO/examples/nemo_rl/run_grpo.py" \
        --config "$NEMO_RL_DIR/examples/configs/grpo_math_1B_megatron.yaml" \
        +refit.backend=$backend \
        policy.model_name=Qwen/Qwen3-0.6B \
        grpo.num_prompts_per_step=2 \
        grpo.num_generations_per_prompt=4 \
        policy.train_global_batch_size=4 \
        policy.train_micro_batch_size=1 \
        policy.logprob_batch_size=1 \
        policy.max_total_sequence_length=512 \
        policy.megatron_cfg.enabled=true \
        policy.megatron_cfg.tensor_model_parallel_size=$TRAIN_TP \
        policy.dtensor_cfg.enabled=false \
        policy.generation.backend=vllm \
        policy.generation.colocated.enabled=false \
        policy.generation.colocated.resources.num_nodes=1 \
        policy.generation.colocated.resources.gpus_per_node=$VLLM_GPUS \
        policy.generation.vllm_cfg.tensor_parallel_size=$VLLM_TP \
        cluster.num_nodes=1 \
        cluster.gpus_per_node=$GPUS \
        grpo.max_num_steps=$STEPS \
        logger.tensorboard_enabled=true \
        logger.log_dir="$OUT/$backend" \
        logger.wandb_enabled=false \
        checkpointing.enabled=false \
        "$@" 2>&1 | tee "$OUT/$backend.log")
done
(cd "$NEMO_RL_DIR" && uv run python "$HERE/refit_summary.py" "$OUT/reshard" "$OUT/nccl")
