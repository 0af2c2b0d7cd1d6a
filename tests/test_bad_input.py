"""Impossible parallelism is a ValueError naming the parameter and the rule.

All of these are raised by pure functions, before any process group exists.
"""

from __future__ import annotations

import re

import pytest

from nemo_refit_reshard.layouts import (
    MegatronOptions,
    dtensor_layout,
    fsdp2_placements,
    megatron_layout,
    vllm_layout,
)
from nemo_refit_reshard.layouts.dtensor import Shard
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.hf_models import TINY_CONFIGS

LLAMA = spec_from_hf_config(TINY_CONFIGS["llama"])  # 4 heads, 2 KV heads, vocab 100, F 96
MOE = spec_from_hf_config(TINY_CONFIGS["qwen3_moe"])  # 4 experts, moe_intermediate 32
MLA = spec_from_hf_config(TINY_CONFIGS["deepseek_v3"])


def _raises(message: str):
    return pytest.raises(ValueError, match=re.escape(message))


@pytest.mark.parametrize(
    ("spec", "par", "message"),
    [
        (LLAMA, TrainParallel(tp=3), "tp=3 must divide num_attention_heads=4"),
        (LLAMA, TrainParallel(tp=8), "tp=8 must divide num_attention_heads=4"),
        (
            spec_from_hf_config(
                dict(
                    TINY_CONFIGS["llama"], num_attention_heads=12, num_key_value_heads=3, head_dim=4
                )
            ),
            TrainParallel(tp=2),
            "tp=2 must divide num_key_value_heads=3",
        ),
        (
            spec_from_hf_config(dict(TINY_CONFIGS["llama"], intermediate_size=90)),
            TrainParallel(tp=4),
            "tp=4 must divide intermediate_size=90",
        ),
        (MOE, TrainParallel(ep=8, dp=8), "ep=8 must divide num_experts=4"),
        (MOE, TrainParallel(ep=3, dp=3), "ep=3 must divide num_experts=4"),
        (
            spec_from_hf_config(dict(TINY_CONFIGS["qwen3_moe"], moe_intermediate_size=30)),
            TrainParallel(tp=4, ep=1),
            "etp=4 must divide moe_intermediate_size=30",
        ),
        (LLAMA, TrainParallel(ep=2, dp=2), "ep=2/etp=1 given for llama, which has no experts"),
        (MLA, TrainParallel(tp=3, dp=1), "tp=3 must divide num_attention_heads=4"),
        (
            spec_from_hf_config(dict(TINY_CONFIGS["deepseek_v3"], kv_lora_rank=6)),
            TrainParallel(tp=4),
            "tp=4 must divide kv_lora_rank + qk_rope_head_dim=10",
        ),
        (LLAMA, TrainParallel(pp=3), "num_layers=2 is not divisible by pp=3"),
    ],
)
def test_megatron_rules(spec, par, message) -> None:
    with _raises(message):
        megatron_layout(spec, par, 0)


def test_megatron_te_spec_replicates_mla_down_projections() -> None:
    spec = spec_from_hf_config(dict(TINY_CONFIGS["deepseek_v3"], kv_lora_rank=6))
    layout = megatron_layout(spec, TrainParallel(tp=4), 1, MegatronOptions(layer_spec="te"))
    t = layout.tensor("decoder.layers.0.self_attention.linear_kv_down_proj.weight")
    assert t.shape == (10, 32)


def test_megatron_rank_out_of_range() -> None:
    with _raises("rank 4 outside the training world of 4"):
        megatron_layout(LLAMA, TrainParallel(tp=2, dp=2), 4)


@pytest.mark.parametrize(
    ("spec", "par", "message"),
    [
        (LLAMA, InferParallel(tp=3), "tp=3 must divide num_attention_heads=4"),
        (
            spec_from_hf_config(
                dict(
                    TINY_CONFIGS["llama"],
                    num_attention_heads=6,
                    num_key_value_heads=3,
                    head_dim=4,
                    intermediate_size=96,
                )
            ),
            InferParallel(tp=3),
            "tp=3 must divide the padded vocabulary 128",
        ),
        (
            spec_from_hf_config(
                dict(
                    TINY_CONFIGS["llama"], num_attention_heads=12, num_key_value_heads=3, head_dim=4
                )
            ),
            InferParallel(tp=2),
            "tp=2 and num_key_value_heads=3: one must divide the other",
        ),
        (MOE, InferParallel(tp=4, engine_dp=2, ep=8), "ep=8 exceeds num_experts=4"),
        (
            spec_from_hf_config(dict(TINY_CONFIGS["qwen3_moe"], moe_intermediate_size=30)),
            InferParallel(tp=2, engine_dp=2),
            "engine_dp·tp=4 must divide moe_intermediate_size=30",
        ),
        (LLAMA, InferParallel(tp=2, ep=2), "ep=2 given for llama, which has no experts"),
        (LLAMA, InferParallel(pp=3), "pp=3 exceeds num_hidden_layers=2"),
    ],
)
def test_vllm_rules(spec, par, message) -> None:
    with _raises(message):
        vllm_layout(spec, par, 0)


def test_dtensor_rules() -> None:
    with _raises("2 placements for a 1-D mesh"):
        dtensor_layout(LLAMA, (2,), 0, lambda t: (Shard(0), Shard(0)))
    with _raises("names dim 1 of a 1-D tensor"):
        dtensor_layout(LLAMA, (2,), 0, lambda t: (Shard(1),))
    with _raises("rank 2 outside the mesh (2,)"):
        dtensor_layout(LLAMA, (2,), 2, fsdp2_placements((2,)))
