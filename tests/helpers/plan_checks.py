"""Shared check: a plan delivers every destination element exactly once, bit-exact."""

from __future__ import annotations

import torch

from nemo_refit_reshard.engine.materialize import empty_like_layout, materialize, mismatches
from nemo_refit_reshard.engine.simulate import simulate_plan
from nemo_refit_reshard.plan import verify_plan


def assert_delivers_exactly(plan, spec, sources, destinations, seed: int = 0):
    """``verify_plan``, then one in-process refit of random weights: every destination
    element equals its canonical value and padding stays untouched (NaN). Returns the
    source and destination tensors and the canonical weights."""
    verify_plan(plan, sources, destinations)
    g = torch.Generator().manual_seed(seed)
    canonical = {t.name: torch.randn(t.shape, generator=g) for t in spec}
    src = [materialize(lay, canonical) for lay in sources]
    dst = [empty_like_layout(lay) for lay in destinations]
    simulate_plan(plan, src, dst)
    for lay, tensors in zip(destinations, dst):
        assert mismatches(lay, tensors, canonical) == [], lay.rank
        for t in lay.tensors:  # padding is never written: it stays NaN
            for pad in t.padding:
                assert torch.isnan(tensors[t.name][pad.slices()]).all()
    return src, dst, canonical


def casting_moe_plan(bucket_mb: float = 0.05):
    """``(plan, spec, sources, destinations)``: Qwen3-MoE (tiny), fp32 Megatron ranks
    (tp=2, ep=2) into bf16 vLLM ranks (tp=2, dp=2) — casts on the wire, several rounds;
    the GPU tests' plan (test_gpu.py on a GPU, test_fake_cuda.py on fake CUDA)."""
    from nemo_refit_reshard.layouts import VllmOptions, megatron_layout, vllm_layout
    from nemo_refit_reshard.plan import plan_refit
    from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
    from tests.helpers.hf_models import TINY_CONFIGS

    spec = spec_from_hf_config(dict(TINY_CONFIGS["qwen3_moe"], torch_dtype="float32"))
    tpar, ipar = TrainParallel(tp=2, ep=2, etp=1), InferParallel(tp=2, dp=2)
    src = [megatron_layout(spec, tpar, r) for r in range(tpar.world_size)]
    dst = [
        vllm_layout(spec, ipar, r, VllmOptions(params_dtype="bfloat16"))
        for r in range(ipar.world_size)
    ]
    return plan_refit(spec, src, dst, bucket_mb=bucket_mb), spec, src, dst
