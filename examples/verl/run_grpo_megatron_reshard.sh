#!/usr/bin/env bash
# veRL GRPO (Megatron actor, vLLM or SGLang rollout, disaggregated) with the reshard
# checkpoint engine.
#
#   bash examples/verl/run_grpo_megatron_reshard.sh [extra Hydra overrides...]
#
# Needs a GPU node with veRL and its Megatron/vLLM extras installed, plus this package:
#   pip install "verl[vllm,mcore]==0.9.1" cupy-cuda12x && pip install -e /path/to/nemo-refit-reshard
# (docs/verl.md). 4 actor GPUs + 4 rollout GPUs on one node; REFIT_BACKEND=nccl runs
# veRL's own broadcast engine for a side-by-side comparison. ROLLOUT_QUANTIZATION=fp8
# generates with 128x128 block-FP8 weights (veRL's rollout.quantization); the engine is
# told too, and checks that every rollout shard is whole FP8 blocks. ROLLOUT_NAME=sglang
# generates with SGLang (veRL's rollout.name; needs verl[sglang]) and tells the engine to
# plan SGLang's shards (engine_kwargs.reshard.infer_engine=sglang; docs/verl.md "SGLang
# rollouts": BF16, no expert parallelism on the rollout).
set -euo pipefail

MODEL_PATH="${MODEL_PATH:-Qwen/Qwen3-8B}"
TRAIN_FILES="${TRAIN_FILES:-$HOME/data/gsm8k/train.parquet}"
VAL_FILES="${VAL_FILES:-$HOME/data/gsm8k/test.parquet}"
ROLLOUT_TP="${ROLLOUT_TP:-2}"
REFIT_BACKEND="${REFIT_BACKEND:-reshard}"
ROLLOUT_QUANTIZATION="${ROLLOUT_QUANTIZATION:-}"
ROLLOUT_NAME="${ROLLOUT_NAME:-vllm}"
CE=actor_rollout_ref.rollout.checkpoint_engine
QUANT=()
if [ -n "$ROLLOUT_QUANTIZATION" ]; then
    QUANT=("actor_rollout_ref.rollout.quantization=$ROLLOUT_QUANTIZATION")
fi

if [ "$REFIT_BACKEND" = reshard ]; then
    ENGINE=(
        "$CE.backend=reshard"
        "+$CE.custom_backend_module=nemo_refit_reshard.integrations.verl"
        "+$CE.engine_kwargs.reshard.model=$MODEL_PATH"
        "+$CE.engine_kwargs.reshard.infer='tp=$ROLLOUT_TP'"
        "+$CE.engine_kwargs.reshard.transport=cupy-nccl"
    )
    if [ -n "$ROLLOUT_QUANTIZATION" ]; then
        ENGINE+=("+$CE.engine_kwargs.reshard.quantization=$ROLLOUT_QUANTIZATION")
    fi
    if [ "$ROLLOUT_NAME" = sglang ]; then
        ENGINE+=("+$CE.engine_kwargs.reshard.infer_engine=sglang")
    fi
elif [ "$REFIT_BACKEND" = nccl ]; then
    ENGINE=("$CE.backend=nccl")
else
    echo "REFIT_BACKEND=$REFIT_BACKEND: choose reshard or nccl" >&2
    exit 2
fi

python3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files="$TRAIN_FILES" \
    data.val_files="$VAL_FILES" \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1 \
    actor_rollout_ref.rollout.name="$ROLLOUT_NAME" \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP" \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.nnodes=1 \
    actor_rollout_ref.rollout.n_gpus_per_node=4 \
    actor_rollout_ref.hybrid_engine=False \
    trainer.use_v1=True \
    trainer.v1.trainer_mode=separate_async \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node=4 \
    trainer.total_training_steps=20 \
    trainer.logger='["console"]' \
    "${ENGINE[@]}" \
    "${QUANT[@]}" \
    "$@"
