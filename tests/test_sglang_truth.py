"""The SGLang layout provider against SGLang's own model classes (SGLang 0.5.23 on CPU).

For every case SGLang's model class is built for each rank (``pp_rank·tp + tp_rank``, as
SGLang numbers its world) with SGLang's own runtime context and parallel state (gloo),
and loaded through SGLang's own ``load_weights`` from random float32 checkpoint tensors
(``tests/programs/sglang_cpu_job.py``; stand-ins in ``tests/helpers/sglang_cpu.py``).
Its ``named_parameters()`` must equal the provider's tensors (names, shapes, dtypes),
every provider piece must hold exactly the canonical slice it claims, and every padding
box zeros. What SGLang derives after
loading (DeepSeek's ``w_kc``/``w_vc``: module attributes, not parameters) must be exactly
:func:`sglang_derived_tensors` and hold the split of the rank's ``kv_b_proj``. A negative
control shows the content check fails when ranks are swapped. Under pipeline
parallelism and data-parallel attention each rank's SGLang pipeline and tensor-parallel
rank (and attention data-parallel and tensor-parallel rank) must be the layout's
position, and our receiver's ``engine_rank()`` there the rank.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from nemo_refit_reshard.engine.materialize import mismatches
from nemo_refit_reshard.layouts.base import RankLayout
from nemo_refit_reshard.layouts.sglang import (
    SGLANG_KV_CACHE_SCALES,
    sglang_derived_tensors,
    sglang_layout,
)
from nemo_refit_reshard.layouts.sglang_grid import sglang_pp_indices
from nemo_refit_reshard.layouts.vllm_grid import vllm_position
from nemo_refit_reshard.spec import InferParallel, ModelSpec, spec_from_hf_config
from tests.helpers import vllm_env
from tests.helpers.checkpoints import random_tensors
from tests.helpers.model_configs import BLOCK_FP8, MODELS
from tests.helpers.requires import requires

P = InferParallel
# What DeepSeek-V3's own config.json has and transformers' DeepseekV3Config does not
# write, which SGLang's DeepseekV2 reads; and a YaRN rope_scaling (SGLang's CPU rotary
# embedding is DeepSeek-YaRN only; rope holds no parameter, factor 1 leaves it plain).
_DS_SGLANG = dict(
    scoring_func="sigmoid",
    moe_layer_freq=1,
    ep_size=1,
    norm_topk_prob=True,
    rope_scaling=dict(
        rope_type="deepseek_yarn",
        factor=1.0,
        original_max_position_embeddings=64,
        mscale=1.0,
        mscale_all_dim=1.0,
        beta_fast=32,
        beta_slow=1,
    ),
)
# Every layer an MoE block, as in Qwen3-MoE checkpoints (SGLang 0.5.23 builds experts in
# every layer; the test config's dense layer 1 is refused in test_sglang_layout.py).
CONFIGS = {
    **MODELS,
    "qwen3_moe_sparse": {**MODELS["qwen3_moe"], "mlp_only_layers": []},
    "deepseek_v3": {**MODELS["deepseek_v3"], **_DS_SGLANG},
    "deepseek_v3_no_q_lora": {**MODELS["deepseek_v3_no_q_lora"], **_DS_SGLANG},
    # tied: SGLang's DeepSeek at pp=1 makes lm_head the embed_tokens module
    "deepseek_v3_tied": {**MODELS["deepseek_v3"], **_DS_SGLANG, "tie_word_embeddings": True},
    # the same model under --enforce-shared-experts-fusion (SGLang's default on a CUDA
    # GPU for DeepSeek-V3's 256 experts; on CPU only the flag turns it on)
    "deepseek_v3_fused": {**MODELS["deepseek_v3"], **_DS_SGLANG},
    # block FP8 MLA and experts (dense layer 0, router gates unquantized as SGLang builds
    # them); the attention's KV-cache scales are parameters no refit writes
    "deepseek_v3_fp8": {**MODELS["deepseek_v3_fp8"], **_DS_SGLANG},
    # ... with the shared expert fused (SGLang's CUDA default for 256 routed experts):
    # its e4m3 slot and its scales' slot after the routed experts'
    "deepseek_v3_fp8_fused": {**MODELS["deepseek_v3_fp8"], **_DS_SGLANG},
    # Qwen3 (3 layers, tied) under SGLANG_PP_LAYER_PARTITION=2,1
    "qwen3_split_2_1": MODELS["qwen3"],
    # block FP8: every layer an MoE block, every router gate unquantized (SGLang's
    # Qwen3-MoE builds mlp.gate in bfloat16 under fp8; the checkpoint names it)
    "qwen3_moe_fp8_sparse": {
        **MODELS["qwen3_moe_fp8"],
        "mlp_only_layers": [],
        "quantization_config": dict(
            BLOCK_FP8, modules_to_not_convert=[f"model.layers.{i}.mlp.gate" for i in range(3)]
        ),
    },
}
FUSED = {"deepseek_v3_fused", "deepseek_v3_fp8_fused"}
PARTITION = {"qwen3_split_2_1": (2, 1)}
CASES = [
    ("llama", P()),
    ("deepseek_v3", P()),  # tp=1: every tensor whole
    ("deepseek_v3_tied", P()),  # lm_head is embed_tokens: no lm_head of its own
    ("llama", P(tp=2)),
    ("llama", P(tp=4)),  # 2 KV heads over 4 ranks: each replicated twice
    ("qwen2", P(tp=4)),  # qkv biases, KV replication
    ("qwen3", P(tp=2)),  # q/k norms, tied embeddings, vocabulary padded 100 -> 128
    ("qwen3_moe_sparse", P(tp=2)),  # every expert sliced over the tp ranks
    ("qwen3_moe_sparse", P(tp=2, ep=2)),  # --ep-size 2: experts 0-1 on rank 0, 2-3 on 1
    # MLA (fused_qkv_a_proj_with_mqa), dense layer 0, shared experts over tp, w_kc/w_vc
    ("deepseek_v3", P(tp=2)),
    # no q_lora_rank (q_proj, kv_a_proj_with_mqa) under --ep-size 2: whole routed
    # experts per rank, shared experts over tp
    ("deepseek_v3_no_q_lora", P(tp=2, ep=2)),
    ("deepseek_v3_fused", P(tp=2)),  # the shared expert as expert 4, sliced like them
    # pipeline parallelism: 3 layers over 2 stages are [0] and [1, 2] (SGLang's split;
    # vLLM's is [0, 1] and [2]); tied embeddings: stage 1 builds its own lm_head from
    # model.embed_tokens.weight
    ("qwen3", P(pp=2)),
    ("qwen3_split_2_1", P(pp=2)),  # an explicit partition: [0, 1] and [2]
    ("llama", P(tp=2, pp=2)),  # lm_head on every stage, embed first, norm last
    ("qwen3_moe_sparse", P(pp=2)),  # lm_head on every stage, embed first, norm last
    # dense layer 0 on stage 0, MoE layers 1-2 on stage 1, w_kc/w_vc per stage
    ("deepseek_v3", P(tp=2, pp=2)),
    # data-parallel attention, --tp-size S --dp-size D --enable-dp-attention as
    # InferParallel(tp=S/D, engine_dp=D): attention and embed_tokens over S/D ranks
    # (whole at S/D = 1), replicated over the D groups; MLP, experts, lm_head over S
    ("qwen3", P(engine_dp=2)),  # S=2, D=2: tied (lm_head is embed_tokens)
    ("qwen3", P(tp=2, engine_dp=2)),  # S=4, D=2: attention halves, MLP quarters
    ("qwen3_moe_sparse", P(engine_dp=2)),  # experts sliced over S=2
    ("qwen3_moe_sparse", P(engine_dp=2, ep=2)),  # --ep-size 2: whole experts
    ("deepseek_v3", P(engine_dp=2)),  # MLA whole, dense layer 0 and shared experts over S
    # block FP8 (e4m3 weights, float32 weight_scale_inv per 128x128 block), as SGLang's
    # load_weights leaves them: whole-block shards of weights and scales
    ("qwen3_fp8", P(tp=2)),
    ("qwen3_fp8", P(tp=4)),  # 2 KV heads over 4 ranks: k/v scale rows replicated too
    ("qwen3_moe_fp8_sparse", P(tp=2)),  # w13/w2_weight_scale_inv sliced with the experts
    ("qwen3_moe_fp8_sparse", P(tp=2, ep=2)),  # whole experts and scales per rank
    # fused_qkv_a_proj_with_mqa's scale: [q_a_proj's block rows ; kv_a_proj_with_mqa's]
    ("deepseek_v3_fp8", P(tp=2)),
    ("deepseek_v3_fp8", P(tp=2, ep=2)),  # whole routed experts, shared experts over tp
    # FP8 under pipeline parallelism and data-parallel attention: the same rules per stage
    # and per group (attention whole, MLP / experts and their scales over S=2)
    ("deepseek_v3_fp8_fused", P(tp=2)),
    ("qwen3_fp8", P(pp=2)),
    ("qwen3_fp8", P(engine_dp=2)),
    ("qwen3_moe_fp8_sparse", P(pp=2)),
    ("qwen3_moe_fp8_sparse", P(engine_dp=2)),
    ("deepseek_v3_fp8", P(pp=2)),
    ("deepseek_v3_fp8", P(engine_dp=2)),
]


def _id(case: tuple[str, InferParallel]) -> str:
    par = case[1]
    pp, ep = (f"-pp{par.pp}" if par.pp > 1 else ""), (f"-ep{par.ep}" if par.ep > 1 else "")
    edp = f"-engine_dp{par.engine_dp}" if par.engine_dp > 1 else ""
    return f"{case[0]}-tp{par.tp}{pp}{ep}{edp}"


def _layout(case: tuple[str, InferParallel], rank: int) -> RankLayout:
    model, par = case
    fused, partition = model in FUSED, PARTITION.get(model)
    return sglang_layout(
        _spec(model),
        par,
        rank,
        "float32",
        shared_experts_fusion=fused,
        pp_layer_partition=partition,
    )


def _spec(model: str) -> ModelSpec:
    return spec_from_hf_config(CONFIGS[model], name=model)


def _checkpoint(model: str) -> dict[str, torch.Tensor]:
    """Random float32 checkpoint tensors; a block-FP8 model's quantized weights as e4m3
    (their scales float32), as its checkpoint has them."""
    spec = _spec(model)
    out = random_tensors(spec, 0)
    for t in spec:
        if t.dtype == "float8_e4m3fn":
            out[t.name] = out[t.name].to(torch.float8_e4m3fn)
    return out


@pytest.fixture(scope="module")
def sglang_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case built and loaded by SGLang, one process per rank."""
    from safetensors.torch import save_file

    work = tmp_path_factory.mktemp("sglang-truth")
    builds = []
    for model in sorted({m for m, _ in CASES}):
        (work / model).mkdir()
        (work / model / "config.json").write_text(json.dumps(CONFIGS[model]))
        save_file(_checkpoint(model), str(work / f"{model}.safetensors"))
    # dp attention is proven on 0.5.23 (build_model refuses it on 0.5.12.post1)
    dp_attention = not vllm_env.installed_sglang_version().startswith("0.5.12")
    for case in CASES:
        model, par = case
        # so is block FP8 (build_model refuses it there)
        if (par.engine_dp > 1 or "fp8" in model) and not dp_attention:
            continue
        builds.append(
            dict(
                id=_id(case),
                model_dir=str(work / model),
                tp=par.engine_dp * par.tp,  # SGLang's --tp-size
                dp=par.engine_dp,  # --dp-size with --enable-dp-attention
                pp=par.pp,
                ep=par.ep,
                fuse_shared=model in FUSED,
                pp_layer_partition=PARTITION.get(model),
                weights=str(work / f"{model}.safetensors"),
                out=str(work / f"{_id(case)}.safetensors"),
            )
        )
    (work / "job.json").write_text(json.dumps({"builds": builds}))
    proc = vllm_env.start(
        "sglang_cpu_job",
        str(work / "job.json"),
        str(work / "result.json"),
        python=vllm_env.sglang_python(),
    )
    vllm_env.finish(proc, "SGLang CPU builds")
    result = json.loads((work / "result.json").read_text())
    assert "error" not in result, result["error"]
    return {"work": work, "shapes": result}


def _built(runs: dict[str, Any], case: tuple[str, InferParallel]) -> None:
    if _id(case) not in runs["shapes"]:
        pytest.skip("data-parallel attention and FP8 are proven against SGLang 0.5.23 only")


def _loaded(runs: dict[str, Any], case: tuple[str, InferParallel], rank: int, what: str = ""):
    from safetensors.torch import load_file

    return load_file(str(runs["work"] / f"{_id(case)}_r{rank}{what}.safetensors"))


def _bytes(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    fp8 = torch.float8_e4m3fn
    return {n: t.view(torch.uint8) if t.dtype == fp8 else t for n, t in tensors.items()}


def _content_mismatches(
    layout: RankLayout, loaded: dict[str, torch.Tensor], canonical: dict[str, torch.Tensor]
) -> list[str]:
    # FP8 contents compared as bytes (torch.equal on e4m3 values would take -0 for 0)
    loaded, canonical = _bytes(loaded), _bytes(canonical)
    out = mismatches(layout, loaded, canonical)
    for t in layout.tensors:
        for box in t.padding:
            if loaded[t.name][box.slices()].count_nonzero():
                out.append(f"{t.name}: padding {box} is not zero")
    return out


@pytest.mark.slow
@requires(vllm_env.sglang_skip_reason)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_provider_matches_sglang_parameters_and_contents(
    case: tuple[str, InferParallel], sglang_runs: dict[str, Any]
) -> None:
    _built(sglang_runs, case)
    model, par = case
    canonical = _checkpoint(model)
    for rank in range(par.world_size):
        layout = _layout(case, rank)
        ours = {t.name: [list(t.shape), t.dtype] for t in layout.tensors}
        theirs = dict(sglang_runs["shapes"][_id(case)][rank])
        # an FP8 MLA engine's KV-cache scales: every layer's, scalars, outside the layout
        kv = {n: theirs.pop(n) for n in list(theirs) if n.endswith(SGLANG_KV_CACHE_SCALES)}
        assert kv == _kv_cache_scales(case, rank), rank
        assert theirs == ours, (rank, layout.framework)
        assert _content_mismatches(layout, _loaded(sglang_runs, case, rank), canonical) == []


def _kv_cache_scales(case: tuple[str, InferParallel], rank: int) -> dict[str, list[Any]]:
    """What SGLang's BaseKVCacheMethod registers: k_scale / v_scale of each MLA layer's
    two attentions (attn_mqa: absorbed decode; attn_mha: prefill) on the rank's stage,
    float32 scalars, under a quantization config."""
    spec, par = _spec(case[0]), case[1]
    if spec.arch.mla is None or spec.arch.quant is None:
        return {}
    stage = vllm_position(par, rank).pp
    start, end = sglang_pp_indices(spec.arch.num_layers, stage, par.pp, PARTITION.get(case[0]))
    return {
        f"model.layers.{layer}.self_attn.{attn}.{kv}_scale": [[], "float32"]
        for layer in range(start, end)
        for attn in ("attn_mha", "attn_mqa")
        for kv in "kv"
    }


@pytest.mark.slow
@requires(vllm_env.sglang_skip_reason)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_derived_weights_are_exactly_the_named_ones(
    case: tuple[str, InferParallel], sglang_runs: dict[str, Any]
) -> None:
    """Every tensor SGLang derived after loading is in sglang_derived_tensors (names,
    shapes) and none is a parameter; w_kc / w_vc are the split of the loaded kv_b_proj."""
    _built(sglang_runs, case)
    model, par = case
    spec = _spec(model)
    mla, fp8 = spec.arch.mla, spec.arch.quant is not None
    for rank in range(par.world_size):
        expected = sglang_derived_tensors(spec, par, rank, PARTITION.get(model))
        got = sglang_runs["shapes"]["derived"][_id(case)][rank]
        if mla is not None and fp8:
            # off CUDA, SGLang requantizes the block-FP8 kv_b_proj per tensor
            # (block_quant_to_tensor_quant): w_kc / w_vc in e4m3 with one w_scale each
            # layer (on CUDA with 128x128 blocks: dequantized to BF16, no w_scale)
            layers = {n.rsplit(".", 1)[0] for n in expected}
            want = {n: [list(s), "float8_e4m3fn"] for n, s in expected.items()}
            assert got == {**want, **{f"{p}.w_scale": [[], "float32"] for p in layers}}
            continue
        assert got == {n: [list(s), "float32"] for n, s in expected.items()}
        if mla is None:
            continue
        params, derived = (
            _loaded(sglang_runs, case, rank),
            _loaded(sglang_runs, case, rank, "_derived"),
        )
        for p in {n.rsplit(".", 1)[0] for n in expected}:
            w = params[f"{p}.kv_b_proj.weight"].unflatten(
                0, (-1, mla.qk_nope_head_dim + mla.v_head_dim)
            )
            w_k, w_v = w.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
            assert torch.equal(derived[f"{p}.w_kc"], w_k)
            assert torch.equal(derived[f"{p}.w_vc"], w_v.transpose(1, 2))


@pytest.mark.slow
@requires(vllm_env.sglang_skip_reason)
@pytest.mark.parametrize("case", [c for c in CASES if c[1].pp * c[1].engine_dp > 1], ids=_id)
def test_rank_order_is_sglangs(
    case: tuple[str, InferParallel], sglang_runs: dict[str, Any]
) -> None:
    """SGLang's world rank r is pipeline rank r // tp, tensor-parallel rank r % tp (the
    layout's position), and our receiver's engine_rank() answers r there. Under dp
    attention (``--tp-size`` engine_dp·tp) SGLang's tp rank is edp·tp + tp_rank, its
    attention data-parallel rank edp and its attention tensor-parallel rank tp_rank."""
    _built(sglang_runs, case)
    par = case[1]
    got = sglang_runs["shapes"]["ranks"][_id(case)]
    where = [vllm_position(par, r) for r in range(par.world_size)]
    expected = [[w.pp, w.edp * par.tp + w.tp, r] for r, w in enumerate(where)]
    assert [g[:3] for g in got] == expected
    if len(got[0]) > 3:  # SGLang 0.5.23 reports its attention ranks
        assert [g[3:] for g in got] == [[w.edp, w.tp] for w in where]
    positions = [_layout(case, r).position for r in range(par.world_size)]
    assert [(p["pp"], p["engine_dp"], p["tp"]) for p in positions] == [
        (w.pp, w.edp, w.tp) for w in where
    ]


@pytest.mark.slow
@requires(vllm_env.sglang_skip_reason)
def test_a_wrong_shard_is_caught(sglang_runs: dict[str, Any]) -> None:
    """Rank 1's loaded parameters against rank 0's layout: same names and shapes, and
    the content check names the tensors whose slices differ."""
    case = ("llama", P(tp=2))
    canonical = random_tensors(_spec("llama"), 0)
    layout = sglang_layout(_spec("llama"), case[1], 0, params_dtype="float32")
    wrong = _content_mismatches(layout, _loaded(sglang_runs, case, 1), canonical)
    assert any("qkv_proj" in m for m in wrong) and any("embed_tokens" in m for m in wrong)


@pytest.mark.slow
@requires(vllm_env.sglang_skip_reason)
def test_a_wrong_fp8_shard_is_caught(sglang_runs: dict[str, Any]) -> None:
    """The FP8 negative control: rank 1's loaded e4m3 weights and block scales against
    rank 0's layout: the byte comparison names weights and scales whose blocks differ."""
    case = ("qwen3_fp8", P(tp=2))
    _built(sglang_runs, case)
    layout = sglang_layout(_spec("qwen3_fp8"), case[1], 0, params_dtype="float32")
    wrong = _content_mismatches(layout, _loaded(sglang_runs, case, 1), _checkpoint("qwen3_fp8"))
    for name in ("qkv_proj.weight ", "qkv_proj.weight_scale_inv", "down_proj.weight_scale_inv"):
        assert any(name in m for m in wrong), (name, wrong)
