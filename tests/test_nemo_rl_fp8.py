"""NeMo RL's FP8 generation (``policy.generation.vllm_cfg.precision: fp8``) through the
NeMo RL driver's planning (``plan_nemo_rl``, as ``ReshardWeightSynchronizer`` calls it),
then that plan replayed on the CPU twin.

The workers' reports are built here from the layouts (the real reports come from NeMo
RL's workers in tests/test_nemo_rl_reshard.py, which needs NeMo RL's source; vLLM's FP8
parameters are checked against vLLM's own classes in tests/test_vllm_truth.py). What
this checks is the route: the FP8 engine NeMo RL starts is what gets planned, Megatron's
whole-block shards cross as e4m3 + scales, and every vLLM rank's e4m3 weights and
scales come out bit-equal to the trained weights quantized whole.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from nemo_refit_reshard.engine.materialize import SyntheticWeights, materialize, mismatches
from nemo_refit_reshard.engine.quantize import QuantizedWeights
from nemo_refit_reshard.engine.simulate import simulate_plan
from nemo_refit_reshard.integrations.nemo_rl.config import RefitConfig
from nemo_refit_reshard.integrations.nemo_rl.fp8 import fp8_spec
from nemo_refit_reshard.integrations.nemo_rl.plans import plan_nemo_rl
from nemo_refit_reshard.integrations.worker import describe_tensors
from nemo_refit_reshard.layouts import (
    DEFAULT_VLLM_VERSION,
    MegatronOptions,
    VllmOptions,
    megatron_layouts,
    megatron_position,
    vllm_layouts,
)
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec
from tests.helpers.model_configs import FP8_MOE

TRAIN, INFER = TrainParallel(tp=2, etp=1), InferParallel(tp=2, dp=2)
VLLM_CFG = {
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 1,
    "expert_parallel_size": 1,
    "precision": "fp8",
    "use_deep_gemm": False,
    "num_first_layers_in_bf16": 0,
    "num_last_layers_in_bf16": 0,
}


def _master(model: str) -> dict:
    return {
        "policy": {
            "model_name": model,
            "megatron_cfg": {
                "enabled": True,
                "tensor_model_parallel_size": 2,
                "expert_tensor_parallel_size": 1,
            },
            "generation": {
                "backend": "vllm",
                "colocated": {"enabled": False},
                "vllm_cfg": VLLM_CFG,
            },
        }
    }


def _meta(layout, dtype_of=lambda t: t.dtype):
    return {t.name: torch.empty(t.shape, dtype=getattr(torch, dtype_of(t)), device="meta")
            for t in layout.tensors}  # fmt: skip


def test_fp8_generation_through_the_nemo_rl_planning(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in FP8_MOE.items() if k != "quantization_config"}))
    trained = load_model_spec(str(path))
    opts = MegatronOptions(params_dtype="bfloat16")
    sources = megatron_layouts(trained, TRAIN, opts)
    sizes = {"tp": 2, "pp": 1, "vpp": 1, "cp": 1, "dp": 1, "ep": 1, "etp": 1}
    policy = [
        {
            "rank": r,
            "options": {"params_dtype": "bfloat16"},
            "position": {
                **megatron_position(TRAIN, r).as_dict(),
                **{f"{k}_size": v for k, v in sizes.items()},
            },
            "tensors": describe_tensors(_meta(lay)),
        }
        for r, lay in enumerate(sources)
    ]
    engine = fp8_spec(trained, VLLM_CFG)  # what NeMo RL's init_fp8 makes vLLM build
    live = vllm_layouts(engine, INFER, VllmOptions(vllm_version=DEFAULT_VLLM_VERSION))
    engines = [
        [
            {
                "engine_rank": k,
                "parallel": str(replace(INFER, dp=1)),
                "vllm_version": DEFAULT_VLLM_VERSION,
                "all2all_backend": None,
                "tensors": describe_tensors(_meta(live[2 * e + k])),
            }
            for k in range(2)
        ]
        for e in range(2)
    ]
    planned = plan_nemo_rl(_master(str(path)), RefitConfig(backend="reshard"), policy, engines)
    plan = planned.plan
    for d, lay in enumerate(live):  # the plan writes every parameter NeMo RL's engine holds
        want = {t.name: (t.shape, t.dtype) for t in lay.tensors}
        assert plan.expected_tensors(2 + d) == want
    by_dtype = dict(plan.stats.bytes_by_dtype)
    assert by_dtype["float8_e4m3fn"] > by_dtype["bfloat16"] > 0
    assert all(plan.quantize_steps_of(r) for r in range(2))  # both Megatron ranks quantize
    weights = SyntheticWeights(trained, seed=5)
    src = [materialize(lay, weights) for lay in sources]
    fp8 = {t.name for t in engine if t.dtype == "float8_e4m3fn"}
    truth = QuantizedWeights(weights, fp8, (128, 128))
    dst = [materialize(lay, truth, fill=float("nan")) for lay in live]
    simulate_plan(plan, src, dst)
    for lay, tensors in zip(live, dst, strict=True):
        assert mismatches(lay, tensors, truth) == [], lay.rank
