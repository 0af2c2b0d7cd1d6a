"""Refit into a block-FP8 engine: training ranks quantize what they hold in whole blocks
and send e4m3 + scales; weights split off the blocks cross in BF16 into twins that the
inference ranks quantize (``layouts/fp8_wire.py``, ``engine/quantize.Fp8Steps``).

The check after the refit is independent of the shards: every rank's FP8 tensors must
equal, bit for bit, the whole canonical weights quantized by the one quantizer
(``QuantizedWeights``). That holds only because every shard starts on a block boundary
— ``test_quantizing_shards_equals_the_whole_only_on_block_boundaries`` shows the check
fails otherwise. The quantizer itself is checked against vLLM's reference in
tests/test_quantize.py; the layouts against vLLM's FP8 classes in test_vllm_truth.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nemo_refit_reshard.engine.quantize import E4M3, Fp8Steps, quantize_block_fp8
from nemo_refit_reshard.layouts import Box, megatron_layouts, vllm_layouts
from nemo_refit_reshard.layouts.fp8_wire import choose_fp8_wire
from nemo_refit_reshard.plan import (
    PlanError,
    QuantizeStep,
    RankPlan,
    RefitPlan,
    plan_refit,
    rank_plan,
)
from nemo_refit_reshard.runner import RunConfig, build_layouts, run_colocated, run_local
from nemo_refit_reshard.runner.colocated import BACKEND
from nemo_refit_reshard.spec import load_model_spec
from tests.helpers.model_configs import FP8_MOE

E4M3_NAME = "float8_e4m3fn"


def refit_layouts_of(cfg: RunConfig):
    """Megatron's and vLLM's own layouts of ``cfg`` (before the wire rewrites them)."""
    spec = load_model_spec(cfg.model)
    train, infer = cfg.parallel()
    return megatron_layouts(spec, train), vllm_layouts(spec, infer)


@pytest.fixture()
def moe_fp8(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FP8_MOE))
    return str(path)


def _e4m3_and_scale_elements(layouts) -> tuple[int, int]:
    """Elements of e4m3 weights and of float32 scales the layouts receive."""
    fp8 = scales = 0
    for lay in layouts:
        for t in lay.tensors:
            n = sum(p.canonical_box.numel for p in t.pieces)
            if t.dtype == E4M3_NAME:
                fp8 += n
            elif t.name.endswith("weight_scale_inv"):
                scales += n
    return fp8, scales


def test_the_wire_carries_e4m3_where_training_ranks_hold_whole_blocks(moe_fp8: str) -> None:
    """Megatron tp=2 holds every FP8 weight in whole 128x128 blocks (q 256 rows, k and v
    128, experts whole): each training rank quantizes its pieces into derived e4m3 and
    scale tensors, the inference ranks receive e4m3 + scales in place, and the wire
    carries 1 byte per e4m3 element plus 4 per block where BF16 would carry 2."""
    cfg = RunConfig(model=moe_fp8, train="tp=2,ep=2,dp=2", infer="tp=2,engine_dp=2,ep=4")
    spec, sources, destinations = build_layouts(cfg)
    dtypes = {t.name: t.dtype for t in destinations[0].tensors}
    assert dtypes["model.layers.0.self_attn.qkv_proj.weight"] == E4M3_NAME
    assert dtypes["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == "float32"
    assert dtypes["model.layers.0.mlp.experts.routed_experts.w13_weight"] == E4M3_NAME
    assert not any(t.fp8 is not None for lay in destinations for t in lay.tensors)
    derived = {t.name: t for t in sources[0].tensors if t.fp8 is not None}
    q = derived["model.layers.0.self_attn.q_proj.weight@0,0"]
    assert (q.shape, q.dtype) == ((256, 256), E4M3_NAME)
    assert q.fp8 is not None and q.fp8.source == "decoder.layers.0.self_attention.linear_qkv.weight"
    plan = plan_refit(spec, sources, destinations)
    trained = plan_refit(spec, *build_layouts(replace(cfg, fp8_on_wire=False))[1:])
    fp8, scales = _e4m3_and_scale_elements(destinations)
    by_dtype = dict(plan.stats.bytes_by_dtype)
    assert by_dtype[E4M3_NAME] == fp8 and by_dtype["float32"] == 4 * scales
    assert dict(trained.stats.bytes_by_dtype).get(E4M3_NAME, 0) == 0
    assert trained.stats.total_bytes - plan.stats.total_bytes == 2 * fp8 - fp8 - 4 * scales
    assert plan.stats.total_bytes == plan.stats.min_bytes  # every byte once, e4m3 or not
    # what every rank quantizes travels with the plan, and survives its JSON
    again = RefitPlan.from_json(plan.to_json())
    assert again.quantize_steps == plan.quantize_steps and again.fingerprint == plan.fingerprint
    steps = rank_plan(plan, 0).quantize
    assert RankPlan.from_json(rank_plan(plan, 0).to_json()).quantize == steps
    # a rank quantizes only derived tensors of its own; together, every FP8 weight
    quantized = set()
    for lay in sources:
        steps = plan.quantize_steps_of(lay.rank)
        assert {q.weight for q in steps} <= {t.name for t in lay.tensors if t.fp8 is not None}
        quantized |= {q.weight.split("@")[0] for q in steps}
    assert quantized == {t.name for t in spec if t.dtype == E4M3_NAME}


def test_a_weight_split_off_the_blocks_crosses_in_the_trained_dtype(tmp_path: Path) -> None:
    """A dense MLP of intermediate 384 at Megatron tp=2: 192 rows of gate and up a rank,
    192 columns of down — not whole blocks. Those weights cross as BF16 into twins of the
    inference rank's gate_up_proj and down_proj, which it quantizes itself; everything
    else crosses as e4m3."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**FP8_MOE, "intermediate_size": 384}))
    cfg = RunConfig(model=str(path), train="tp=2", infer="engine_dp=2,ep=2")
    spec, sources, destinations = build_layouts(cfg)
    dense = "model.layers.1.mlp"
    wire = choose_fp8_wire(spec, *refit_layouts_of(cfg))
    assert sorted(wire.unquantized) == [f"{dense}.{m}_proj.weight" for m in ("down", "gate", "up")]
    assert wire.unquantized[f"{dense}.gate_proj.weight"] == (
        "training rank 0 holds rows 0+192, columns 0+256: not whole 128x128 blocks"
    )
    twins = {t.name: t for t in destinations[0].tensors if t.fp8 is not None}
    assert sorted(twins) == [f"{dense}.down_proj.weight", f"{dense}.gate_up_proj.weight"]
    assert twins[f"{dense}.gate_up_proj.weight"].dtype == "bfloat16"
    plan = plan_refit(spec, sources, destinations)
    expected = plan.expected_tensors(plan.num_sources)
    assert expected[f"{dense}.gate_up_proj.weight"] == ((768, 256), E4M3_NAME)
    assert expected[f"{dense}.gate_up_proj.weight_scale_inv"] == ((6, 2), "float32")
    assert sorted(q.weight for q in plan.quantize_steps_of(plan.num_sources)) == sorted(twins)


def test_fp8_destinations_need_quantizing_sources(moe_fp8: str) -> None:
    """e4m3 destinations fed by plain training layouts would be cast, unscaled: refused."""
    cfg = RunConfig(model=moe_fp8, train="tp=2", infer="engine_dp=2,ep=2")
    spec = load_model_spec(moe_fp8)
    train, infer = cfg.parallel()
    with pytest.raises(PlanError) as err:
        plan_refit(spec, megatron_layouts(spec, train), vllm_layouts(spec, infer))
    assert str(err.value) == (
        "destination rank 0 receives model.layers.0.self_attn.qkv_proj.weight as e4m3 but "
        "no training rank quantizes: build both sides with layouts.fp8_wire.wire_layouts "
        "(layouts.refit_layouts does)"
    )


@pytest.mark.slow
def test_refit_into_fp8_engine_is_bit_exact(tmp_path: Path) -> None:
    """Megatron tp=2 -> vLLM engine_dp=2 with EP 2 (two experts a rank, each whole), both
    backends, and the colocated refit: every rank's e4m3 weights and scales, NaN before
    the step, are the canonical weights' quantization after it. The dense layer's MLP
    (intermediate 384) crosses in BF16 and is quantized by the inference ranks, the rest
    as e4m3 quantized by the training ranks; then everything in BF16."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**FP8_MOE, "intermediate_size": 384}))
    cfg = RunConfig(model=str(path), train="tp=2", infer="engine_dp=2,ep=2", steps=1, timeout_s=300)
    trained = replace(cfg, fp8_on_wire=False, backends=("reshard",))
    runs = [(run_local(cfg), cfg.backends), (run_colocated(cfg), [BACKEND])]
    runs.append((run_local(trained), trained.backends))
    for result, backends in runs:
        assert result.errors() == {}
        for r in result.ranks[result.plan.num_sources :]:
            for backend in backends:
                assert r["backends"][backend]["mismatches"] == [], (r["rank"], backend)


def test_quantizing_shards_equals_the_whole_only_on_block_boundaries() -> None:
    """Why the check can fail: rows quantized in shards that start on a block boundary
    give the whole weight's quantization; shards that cut a block (rows 0..191 and
    192..255) give other scales and other bytes."""
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    w[200, 0] = 100.0  # the largest of block (1, 0), in the rows a cut at 192 separates
    w = w.to(torch.bfloat16)
    q, s = quantize_block_fp8(w)
    halves = [quantize_block_fp8(w[:128]), quantize_block_fp8(w[128:])]
    assert torch.equal(torch.cat([h[0] for h in halves]).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(torch.cat([h[1] for h in halves]), s)
    cut = [quantize_block_fp8(w[:192]), quantize_block_fp8(w[192:])]
    assert torch.cat([c[1] for c in cut])[1, 0] < s[1, 0]  # block (1, 0) lost its amax


def test_receiving_rank_quantizes_experts_one_by_one() -> None:
    """A twin of fused experts [E, rows, cols] is quantized expert by expert into the live
    e4m3 weight and [E, rows/128, cols/128] scales, in place; a sending rank's derived
    tensors are its live box, cast to the trained dtype, quantized."""
    live = {
        "x.w13_weight": torch.empty(3, 256, 128, dtype=E4M3),
        "x.w13_weight_scale_inv": torch.empty(3, 2, 1),
    }
    pointers = {n: t.data_ptr() for n, t in live.items()}
    step = QuantizeStep("x.w13_weight", "x.w13_weight_scale_inv", (3, 256, 128), "bfloat16")
    receiving = Fp8Steps((step,), (128, 128), live, torch.device("cpu"))
    twin = receiving.tensors["x.w13_weight"]
    assert sorted(receiving.tensors) == ["x.w13_weight"] and twin.dtype == torch.bfloat16
    twin.copy_(torch.randn(3, 256, 128))
    receiving.run()
    for e in range(3):
        q, s = quantize_block_fp8(twin[e])
        assert torch.equal(live["x.w13_weight"][e].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(live["x.w13_weight_scale_inv"][e], s)
    assert {n: t.data_ptr() for n, t in live.items()} == pointers
    master = {"fc1": torch.randn(1, 512, 300, dtype=torch.float32)}  # fp32 master weights
    box = Box((0, 256, 0), (1, 256, 300))
    send = QuantizeStep("w@256,0", "s@256,0", (256, 300), "bfloat16", "fc1", box)
    sending = Fp8Steps((send,), (128, 128), master, torch.device("cpu"))
    sending.run()
    q, s = quantize_block_fp8(master["fc1"][0, 256:].to(torch.bfloat16))
    assert torch.equal(sending.tensors["w@256,0"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(sending.tensors["s@256,0"], s) and s.shape == (2, 3)
