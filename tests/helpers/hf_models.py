"""Tiny random HuggingFace models shared by the tests (float32, seeded)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import torch

from nemo_refit_reshard.spec import ModelSpec

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
    "deepseek_v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=0,
        max_position_embeddings=64,
    ),
}


@dataclasses.dataclass(frozen=True)
class HfModel:
    """A HF model with its config.json dict, its spec and its canonical checkpoint tensors."""

    hf: torch.nn.Module
    cfg: dict[str, Any]
    spec: ModelSpec
    canonical: dict[str, torch.Tensor]


_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def tiny_hf_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A seeded float32 random model of ``family`` in eval mode."""
    import transformers

    cfg_name, model_name = _CLASSES[family]
    kwargs = {k: v for k, v in TINY_CONFIGS[family].items() if k != "architectures"}
    kwargs.update(overrides)
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    return model


def hf_config(family: str, **overrides: Any) -> dict[str, Any]:
    """``family``'s tiny config as a full config.json dict (transformers' defaults filled
    in, ``architectures`` kept), ``overrides`` applied."""
    import transformers

    kwargs = {k: v for k, v in TINY_CONFIGS[family].items() if k != "architectures"}
    kwargs.update(overrides)
    cfg = getattr(transformers, _CLASSES[family][0])(**kwargs).to_dict()
    cfg["architectures"] = TINY_CONFIGS[family]["architectures"]
    return cfg


def random_hf_model(family: str, seed: int, **overrides: Any) -> torch.nn.Module:
    """A tiny HF model with every weight random (norm weights around 1), seeded."""
    model = tiny_hf_model(family, seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else 0.15 * noise)
    return model


def checkpoint_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors as ``save_pretrained`` writes them (on-disk names, per-expert keys)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return load_file(os.path.join(tmp, "model.safetensors"))


def hf_config_dict(model: torch.nn.Module) -> dict[str, Any]:
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    return cfg


def unit_scale_weights(model: torch.nn.Module) -> None:
    """Non-trivial norms and biases (HF initialises them to 1 and 0) and unit-scale
    signals, in place, from the current torch RNG: forward-pass truth tests then
    see every weight matter."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.5 * noise)
            else:
                param.copy_(noise * param.shape[-1] ** -0.5)
