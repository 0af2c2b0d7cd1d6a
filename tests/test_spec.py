"""The canonical spec against transformers' own checkpoints and known model sizes."""

from __future__ import annotations

import json

import pytest

from nemo_refit_reshard.spec import load_model_spec, preset_configs, spec_from_hf_config
from tests.helpers.hf_models import (
    TINY_CONFIGS,
    checkpoint_state_dict,
    hf_config_dict,
    tiny_hf_model,
)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_spec_matches_transformers_checkpoint(family: str) -> None:
    """Names, shapes and dtypes equal what ``save_pretrained`` writes, key for key."""
    model = tiny_hf_model(family)
    on_disk = checkpoint_state_dict(model)
    spec = spec_from_hf_config(hf_config_dict(model))
    want = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in on_disk.items()}
    got = {t.name: (t.shape, t.dtype) for t in spec}
    assert got == want


def test_qwen3_moe_dense_and_sparse_layers() -> None:
    spec = spec_from_hf_config(
        dict(
            TINY_CONFIGS["qwen3_moe"],
            mlp_only_layers=[0],
            decoder_sparse_step=2,
            num_hidden_layers=4,
        )
    )
    # sparse iff not in mlp_only_layers and (i + 1) % step == 0
    assert spec.arch.moe is not None and spec.arch.moe.sparse_layers == (1, 3)
    assert "model.layers.0.mlp.gate_proj.weight" in spec
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in spec
    assert "model.layers.2.mlp.up_proj.weight" in spec


# Parameter counts the model authors publish (model cards), with the rounding they use.
KNOWN_SIZES = {
    "llama-3.1-8b": (8_030_261_248, 0.0),  # exact count on the model card
    "qwen3-0.6b": (0.6e9, 0.01),
    "qwen3-30b-a3b": (30.5e9, 0.005),
    "qwen3-235b-a22b": (235e9, 0.005),
    "deepseek-v3": (685e9, 0.005),  # 671B main model + 14B MTP module
    "kimi-k2": (1.04e12, 0.02),  # "1T total parameters"
}


@pytest.mark.parametrize("name", sorted(KNOWN_SIZES))
def test_preset_parameter_counts(name: str) -> None:
    published, rel = KNOWN_SIZES[name]
    assert load_model_spec(name).num_params == pytest.approx(published, rel=rel, abs=0)


def test_every_preset_loads() -> None:
    for name in preset_configs():
        spec = load_model_spec(name)
        assert len(spec) > 0 and spec.name == name


def test_deepseek_mtp_layer_names() -> None:
    """DeepSeek-V3's checkpoint stores its MTP module as layer 61."""
    spec = load_model_spec("deepseek-v3")
    mtp = sorted(
        t.name
        for t in spec
        if t.name.startswith("model.layers.61.")
        and ".mlp.experts." not in t.name
        and ".self_attn." not in t.name
    )
    assert mtp == [
        "model.layers.61.eh_proj.weight",
        "model.layers.61.embed_tokens.weight",
        "model.layers.61.enorm.weight",
        "model.layers.61.hnorm.weight",
        "model.layers.61.input_layernorm.weight",
        "model.layers.61.mlp.gate.e_score_correction_bias",
        "model.layers.61.mlp.gate.weight",
        "model.layers.61.mlp.shared_experts.down_proj.weight",
        "model.layers.61.mlp.shared_experts.gate_proj.weight",
        "model.layers.61.mlp.shared_experts.up_proj.weight",
        "model.layers.61.post_attention_layernorm.weight",
        "model.layers.61.shared_head.head.weight",
        "model.layers.61.shared_head.norm.weight",
    ]
    assert spec.tensor("model.layers.61.eh_proj.weight").shape == (7168, 14336)
    assert "model.layers.62.enorm.weight" not in spec


def test_config_json_path(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIGS["llama"]))
    assert (
        load_model_spec(tmp_path).num_params == load_model_spec(tmp_path / "config.json").num_params
    )


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
        ({}, "missing required key 'architectures'"),
        (
            {k: v for k, v in TINY_CONFIGS["llama"].items() if k != "intermediate_size"},
            "missing required key 'intermediate_size'",
        ),
        (
            {k: v for k, v in TINY_CONFIGS["qwen3_moe"].items() if k != "moe_intermediate_size"},
            "missing required key 'moe_intermediate_size'",
        ),
        (
            {k: v for k, v in TINY_CONFIGS["deepseek_v3"].items() if k != "kv_lora_rank"},
            "missing required key 'kv_lora_rank'",
        ),
        (
            dict(TINY_CONFIGS["llama"], num_key_value_heads=3),
            "not a multiple of num_key_value_heads=3",
        ),
        (dict(TINY_CONFIGS["llama"], hidden_size=0), "'hidden_size' must be a positive integer"),
        (dict(TINY_CONFIGS["llama"], torch_dtype="int8"), "'torch_dtype' is 'int8'"),
    ],
)
def test_bad_configs_name_the_key(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec_from_hf_config(cfg)


def test_unknown_model_name() -> None:
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        load_model_spec("nope")
