"""The config.json dicts several test files share: the vLLM-tested model set
(:data:`MODELS`, built from the tiny configs of ``hf_models``) and the block-FP8 ones."""

from __future__ import annotations

from typing import Any

from tests.helpers.hf_models import hf_config

# A block-FP8 checkpoint's quantization_config, as DeepSeek-V3's and Qwen3's -FP8 ones.
BLOCK_FP8: dict[str, Any] = {
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}
# Sizes at which every TP shard below is whole 128x128 blocks.
FP8_DIMS: dict[str, int] = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=128
)
# A block-FP8 Qwen3-MoE (layer 1 dense) for the planner's FP8 runs.
FP8_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 1000,
    "torch_dtype": "bfloat16",
    "quantization_config": BLOCK_FP8,
}

_DS = dict(topk_method="noaux_tc")
# Kimi-K2's shape ratios (DeepseekV3ForCausalLM, one dense layer, one expert group,
# more experts than ranks and not a multiple of them), scaled down.
_KIMI = dict(
    topk_method="noaux_tc",
    n_routed_experts=12,
    num_experts_per_tok=4,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    num_attention_heads=8,
    num_key_value_heads=8,
    num_hidden_layers=3,
)
# The block-FP8 models are sized so that every TP shard the vLLM tests use is whole
# 128x128 blocks except the unsplit tails (DeepSeek's 192-row kv_a_proj_with_mqa: 2
# scale rows, the last one partial).
MODELS: dict[str, dict[str, Any]] = {
    "llama": hf_config("llama", num_attention_heads=8, num_key_value_heads=2),
    "qwen2": hf_config("qwen2", num_attention_heads=8, num_key_value_heads=2),
    "qwen3": hf_config("qwen3", num_hidden_layers=3),
    "qwen3_moe": hf_config("qwen3_moe"),
    "qwen3_moe_e6": hf_config("qwen3_moe", num_experts=6),
    "deepseek_v3": hf_config("deepseek_v3", **_DS),
    "deepseek_v3_no_topk_method": hf_config("deepseek_v3"),
    "deepseek_v3_no_q_lora": hf_config("deepseek_v3", q_lora_rank=None, **_DS),
    "kimi_k2": hf_config("deepseek_v3", **_KIMI),
    "qwen3_fp8": hf_config("qwen3", **FP8_DIMS, quantization_config=BLOCK_FP8),
    "qwen3_moe_fp8": hf_config(
        "qwen3_moe",
        **FP8_DIMS,
        moe_intermediate_size=256,
        # vLLM leaves a module the checkpoint names unquantized: layer 0's router stays
        # bfloat16, layer 2's is FP8 (layer 1 is dense).
        quantization_config=dict(BLOCK_FP8, modules_to_not_convert=["model.layers.0.mlp.gate"]),
    ),
    "deepseek_v3_fp8": hf_config(
        "deepseek_v3",
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        **_DS,
        quantization_config=BLOCK_FP8,
    ),
}
