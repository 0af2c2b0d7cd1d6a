"""Hypothesis strategies and settings shared by the property tests."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


def property_settings(default_examples: int) -> settings:
    """``default_examples`` examples a test, or ``HYPOTHESIS_EXAMPLES`` (e.g. 600 for a
    deeper search locally; CI keeps the default); no deadline."""
    examples = int(os.environ.get("HYPOTHESIS_EXAMPLES", str(default_examples)))
    return settings(
        max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
    )


@st.composite
def hf_configs(draw: st.DrawFn) -> dict[str, Any]:
    family = draw(st.sampled_from(["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]))
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    cfg: dict[str, Any] = dict(
        hidden_size=draw(st.sampled_from([8, 16])),
        num_hidden_layers=draw(st.integers(1, 6)),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=draw(st.sampled_from([2, 4])),
        intermediate_size=draw(st.sampled_from([8, 16, 24])),
        vocab_size=draw(st.integers(5, 300)),
        tie_word_embeddings=draw(st.booleans()) and family != "deepseek_v3",
    )
    if family == "llama":
        cfg["architectures"] = ["LlamaForCausalLM"]
    elif family == "qwen2":
        cfg["architectures"] = ["Qwen2ForCausalLM"]
    elif family == "qwen3":
        cfg["architectures"] = ["Qwen3ForCausalLM"]
    elif family == "qwen3_moe":
        cfg.update(
            architectures=["Qwen3MoeForCausalLM"],
            num_experts=draw(st.sampled_from([2, 3, 4, 8])),
            moe_intermediate_size=draw(st.sampled_from([4, 8])),
            decoder_sparse_step=draw(st.sampled_from([1, 2])),
            mlp_only_layers=draw(st.lists(st.integers(0, 5), max_size=2, unique=True)),
        )
    else:
        cfg.update(
            architectures=["DeepseekV3ForCausalLM"],
            num_key_value_heads=heads,
            n_routed_experts=draw(st.sampled_from([2, 4, 8])),
            n_shared_experts=draw(st.sampled_from([0, 1, 2])),
            moe_intermediate_size=draw(st.sampled_from([4, 8])),
            first_k_dense_replace=draw(st.integers(0, 2)),
            q_lora_rank=draw(st.sampled_from([None, 8])),
            kv_lora_rank=8,
            qk_nope_head_dim=4,
            qk_rope_head_dim=draw(st.sampled_from([2, 4])),
            v_head_dim=4,
            num_nextn_predict_layers=draw(st.sampled_from([0, 1])),
        )
    return cfg
