#!/usr/bin/env bash
# Multi-GPU check (not run here: needs >= 2 GPUs and CuPy): reshard against
# gather-broadcast over CuPy NCCL, one rank per GPU, every destination verified
# bit-exact, both backends on the same processes (figures are side by side).
#
#   bash benchmarks/gpu_multi.sh            # picks the layout from the GPU count
#
# NCCL refuses two ranks of one communicator on one GPU, so training + inference ranks
# must not exceed the GPUs.
set -euo pipefail
GPUS="$(python3 -c 'import torch; print(torch.cuda.device_count())')"
if [ "$GPUS" -lt 2 ]; then
    echo "gpu_multi.sh needs at least 2 GPUs (found $GPUS)" >&2
    exit 1
fi
if [ "$GPUS" -ge 8 ]; then
    TRAIN="tp=2,pp=2"; INFER="tp=2,dp=2"          # 4 + 4 ranks
elif [ "$GPUS" -ge 4 ]; then
    TRAIN="tp=2"; INFER="tp=1,dp=2"               # 2 + 2 ranks
else
    TRAIN="tp=1"; INFER="tp=1"                    # 1 + 1 rank
fi
for overlap in off on; do
    nemo-refit-reshard bench --model small-qwen3 --train "$TRAIN" --infer "$INFER" \
        --transport cupy-nccl --overlap "$overlap" --bucket-mb 64 --steps 10 "$@"
done
