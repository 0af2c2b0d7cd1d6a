"""The veRL engine with SGLang rollouts, framework-neutral (no veRL, no SGLang needed):
distinct yields for a bucket-holding consumer (R5), SGLang's layouts in the plan, what
veRL's SGLang adapter cannot carry refused at planning, a mismatched ``infer_engine``
refused. Through veRL's own manager: tests/test_verl_engine.py
``test_sglang_rollout_through_verl_manager``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_refit_reshard.engine.materialize import empty_like_layout
from nemo_refit_reshard.engine.simulate import simulate_plan
from nemo_refit_reshard.integrations.checkpoint_engine import (
    ReshardEngineConfig,
    canonical_tensors,
    engine_layouts,
    plan_full_tensors,
)
from nemo_refit_reshard.integrations.verl.rollout_engine import (
    ADAPTER_MODULES,
    check_rollout_engine,
    loaded_rollout_engines,
    reuses_scratch,
)
from nemo_refit_reshard.layouts import VllmOptions
from nemo_refit_reshard.layouts.refit import engine_layouts as infer_layouts
from nemo_refit_reshard.spec import spec_from_hf_config
from tests.helpers.model_configs import MODELS

WHERE = "checkpoint_engine.engine_kwargs.reshard"


def config(tmp: Path, model: dict[str, Any], **kwargs: Any) -> ReshardEngineConfig:
    d = tmp / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(model))
    return ReshardEngineConfig.from_engine_kwargs(
        {"model": str(d), "infer_engine": "sglang", **kwargs}, 1 << 20
    )


def held_yields(tmp: Path, reuse_scratch: bool) -> list[tuple[dict, dict, Any]]:
    """Every rollout rank's yields, all held at once (as veRL's SGLang adapter holds a
    bucket), with the canonical truth and the rank's SGLang layout."""
    cfg = config(tmp, MODELS["qwen3"], infer="tp=2", train_dtype="float32", infer_dtype="float32")
    fp = plan_full_tensors(cfg, 2, 4)
    spec = spec_from_hf_config(MODELS["qwen3"])
    g = torch.Generator().manual_seed(3)
    truth = {t.name: torch.randn(t.shape, generator=g) for t in spec}
    layouts = infer_layouts(spec, fp.infer, "sglang", VllmOptions(params_dtype="float32"))
    destinations = [empty_like_layout(lay, fill=0.0) for lay in layouts]
    simulate_plan(fp.plan, [truth] * 2, destinations)
    shapes = {t.name: t.shape for t in spec}
    out = []
    for d, lay in enumerate(layouts):
        held = dict(canonical_tensors(fp.slices[2 + d], destinations[d], shapes, reuse_scratch))
        out.append((held, truth, lay))
    return out


def wrong_pieces(held: dict, truth: dict, layout: Any) -> list[str]:
    return [
        p.canonical
        for p in layout.pieces()
        if not torch.equal(held[p.canonical][s := p.canonical_box.slices()], truth[p.canonical][s])
    ]


def test_bucket_holding_consumer_gets_exact_distinct_tensors(tmp_path: Path) -> None:
    """R5: a consumer that holds every yield before reading any (veRL's SGLang adapter,
    a bucket at a time) reads each rank's exact shard values; with one scratch tensor
    per shape (what vLLM's copying adapter gets) same-shape tensors alias."""
    for held, truth, layout in held_yields(tmp_path, reuse_scratch=False):
        assert set(held) == {p.canonical for p in layout.pieces()}
        assert wrong_pieces(held, truth, layout) == []
        assert len({id(t) for t in held.values()}) == len(held)
    aliased = held_yields(tmp_path, reuse_scratch=True)
    assert all(wrong_pieces(*rank) for rank in aliased)  # the old behaviour under SGLang


def test_sglang_plan_delivers_sglang_layouts(tmp_path: Path) -> None:
    cfg = config(tmp_path, MODELS["qwen3"], infer="tp=2")
    spec = spec_from_hf_config(MODELS["qwen3"])
    _, infer, _, destinations = engine_layouts(cfg, 2, 4)
    assert destinations == infer_layouts(spec, infer, "sglang")
    assert {lay.framework for lay in destinations} == {"sglang"}
    assert reuses_scratch("vllm") and not reuses_scratch("sglang")


@pytest.mark.parametrize(
    "model, kwargs, message",
    [
        ("qwen3_moe", {"infer": "tp=2,ep=2"}, "SGLang expert parallelism (ep=2) cannot go"),
        ("qwen3", {"infer": "tp=2,engine_dp=2"}, "SGLang data-parallel attention (engine_dp=2"),
        ("qwen3_moe", {"infer": "tp=2"}, "has dense MLP layers [1]"),  # engine_layouts' own
        ("qwen3", {"infer": "tp=2,pp=2"}, "drop pp for SGLang"),
    ],
)
def test_what_sglangs_adapter_cannot_carry_is_refused_at_planning(
    tmp_path: Path, model: str, kwargs: dict, message: str
) -> None:
    with pytest.raises(ValueError) as err:
        plan_full_tensors(config(tmp_path, MODELS[model], **kwargs), 2, 4)
    assert message in str(err.value)


def test_ranks_holding_different_tensors_are_refused(tmp_path: Path) -> None:
    """vocab 65 pads to 128: at tp=4 rank 3's rows are all padding, so it yields no
    embedding, and veRL's adapter would name its tensors by rank 0's."""
    model = dict(MODELS["qwen3"], vocab_size=65)
    with pytest.raises(ValueError, match=r"tp rank 3 holds pieces of other tensors than tp rank 0"):
        plan_full_tensors(config(tmp_path, model, infer="tp=4"), 2, 4)
    plan_full_tensors(config(tmp_path, model, infer="tp=4", infer_engine="vllm"), 2, 4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"infer_engine": "trtllm"}, "reshard.infer_engine='trtllm'; choose from"),
        ({"quantization": "fp8"}, "FP8 SGLang rollouts are not covered"),
    ],
)
def test_bad_sglang_settings(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        config(tmp_path, MODELS["qwen3"], **kwargs)
    assert message in str(err.value)


def test_infer_engine_must_match_the_rollout_workers_adapter() -> None:
    sglang_worker = {"rollout_engines": loaded_rollout_engines({ADAPTER_MODULES["sglang"]: 1})}
    assert sglang_worker["rollout_engines"] == ["sglang"]
    with pytest.raises(ValueError, match=rf"{WHERE}.infer_engine='vllm': set {WHERE}.infer_eng"):
        check_rollout_engine("vllm", [sglang_worker], WHERE)
    check_rollout_engine("sglang", [sglang_worker], WHERE)
    check_rollout_engine("vllm", [{"rollout_engines": []}, {}], WHERE)  # stand-ins: silent
    assert loaded_rollout_engines({}) == []


def test_a_route_that_serves_vllm_only_refuses_sglang() -> None:
    """NeMo RL's drop-in engine passes ``("vllm",)``: NeMo RL takes checkpoint engines
    for its vLLM generation only."""
    where = 'policy.generation.refit_cfg["x"]'
    kwargs = {"model": "small-qwen3", "infer_engine": "sglang"}
    with pytest.raises(ValueError) as err:
        ReshardEngineConfig.from_engine_kwargs(kwargs, 1 << 20, where, ("vllm",))
    assert str(err.value) == (
        f"{where}.infer_engine='sglang': this route serves vllm rollouts only; "
        "leave infer_engine unset"
    )
    config = ReshardEngineConfig.from_engine_kwargs({"model": "small-qwen3"}, 1, where, ("vllm",))
    assert config.infer_engine == "vllm"
