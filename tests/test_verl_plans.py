"""The veRL engine's planning and rebuilding, framework-neutral (no veRL needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_refit_reshard.engine.materialize import empty_like_layout
from nemo_refit_reshard.engine.simulate import simulate_plan
from nemo_refit_reshard.integrations.checkpoint_engine import (
    ReshardEngineConfig,
    canonical_tensors,
    plan_full_tensors,
)
from nemo_refit_reshard.layouts import VllmOptions, vllm_layouts
from nemo_refit_reshard.spec import load_model_spec


def config(**kwargs: object) -> ReshardEngineConfig:
    return ReshardEngineConfig.from_engine_kwargs(
        {"model": "small-qwen3-moe", **kwargs}, bucket_size=1 << 20
    )


def test_bucket_defaults_to_verl_setting() -> None:
    assert config().bucket_mb == 1.0
    assert config(bucket_mb=8).bucket_mb == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model": "m", "tp": 2}, "engine_kwargs.reshard has unknown key(s) ['tp']; known: "),
        ({"infer": "tp=2"}, "checkpoint_engine.engine_kwargs.reshard.model is required"),
        ({"model": "m", "transport": "nccl"}, "reshard.transport='nccl'; choose from"),
    ],
)
def test_bad_engine_kwargs(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        ReshardEngineConfig.from_engine_kwargs(kwargs, 1 << 20)
    assert message in str(err.value)


def test_rollout_world_must_be_whole_replicas() -> None:
    with pytest.raises(ValueError, match=r"6 rollout workers are not a whole number of replicas"):
        plan_full_tensors(config(infer="tp=4"), 2, 6)
    with pytest.raises(ValueError, match=r"give one replica's parallelism without dp"):
        plan_full_tensors(config(infer="tp=2,dp=2"), 2, 4)


def test_unknown_model_fails_at_planning() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'"):
        plan_full_tensors(config(model="no-such-model"), 2, 2)


def test_every_rollout_gpu_rebuilds_exactly_its_shard() -> None:
    """Sources hold every tensor whole; each rollout GPU receives its vLLM shard only and
    rebuilds full-shape tensors whose pieces hold the canonical values."""
    cfg = config(infer="tp=2", train_dtype="float32", infer_dtype="float32")
    vp = plan_full_tensors(cfg, 3, 4)
    spec = load_model_spec("small-qwen3-moe")
    g = torch.Generator().manual_seed(0)
    canonical = {t.name: torch.randn(t.shape, generator=g) for t in spec}
    dst_layouts = vllm_layouts(spec, vp.infer, VllmOptions(params_dtype="float32"))
    destinations = [empty_like_layout(lay, fill=0.0) for lay in dst_layouts]
    simulate_plan(vp.plan, [canonical] * 3, destinations)
    shapes = {t.name: t.shape for t in spec}
    for d, lay in enumerate(dst_layouts):
        rebuilt = {
            n: t.clone() for n, t in canonical_tensors(vp.slices[3 + d], destinations[d], shapes)
        }
        assert set(rebuilt) == {p.canonical for p in lay.pieces()}
        for p in lay.pieces():
            box = p.canonical_box.slices()
            assert torch.equal(rebuilt[p.canonical][box], canonical[p.canonical][box])
    # Minimum bytes: every rollout GPU's shard once; all three actor ranks send.
    shard = sum(t.numel for lay in dst_layouts for t in lay.tensors) * 4
    assert vp.bytes == shard
    assert all(any(m.src == a for m in vp.slices[a].messages) for a in range(3))
    # Actor ranks keep only what they send.
    assert sum(len(s.tensors) for s in vp.slices[:3]) < 3 * len(spec.tensors)


def test_engine_model_as_hf_repo_id_says_why_it_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    from nemo_refit_reshard.integrations.checkpoint_engine import engine_spec

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The hub reads the variable once, at import: another test may have imported it already
    # (then the download would retry the network for ~20 s).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as err:
        engine_spec("no-such-org/no-such-model")
    text = str(err.value)
    assert text.startswith("unknown model 'no-such-org/no-such-model': not a preset")
    assert "; as a HuggingFace repo id: " in text
    assert engine_spec("small-qwen3").name == "small-qwen3"


# -- FP8 rollouts (veRL's rollout.quantization: fp8, or a block-FP8 checkpoint) ---------
def fp8_checkpoint() -> dict[str, object]:
    """A block-FP8 Qwen3-MoE config.json (its layer-0 router left unquantized)."""
    from tests.helpers.model_configs import MODELS

    return MODELS["qwen3_moe_fp8"]


def model_dir(tmp_path: Path, name: str, **overrides: object) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**fp8_checkpoint(), **overrides}))
    return str(d)


def test_fp8_rollouts_are_planned_in_the_trained_dtype(tmp_path: Path) -> None:
    """The rollout's loader takes the trained tensors and quantizes them itself: an FP8
    checkpoint, or ``quantization: fp8``, plans exactly the BF16 plan (same fingerprint,
    only bfloat16 on the wire)."""
    model = model_dir(tmp_path, "model", quantization_config=None)
    base = plan_full_tensors(config(model=model, infer="tp=2"), 2, 4)
    dtypes = {t.dtype for s in base.slices for m in s.messages for t in m.transfers}
    assert dtypes == {"bfloat16"}
    fp8_rollout = plan_full_tensors(config(model=model, infer="tp=2", quantization="fp8"), 2, 4)
    (Path(model) / "config.json").write_text(json.dumps(fp8_checkpoint()))
    on_disk = plan_full_tensors(config(model=model, infer="tp=2"), 2, 4)
    for plan in (fp8_rollout, on_disk):
        assert plan.plan.fingerprint == base.plan.fingerprint
        assert plan.slices_json == base.slices_json


def test_fp8_rollout_whose_shards_cut_blocks_is_refused(tmp_path: Path) -> None:
    bf16 = model_dir(tmp_path, "bf16", quantization_config=None)
    with pytest.raises(ValueError) as err:
        plan_full_tensors(config(model=bf16, infer="tp=4", quantization="fp8"), 2, 4)
    assert str(err.value) == (
        f"the rollout serves {bf16} as fp8 block 128x128 at tp=4,pp=1,dp=1,engine_dp=1,ep=1: "
        "model.layers.0.mlp.experts.routed_experts: 64 intermediate rows per rank is not a "
        "multiple of the FP8 block 128: vLLM 0.33 then refines the experts' scale grid and "
        "upsamples the checkpoint's scales, which this refit does not model; use expert "
        "parallel or a tensor-parallel size whose shards are whole blocks"
    )
    # Unquantized, the same rollout is planned.
    assert plan_full_tensors(config(model=bf16, infer="tp=4"), 2, 4).bytes > 0


def test_unknown_rollout_quantization_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        config(quantization="int8")
    assert str(err.value) == (
        "checkpoint_engine.engine_kwargs.reshard.quantization='int8': the checkpoint engine "
        "serves rollouts that quantize at load to ('fp8',) (veRL's rollout.quantization); "
        "leave it unset for an unquantized rollout"
    )
