"""Refit into a block-FP8 engine with the trained (BF16) weights on the wire: each
inference rank receives BF16 twins of its e4m3 weights and quantizes them into its
weights and scales (``layouts/vllm_fp8.bf16_twin``, ``engine/quantize.Fp8Receiver``).

The check after the refit is independent of the shards: every rank's FP8 tensors must
equal, bit for bit, the whole canonical weights quantized by the one quantizer
(``QuantizedWeights``). That holds only because every shard starts on a block boundary
— ``test_quantizing_shards_equals_the_whole_only_on_block_boundaries`` shows the check
fails otherwise. The quantizer itself is checked against vLLM's reference in
tests/test_quantize.py; the layouts against vLLM's FP8 classes in test_vllm_truth.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_refit_reshard.engine.quantize import E4M3, Fp8Receiver, quantize_block_fp8
from nemo_refit_reshard.runner import RunConfig, build_layouts, run_colocated, run_local
from nemo_refit_reshard.runner.colocated import BACKEND

FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
MOE = {
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
    "quantization_config": FP8,
}


@pytest.fixture()
def moe_fp8(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MOE))
    return str(path)


def test_plan_is_of_the_twins(moe_fp8: str) -> None:
    """The destinations are BF16 twins (no scales), the sources Megatron's BF16 shards."""
    cfg = RunConfig(model=moe_fp8, train="tp=2,ep=2,dp=2", infer="tp=2,engine_dp=2,ep=4")
    spec, sources, destinations = build_layouts(cfg)
    assert spec.arch.quant is not None
    twin = {t.name: t.dtype for t in destinations[0].tensors}
    assert twin["model.layers.0.self_attn.qkv_proj.weight"] == "bfloat16"
    assert twin["model.layers.0.mlp.experts.routed_experts.w13_weight"] == "bfloat16"
    assert not any(n.endswith("weight_scale_inv") for n in twin)
    assert {t.dtype for lay in sources for t in lay.tensors} == {"bfloat16"}


@pytest.mark.slow
def test_refit_into_fp8_engine_is_bit_exact(moe_fp8: str) -> None:
    """Megatron tp=2 -> vLLM engine_dp=2 with EP 2 (two experts a rank, each whole), both
    backends, and the colocated refit: every rank's e4m3 weights and scales, NaN before
    the step, are the canonical weights' quantization after it."""
    cfg = RunConfig(model=moe_fp8, train="tp=2", infer="engine_dp=2,ep=2", steps=1, timeout_s=300)
    for result, backends in ((run_local(cfg), cfg.backends), (run_colocated(cfg), [BACKEND])):
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


def test_receiver_quantizes_experts_one_by_one() -> None:
    """A fused experts tensor [E, rows, cols] is quantized expert by expert, into the
    live e4m3 weight and [E, rows/128, cols/128] scales, in place."""
    live = {
        "x.w13_weight": torch.empty(3, 256, 128, dtype=E4M3),
        "x.w13_weight_scale_inv": torch.empty(3, 2, 1),
        "x.norm": torch.empty(4),
    }
    pointers = {n: t.data_ptr() for n, t in live.items()}
    receiver = Fp8Receiver(live, (128, 128))
    tensors = receiver.tensors()
    assert sorted(tensors) == ["x.norm", "x.w13_weight"]
    assert tensors["x.w13_weight"].dtype == torch.bfloat16
    tensors["x.w13_weight"].copy_(torch.randn(3, 256, 128))
    receiver.finish()
    for e in range(3):
        q, s = quantize_block_fp8(tensors["x.w13_weight"][e])
        assert torch.equal(live["x.w13_weight"][e].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(live["x.w13_weight_scale_inv"][e], s)
    assert {n: t.data_ptr() for n, t in live.items()} == pointers
    with pytest.raises(ValueError) as err:
        Fp8Receiver({"y.weight": torch.empty(2, 2, dtype=E4M3)}, (128, 128))
    assert str(err.value) == "y.weight is e4m3 but the engine holds no y.weight_scale_inv"
