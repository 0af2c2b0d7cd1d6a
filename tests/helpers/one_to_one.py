"""One training rank refitting one inference rank of the tiny float32 Llama, in several
rounds: the smallest refit the fault tests (torn weights, step identity) break."""

from __future__ import annotations

import torch

from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.checkpoints import random_tensors
from tests.helpers.hf_models import TINY_CONFIGS

SPEC = spec_from_hf_config(dict(TINY_CONFIGS["llama"], torch_dtype="float32"))
SOURCE = megatron_layout(SPEC, TrainParallel(), 0)
DEST = vllm_layout(SPEC, InferParallel(), 0)
PLAN = plan_refit(SPEC, [SOURCE], [DEST], bucket_mb=0.01)  # several rounds


def canonical(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s canonical weights (seed ``100 + step``)."""
    return random_tensors(SPEC, 100 + step)
