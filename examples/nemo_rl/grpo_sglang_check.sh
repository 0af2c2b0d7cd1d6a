#!/usr/bin/env bash
# GPU check (not run here: needs >= 2 GPUs): a short GRPO run of a Megatron policy with
# NeMo RL's SGLang generation, colocated, refit by refit.backend=reshard (NeMo RL has no
# refit of a Megatron policy into SGLang of its own), then the per-step table of refit
# time and trainer-vs-generator logprob error. Qwen3-0.6B on one node.
#
#   NEMO_RL_DIR=/path/to/NeMo-RL bash examples/nemo_rl/grpo_sglang_check.sh
#   GPUS=4 TRAIN_TP=2 SGLANG_TP=1 bash examples/nemo_rl/grpo_sglang_check.sh  # a real reshard
#
# Run it in NeMo RL's environment with this package installed there AND in NeMo RL's
# SGLang venv (SGLang imports our loader by name in every scheduler process; or set
# NEMO_RL_PY_EXECUTABLES_SYSTEM=1). Extra arguments are Hydra overrides.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
NEMO_RL_DIR="${NEMO_RL_DIR:?set NEMO_RL_DIR to a NeMo RL checkout}"
GPUS="${GPUS:-2}"              # one node, shared by the policy and SGLang (colocated)
TRAIN_TP="${TRAIN_TP:-1}"
SGLANG_TP="${SGLANG_TP:-1}"
STEPS="${STEPS:-3}"
OUT="${OUT:-$REPO/grpo_sglang_check}"
rm -rf "$OUT" && mkdir -p "$OUT"

(cd "$NEMO_RL_DIR" && uv run python "$REPO/examples/nemo_rl/run_grpo.py" \
    --config "$REPO/configs/nemo_rl/grpo_math_qwen3_8B_megatron_reshard_sglang.yaml" \
    policy.model_name=Qwen/Qwen3-0.6B \
    grpo.num_prompts_per_step=2 \
    grpo.num_generations_per_prompt=4 \
    policy.train_global_batch_size=4 \
    policy.train_micro_batch_size=1 \
    policy.logprob_batch_size=1 \
    policy.max_total_sequence_length=512 \
    policy.megatron_cfg.tensor_model_parallel_size=$TRAIN_TP \
    policy.megatron_cfg.pipeline_model_parallel_size=1 \
    policy.generation.sglang_cfg.tp_size=$SGLANG_TP \
    policy.generation.sglang_cfg.sglang_server_config.num_gpus=$GPUS \
    cluster.num_nodes=1 \
    cluster.gpus_per_node=$GPUS \
    grpo.max_num_steps=$STEPS \
    logger.tensorboard_enabled=true \
    logger.log_dir="$OUT/reshard" \
    logger.wandb_enabled=false \
    checkpointing.enabled=false \
    "$@" 2>&1 | tee "$OUT/reshard.log")
(cd "$NEMO_RL_DIR" && uv run python "$HERE/refit_summary.py" "$OUT/reshard")
