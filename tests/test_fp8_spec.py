"""Block-FP8 checkpoints in the spec and the vLLM provider (``spec/quantization.py``,
``layouts/vllm_fp8.py``), without vLLM: the tensors a ``quantization_config`` adds, the
configs refused by name, and the training side built from the model as trained. The layouts
against vLLM's own FP8 classes are in tests/test_vllm_truth.py."""

from __future__ import annotations

from typing import Any

import pytest

from nemo_refit_reshard.layouts import Box, VllmOptions, megatron_layout, vllm_layout
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from nemo_refit_reshard.spec.model import preset_configs
from tests.helpers.model_configs import BLOCK_FP8


def config(preset: str, **quant: Any) -> dict[str, Any]:
    return dict(preset_configs()[preset], quantization_config=dict(BLOCK_FP8, **quant))


def test_deepseek_v3_fp8_checkpoint_tensors() -> None:
    """DeepSeek-V3's FP8 checkpoint: every decoder linear e4m3 with a float32
    [ceil(out/128), ceil(in/128)] scale after it; embeddings, norms, the router and
    lm_head in bfloat16, the router bias float32."""
    spec = spec_from_hf_config(config("deepseek-v3"))
    t = {x.name: (x.shape, x.dtype) for x in spec}
    p = "model.layers.0.self_attn"
    assert t[f"{p}.q_a_proj.weight"] == ((1536, 7168), "float8_e4m3fn")
    assert t[f"{p}.q_a_proj.weight_scale_inv"] == ((12, 56), "float32")
    assert t[f"{p}.kv_a_proj_with_mqa.weight_scale_inv"] == ((5, 56), "float32")  # 576 rows
    assert t[f"{p}.kv_b_proj.weight_scale_inv"] == ((256, 4), "float32")
    e = "model.layers.3.mlp.experts.7"
    assert t[f"{e}.down_proj.weight"] == ((7168, 2048), "float8_e4m3fn")
    assert t[f"{e}.down_proj.weight_scale_inv"] == ((56, 16), "float32")
    assert t["model.layers.3.mlp.gate.weight"] == ((256, 7168), "bfloat16")
    assert t["model.layers.3.mlp.gate.e_score_correction_bias"] == ((256,), "float32")
    assert t["model.embed_tokens.weight"][1] == t["lm_head.weight"][1] == "bfloat16"
    unquantized = spec_from_hf_config(preset_configs()["deepseek-v3"])
    scales = [x for x in spec if x.name.endswith("weight_scale_inv")]
    assert len(spec) == len(unquantized) + len(scales)


def test_ignored_modules_stay_unquantized() -> None:
    spec = spec_from_hf_config(
        config("qwen3-30b-a3b", modules_to_not_convert=["model.layers.0.mlp.gate"])
    )
    assert spec.tensor("model.layers.0.mlp.gate.weight").dtype == "bfloat16"
    assert "model.layers.0.mlp.gate.weight_scale_inv" not in spec
    assert spec.tensor("model.layers.1.mlp.gate.weight").dtype == "float8_e4m3fn"


@pytest.mark.parametrize(
    "quant, message",
    [
        (
            {"quant_method": "awq"},
            "quantization_config.quant_method='awq' is not modeled: nemo-refit-reshard plans "
            "unquantized engines and block-quantized FP8 (quant_method 'fp8' with "
            "weight_block_size); serve this model unquantized or open an issue",
        ),
        (
            {"quant_method": "fp8"},
            "quantization_config: fp8 without weight_block_size (per-tensor scales) is not "
            "modeled; only block-quantized FP8 (e.g. weight_block_size [128, 128]) is",
        ),
        (
            dict(BLOCK_FP8, activation_scheme="static"),
            "quantization_config.activation_scheme='static': block-wise FP8 supports the "
            "dynamic activation scheme only (vLLM refuses it too)",
        ),
        (
            dict(BLOCK_FP8, ignored_layers=["model.layers.0.self_attn.k_proj"]),
            "quantization_config ignores model.layers.0.self_attn.k_proj but not "
            "['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.v_proj']: vLLM "
            "fuses them into one parameter, quantized or not as a whole",
        ),
    ],
    ids=["awq", "per-tensor", "static", "half-fused"],
)
def test_unmodeled_quantization_is_refused_by_name(quant: dict, message: str) -> None:
    cfg = dict(preset_configs()["qwen3-8b"], quantization_config=quant)
    with pytest.raises(ValueError) as err:
        spec_from_hf_config(cfg)
    assert str(err.value) == message


def test_training_side_holds_the_trained_weights() -> None:
    """Megatron's layout of an FP8 model is its layout of the model as trained (BF16, no
    scales): the spec's quantization is the engine's, never the trainer's."""
    spec = spec_from_hf_config(config("qwen3-8b"))
    unquantized = spec_from_hf_config(preset_configs()["qwen3-8b"])
    assert spec.unquantized().tensors == unquantized.tensors
    assert megatron_layout(spec, TrainParallel(tp=2), 1) == megatron_layout(
        unquantized, TrainParallel(tp=2), 1
    )


def test_vllm_fp8_layout_qwen3_30b_a3b() -> None:
    """vLLM rank 5 of tp=4 x engine_dp=2 with expert parallel 8: its scales are the
    block slices of the canonical ones (q rows 8..16 of 32, k/v row 1 of 4, o_proj
    columns 8..16, 16 local experts' full scales)."""
    spec = spec_from_hf_config(config("qwen3-30b-a3b"))
    lay = vllm_layout(
        spec, InferParallel(tp=4, engine_dp=2, ep=8), 5, VllmOptions(vllm_version="0.33.0")
    )
    t = {x.name: x for x in lay.tensors}
    p = "model.layers.0.self_attn"
    qkv = t[f"{p}.qkv_proj.weight_scale_inv"]
    assert (qkv.shape, qkv.dtype) == ((10, 16), "float32")
    assert [(x.canonical, x.canonical_box, x.local_box) for x in qkv.pieces] == [
        (f"{p}.q_proj.weight_scale_inv", Box((8, 0), (8, 16)), Box((0, 0), (8, 16))),
        (f"{p}.k_proj.weight_scale_inv", Box((1, 0), (1, 16)), Box((8, 0), (1, 16))),
        (f"{p}.v_proj.weight_scale_inv", Box((1, 0), (1, 16)), Box((9, 0), (1, 16))),
    ]
    o = t[f"{p}.o_proj.weight_scale_inv"].pieces[0]
    assert (o.canonical_box, o.local_box) == (Box((0, 8), (16, 8)), Box((0, 0), (16, 8)))
    w13 = t["model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv"]
    assert (w13.shape, w13.pieces[0].canonical) == (
        (16, 12, 16),
        "model.layers.0.mlp.experts.80.gate_proj.weight_scale_inv",
    )


def test_vllm_refuses_an_fp8_layout_it_cannot_slice() -> None:
    """Qwen3-30B-A3B's experts at MoE-TP 4 have 192 rows per rank: vLLM refines the scale
    grid to 64x64 and upsamples the checkpoint's scales — not a slice, refused."""
    spec = spec_from_hf_config(config("qwen3-30b-a3b"))
    with pytest.raises(ValueError) as err:
        vllm_layout(spec, InferParallel(tp=4), 0, VllmOptions(vllm_version="0.33.0"))
    assert str(err.value).startswith(
        "model.layers.0.mlp.experts.routed_experts: 192 intermediate rows per rank is not a "
        "multiple of the FP8 block 128: vLLM 0.33 then refines"
    )
