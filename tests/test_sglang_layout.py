"""The SGLang provider without SGLang: what it refuses (exact messages), the shared-expert
fusion default, DeepSeek-V3 / Kimi-K2 at their real sizes, expert parallelism, pipeline
stages (SGLang's split, which stage holds embed/norm/lm_head, replicas) and the
derived-weight list. ``tests/test_sglang_truth.py`` proves the layouts against SGLang's
own classes."""

from __future__ import annotations

import re

import pytest

from nemo_refit_reshard.layouts.sglang import (
    check_sglang_parallel,
    sglang_derived_tensors,
    sglang_fuses_shared_experts,
    sglang_layout,
)
from nemo_refit_reshard.layouts.sglang_grid import sglang_pp_indices
from nemo_refit_reshard.layouts.vllm_grid import vllm_pp_indices
from nemo_refit_reshard.spec import InferParallel, ModelSpec, load_model_spec, spec_from_hf_config
from tests.helpers.model_configs import BLOCK_FP8, MODELS

P = InferParallel
SPARSE = {**MODELS["qwen3_moe"], "mlp_only_layers": []}
CONFIGS = {
    **MODELS,
    "qwen3_moe_sparse": SPARSE,
    "llama_tied": {**MODELS["llama"], "tie_word_embeddings": True},
    "qwen3_moe_tied": {**SPARSE, "tie_word_embeddings": True},
    "deepseek_v3_tied": {**MODELS["deepseek_v3"], "tie_word_embeddings": True},
    "qwen3_moe_fp8_sparse": {
        **MODELS["qwen3_moe_fp8"],
        "mlp_only_layers": [],
        "quantization_config": dict(
            BLOCK_FP8, modules_to_not_convert=[f"model.layers.{i}.mlp.gate" for i in range(3)]
        ),
    },
    "qwen3_fp8_i256": {**MODELS["qwen3_fp8"], "intermediate_size": 256},
    # Llama's FP8 engine: SGLang serves it, its layout is not proven here
    "llama_fp8": {
        **MODELS["llama"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "head_dim": 64,
        "quantization_config": BLOCK_FP8,
    },
}


def _spec(model: str) -> ModelSpec:
    return spec_from_hf_config(CONFIGS[model], name=model)


@pytest.mark.parametrize(
    "model, par, fusion, message",
    [
        (
            "qwen3_moe",
            P(tp=2),
            None,
            "qwen3_moe has dense MLP layers [1] (mlp_only_layers / decoder_sparse_step): "
            "SGLang 0.5.23 builds experts in every Qwen3-MoE layer, so its parameters would "
            "not match the checkpoint there",
        ),
        ("qwen3_moe_sparse", P(tp=8), None, "tp=8 exceeds num_experts=4 (SGLang's rule)"),
        (
            "llama_fp8",
            P(tp=2),
            None,
            "SGLang FP8 layouts cover qwen3, qwen3_moe, deepseek_v3 so far; llama_fp8 is "
            "family 'llama': serve BF16 weights or use the vLLM engine",
        ),
        (
            "qwen3_moe_fp8",
            P(tp=2),
            None,
            "qwen3_moe_fp8 quantizes the router gate of layers [2]: SGLang 0.5.23's Qwen3-MoE "
            "builds mlp.gate unquantized under fp8 (models/qwen3_moe.py, gate_quant_config), "
            "so it cannot hold that checkpoint; list each model.layers.N.mlp.gate in "
            "modules_to_not_convert",
        ),
        (
            "qwen3_moe_fp8_sparse",
            P(tp=4),
            None,
            "64 expert intermediate rows per rank is not a multiple of the FP8 block 128 "
            "(SGLang's Fp8MoEMethod refuses it); use ep=4 or a smaller tp",
        ),
        (
            "llama",
            P(tp=2, engine_dp=2),
            None,
            "--tp-size 4 --dp-size 2 --enable-dp-attention (engine_dp=2) is not covered for "
            "llama: SGLang 0.5.23's llama attention is split over the whole tp group, not the "
            "attention tp group (its dp attention covers qwen3, qwen3_moe and deepseek_v3 "
            "here); use engine_dp=1",
        ),
        (
            "qwen3",
            P(pp=2, engine_dp=2),
            None,
            "--tp-size 2 --dp-size 2 --enable-dp-attention (engine_dp=2) with pp=2 is not "
            "covered: SGLang numbers such an engine pp_rank·tp_size + tp_rank, not the "
            "engine_dp-major order of engine_dp; use pp=1",
        ),
        (
            "deepseek_v3_tied",
            P(engine_dp=2),
            None,
            "--tp-size 2 --dp-size 2 --enable-dp-attention (engine_dp=2) is not covered for "
            "deepseek_v3_tied, which ties its word embeddings (deepseek_v3): untie them or "
            "use engine_dp=1",
        ),
        (
            "qwen3_moe_tied",
            P(),
            None,
            "qwen3_moe_tied ties its word embeddings, but SGLang 0.5.23's qwen3_moe model never "
            "ties lm_head to embed_tokens and loads it only from lm_head.weight, which a tied "
            "checkpoint lacks: its lm_head would hold no checkpoint tensor; untie the embeddings "
            "(save lm_head.weight) or serve the model with vLLM",
        ),
        (
            "qwen3",
            P(engine_dp=64),
            None,
            "engine_dp·tp=64 must divide intermediate_size=96 (SGLang's rule)",
        ),
        (
            "qwen3_moe_sparse",
            P(tp=4, engine_dp=2),
            None,
            "engine_dp·tp=8 exceeds num_experts=4 (SGLang's rule)",
        ),
        ("qwen3", P(pp=4), None, "pp=4 exceeds num_hidden_layers=3 (SGLang's rule)"),
        (
            "llama_tied",
            P(pp=2),
            None,
            "llama_tied ties its word embeddings: under pp=2 SGLang 0.5.23's llama model ties "
            "lm_head to embed_tokens, which only the first stage builds, so its lm_head would "
            "not be the checkpoint's; use pp=1",
        ),
        (
            "qwen3_moe_tied",
            P(pp=2),
            None,
            "qwen3_moe_tied ties its word embeddings: under pp=2 SGLang 0.5.23's qwen3_moe "
            "model loads every stage's lm_head from lm_head.weight only, so its lm_head would "
            "not be the checkpoint's; use pp=1",
        ),
        (
            "deepseek_v3_tied",
            P(pp=2),
            None,
            "deepseek_v3_tied ties its word embeddings: under pp=2 SGLang 0.5.23's "
            "deepseek_v3 model loads the last stage's lm_head from lm_head.weight only, so "
            "its lm_head would not be the checkpoint's; use pp=1",
        ),
        (
            "kimi_k2",
            P(tp=8, ep=8),
            None,
            "ep=8 must divide num_experts=12 (SGLang's rule: its FusedMoE gives every "
            "expert-parallel rank num_experts/ep experts); use ep=1",
        ),
        (
            "deepseek_v3",
            P(tp=2, ep=2),
            True,
            "shared-expert fusion with ep=2 is not covered (SGLang fuses under expert "
            "parallelism only on AMD GPUs): use shared_experts_fusion=False "
            "(--disable-shared-experts-fusion) or ep=1",
        ),
        ("llama", P(tp=2, ep=2), None, "ep=2 given for llama, which has no experts"),
        ("llama", P(tp=3), None, "tp=3 must divide num_attention_heads=8 (SGLang's rule)"),
        (
            "llama",
            P(tp=16),
            None,
            "tp=16 must divide num_attention_heads=8 (SGLang's rule)",
        ),
    ],
)
def test_what_is_not_proven_is_refused_by_name(
    model: str, par: InferParallel, fusion: bool | None, message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_sglang_parallel(_spec(model), par, fusion)


def test_fp8_shards_off_the_block_are_refused_with_sglangs_rule() -> None:
    """128 gate rows per rank at tp=2 are whole blocks; 64 at tp=4 are not, which SGLang's
    Fp8LinearMethod.validate_block_quant_shapes refuses (a merged gate_up_proj)."""
    sglang_layout(_spec("qwen3_fp8_i256"), P(tp=2), 0)
    with pytest.raises(ValueError) as err:
        sglang_layout(_spec("qwen3_fp8_i256"), P(tp=4), 0)
    assert str(err.value) == (
        "model.layers.0.mlp.gate_up_proj.weight: gate rows per rank 64 is not a multiple of "
        "the FP8 block 128; SGLang 0.5.23 cannot hold this checkpoint at this "
        "tensor-parallel size (Fp8LinearMethod.validate_block_quant_shapes; choose one "
        "whose shards are whole blocks)"
    )


def test_fp8_qwen3_moe_names_sglangs_scales() -> None:
    """e4m3 weights with float32 weight_scale_inv per 128x128 block; the router gate,
    embeddings, norms and lm_head unquantized (SGLang's names; contents proven in
    tests/test_sglang_truth.py)."""
    layout = sglang_layout(_spec("qwen3_moe_fp8_sparse"), P(tp=2, ep=2), 1)
    got = {t.name: (t.shape, t.dtype) for t in layout.tensors}
    p = "model.layers.2.mlp."
    assert got[p + "experts.w13_weight"] == ((2, 512, 256), "float8_e4m3fn")
    assert got[p + "experts.w13_weight_scale_inv"] == ((2, 4, 2), "float32")
    assert got[p + "experts.w2_weight_scale_inv"] == ((2, 2, 2), "float32")
    assert got[p + "gate.weight"][1] == got["lm_head.weight"][1] == "bfloat16"
    assert got["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == ((4, 2), "float32")
    assert not any(n.endswith("input_scale") for n in got)  # dynamic activation scales


def test_qwen_at_a_tp_sglang_refuses_says_sglangs_rule() -> None:
    with pytest.raises(ValueError) as err:
        sglang_layout(load_model_spec("qwen2.5-7b"), P(tp=8), 0)
    assert str(err.value) == "tp=8 must divide num_attention_heads=28 (SGLang's rule)"


def test_shared_expert_fusion_default_is_sglangs_cuda_rule() -> None:
    ds, kimi = load_model_spec("deepseek-v3"), load_model_spec("kimi-k2")
    assert sglang_fuses_shared_experts(ds, P(tp=8))  # 256 routed + 1 shared
    assert not sglang_fuses_shared_experts(ds, P(tp=8, ep=8))  # NVIDIA: not under ep
    assert not sglang_fuses_shared_experts(kimi, P(tp=8))  # 384 experts (not Quark)
    assert not sglang_fuses_shared_experts(_spec("deepseek_v3"), P(tp=2))  # 4 experts


def _mlp(layout, layer: int) -> dict[str, tuple[int, ...]]:
    prefix = f"model.layers.{layer}.mlp."
    return {t.name[len(prefix) :]: t.shape for t in layout.tensors if t.name.startswith(prefix)}


def test_deepseek_v3_at_tp8_fuses_the_shared_expert_as_expert_256() -> None:
    layout = sglang_layout(load_model_spec("deepseek-v3"), P(tp=8), 3)
    assert _mlp(layout, 5) == {
        "gate.weight": (256, 7168),
        "gate.e_score_correction_bias": (256,),
        "experts.w13_weight": (257, 512, 7168),
        "experts.w2_weight": (257, 7168, 256),
    }
    w2 = layout.tensor("model.layers.5.mlp.experts.w2_weight")
    last = [p for p in w2.pieces if p.local_box.offsets[0] == 256]
    assert [p.canonical for p in last] == ["model.layers.5.mlp.shared_experts.down_proj.weight"]
    assert last[0].canonical_box.offsets == (0, 3 * 256)  # rank 3's columns
    assert _mlp(layout, 0) == {
        "gate_up_proj.weight": (4608, 7168),
        "down_proj.weight": (7168, 2304),
    }
    names = {t.name for t in layout.tensors}
    assert "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight" in names
    assert not any("layers.61." in n for n in names)  # the MTP layer: a separate draft model


def test_deepseek_v3_with_expert_parallel_holds_whole_experts_and_shared_over_tp() -> None:
    layout = sglang_layout(load_model_spec("deepseek-v3"), P(tp=8, ep=8), 3)
    assert _mlp(layout, 5)["experts.w13_weight"] == (32, 4096, 7168)
    assert _mlp(layout, 5)["shared_experts.gate_up_proj.weight"] == (512, 7168)
    w2 = layout.tensor("model.layers.5.mlp.experts.w2_weight")
    assert {p.canonical.split(".")[5] for p in w2.pieces} == {str(e) for e in range(96, 128)}


def test_kimi_k2_keeps_shared_experts_and_derives_w_kc_w_vc() -> None:
    spec = load_model_spec("kimi-k2")
    layout = sglang_layout(spec, P(tp=8), 0)
    assert _mlp(layout, 1)["experts.w13_weight"] == (384, 512, 7168)
    assert _mlp(layout, 1)["shared_experts.down_proj.weight"] == (7168, 256)
    derived = sglang_derived_tensors(spec, P(tp=8))
    assert len(derived) == 2 * spec.arch.num_layers
    assert derived["model.layers.0.self_attn.w_kc"] == (8, 128, 512)  # 64 heads / 8
    assert derived["model.layers.0.self_attn.w_vc"] == (8, 512, 128)
    assert not set(derived) & {t.name for t in layout.tensors}
    assert sglang_derived_tensors(_spec("qwen3"), P(tp=2)) == {}


def test_a_partition_that_does_not_fit_is_refused_by_name() -> None:
    with pytest.raises(ValueError) as err:
        sglang_layout(_spec("qwen3"), P(pp=2), 0, pp_layer_partition=(1, 1))
    assert str(err.value) == (
        "pp layer partition [1, 1] must have pp=2 entries summing to num_hidden_layers=3 "
        "(SGLANG_PP_LAYER_PARTITION, SGLang's rule)"
    )


def test_sglangs_pipeline_split_gives_the_extra_layers_to_the_last_stages() -> None:
    # 61 layers (DeepSeek-V3) over 4 stages: SGLang 15, 15, 15, 16; vLLM 15, 15, 16, 15
    assert [sglang_pp_indices(61, k, 4) for k in range(4)] == [
        (0, 15),
        (15, 30),
        (30, 45),
        (45, 61),
    ]
    assert [vllm_pp_indices(61, k, 4) for k in range(4)] == [
        (0, 15),
        (15, 30),
        (30, 46),
        (46, 61),
    ]
    assert [sglang_pp_indices(10, k, 4) for k in range(4)] == [(0, 2), (2, 4), (4, 7), (7, 10)]
    assert [sglang_pp_indices(4, k, 2, (1, 3)) for k in range(2)] == [(0, 1), (1, 4)]
    assert sglang_pp_indices(4, 0, 1, (9,)) == (0, 4)  # one stage ignores the partition


def _outside_layers(layout) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in layout.tensors if not t.name.startswith("model.layers.")}


def _layers(layout) -> list[int]:
    return sorted({int(t.name.split(".")[2]) for t in layout.tensors if ".layers." in t.name})


def test_deepseek_v3_over_four_stages_and_two_replicas() -> None:
    spec, par = load_model_spec("deepseek-v3"), P(tp=8, pp=4, dp=2)
    first, last = sglang_layout(spec, par, 0), sglang_layout(spec, par, 3 * 8 + 5)
    assert _layers(first) == list(range(15)) and _layers(last) == list(range(45, 61))
    assert _outside_layers(first) == {"model.embed_tokens.weight": (16160, 7168)}
    assert _outside_layers(last) == {"model.norm.weight": (7168,), "lm_head.weight": (16160, 7168)}
    assert last.position == dict(dp=0, engine_dp=0, pp=3, tp=5)
    assert last.replicas == (29, 32 + 29)  # the same stage and tp rank of replica 1
    derived = sglang_derived_tensors(spec, par, 29)
    assert sorted({int(n.split(".")[2]) for n in derived}) == list(range(45, 61))


def test_lm_head_per_family_under_pipeline_parallelism() -> None:
    head = (128, 64)  # vocabulary 100 padded to 128, tp=1
    llama = [_outside_layers(sglang_layout(_spec("llama"), P(pp=2), r)) for r in range(2)]
    assert llama == [
        {"model.embed_tokens.weight": head, "lm_head.weight": head},
        {"model.norm.weight": (64,), "lm_head.weight": head},
    ]
    qwen3 = sglang_layout(_spec("qwen3"), P(pp=2), 1)  # tied: its own head, from the embedding
    assert _outside_layers(qwen3) == {"model.norm.weight": (64,), "lm_head.weight": head}
    assert {p.canonical for p in qwen3.tensor("lm_head.weight").pieces} == {
        "model.embed_tokens.weight"
    }
    assert _layers(qwen3) == [1, 2]
    assert "lm_head.weight" not in _outside_layers(sglang_layout(_spec("qwen3"), P(), 0))


def test_dp_attention_splits_attention_over_tp_and_the_rest_over_the_engine() -> None:
    """``--tp-size 8 --dp-size 8 --enable-dp-attention --ep-size 8`` (DeepSeek-V3's usual
    serving) is InferParallel(tp=1, engine_dp=8, ep=8): MLA and embed_tokens whole on
    every rank, experts 32 per rank, the dense MLP, shared experts and lm_head over 8."""
    spec, par = load_model_spec("deepseek-v3"), P(tp=1, engine_dp=8, ep=8, dp=2)
    layout = sglang_layout(spec, par, 8 + 3)  # replica 1, SGLang tp rank 3
    assert layout.position == dict(dp=1, engine_dp=3, pp=0, tp=0)
    assert layout.replicas == (3, 11)  # no other rank of its engine holds its MLP rows
    assert _outside_layers(layout)["model.embed_tokens.weight"] == (129280, 7168)
    assert _outside_layers(layout)["lm_head.weight"] == (16160, 7168)
    assert layout.tensor("model.layers.0.self_attn.kv_b_proj.weight").shape == (32768, 512)
    assert _mlp(layout, 0) == {
        "gate_up_proj.weight": (4608, 7168),
        "down_proj.weight": (7168, 2304),
    }
    assert _mlp(layout, 5)["experts.w13_weight"] == (32, 4096, 7168)
    w2 = layout.tensor("model.layers.5.mlp.experts.w2_weight")
    assert {p.canonical.split(".")[5] for p in w2.pieces} == {str(e) for e in range(96, 128)}
    assert _mlp(layout, 5)["shared_experts.down_proj.weight"] == (7168, 256)
    down = layout.tensor("model.layers.0.mlp.down_proj.weight")
    assert [p.canonical_box.offsets for p in down.pieces] == [(0, 3 * 2304)]
    assert sglang_derived_tensors(spec, par, 11)["model.layers.0.self_attn.w_kc"] == (
        128,
        128,
        512,
    )


def test_dp_attention_groups_share_attention_rows_not_mlp_rows() -> None:
    """Qwen3-8B, ``--tp-size 4 --dp-size 2 --enable-dp-attention``: rank 3 (attention dp
    rank 1, attention tp rank 1) holds rank 1's attention and embedding rows, and its own
    quarter of every MLP."""
    spec, par = load_model_spec("qwen3-8b"), P(tp=2, engine_dp=2)
    one, three = sglang_layout(spec, par, 1), sglang_layout(spec, par, 3)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight"):
        assert one.tensor(name) == three.tensor(name)
    gate_up = three.tensor("model.layers.0.mlp.gate_up_proj.weight")
    assert gate_up.shape == (2 * 12288 // 4, 4096)
    assert gate_up.pieces[0].canonical_box.offsets == (3 * 3072, 0)
    assert three.tensor("lm_head.weight").shape == (151936 // 4, 4096)
    assert [lay.replicas for lay in (one, three)] == [(1,), (3,)]
