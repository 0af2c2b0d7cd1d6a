"""``--infer-engine sglang``: plan, simulate and the local runner with SGLang's layouts on
the inference side (``layouts.refit.engine_layouts``)."""

from __future__ import annotations

import json

import pytest

from nemo_refit_reshard.cli import main
from nemo_refit_reshard.layouts.refit import engine_layouts
from nemo_refit_reshard.layouts.sglang import sglang_layout
from nemo_refit_reshard.spec import InferParallel, load_model_spec

ARGS = ["--model", "qwen3-8b", "--train", "tp=4,pp=2", "--infer", "tp=2,dp=4"]


def test_sglang_engine_layouts_are_sglang_ranks_with_replicas_sharing_tensors() -> None:
    spec, infer = load_model_spec("qwen3-8b"), InferParallel.parse("tp=2,dp=4")
    layouts = engine_layouts(spec, infer, "sglang")
    assert [lay.framework for lay in layouts] == ["sglang"] * 8
    assert [lay.rank for lay in layouts] == list(range(8))
    assert [lay.replicas for lay in layouts] == [(0, 2, 4, 6), (1, 3, 5, 7)] * 4
    # rank 5 is tp rank 1 of replica 2: the same tensors object as rank 1's
    assert layouts[5].tensors is layouts[1].tensors
    assert layouts[1].tensors == sglang_layout(spec, infer, 1, "bfloat16").tensors
    assert layouts[5].position == {"dp": 2, "engine_dp": 0, "pp": 0, "tp": 1}


def test_unknown_engine_is_refused() -> None:
    spec = load_model_spec("small-qwen3")
    with pytest.raises(ValueError, match=r"unknown inference engine 'trtllm'; choose from"):
        engine_layouts(spec, InferParallel.parse("tp=2"), "trtllm")


def test_plan_for_sglang_names_it_and_moves_what_its_ranks_need(capsys) -> None:
    assert main(["plan", *ARGS, "--infer-engine", "sglang"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(
        ": qwen3-8b, training tp=4,pp=2 (8 ranks) -> SGLang inference tp=2,dp=4 (8 ranks)"
    )
    assert main(["plan", *ARGS, "--infer-engine", "sglang", "--json"]) == 0
    sglang = json.loads(capsys.readouterr().out)
    assert main(["plan", *ARGS, "--json"]) == 0
    vllm = json.loads(capsys.readouterr().out)
    # Qwen3 dense: SGLang's shards are vLLM's (tests/test_sglang_truth.py proves both), so
    # the bytes are the same; every byte is one a destination needs.
    assert sglang["total_bytes"] == sglang["min_bytes"] == vllm["total_bytes"]
    assert sglang["bytes_received"] == vllm["bytes_received"]
    # 4 replicas, each the whole BF16 model once (8 KV heads over tp=2: none replicated)
    # and its norms (the 1-D tensors) once more: both tp ranks hold them whole.
    spec = load_model_spec("qwen3-8b")
    norms = sum(t.shape[0] for t in spec if len(t.shape) == 1)
    assert sglang["total_bytes"] == 4 * 2 * (spec.num_params + norms)


def test_simulate_for_sglang_names_it(capsys) -> None:
    argv = ["simulate", *ARGS, "--infer-engine", "sglang", "--relay", "none", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["infer_engine"] == "sglang" and report["infer"] == "tp=2,dp=4"
    assert report["predicted_s"] > 0


def test_sglang_refusals_reach_the_command_line(capsys) -> None:
    argv = ["plan", *ARGS[:4], "--infer", "tp=2,pp=2,engine_dp=2", "--infer-engine", "sglang"]
    assert main(argv) == 2
    assert (
        "error: --tp-size 4 --dp-size 2 --enable-dp-attention (engine_dp=2) with pp=2 is not "
        "covered"
    ) in capsys.readouterr().err


def test_sglang_layout_takes_the_pp_partition(capsys, monkeypatch) -> None:
    """``layout --framework sglang``: ``--pp-partition``, else SGLang's own
    ``SGLANG_PP_LAYER_PARTITION``, else SGLang's split (the last stages take the extra
    layers: 36 over 3 stages is 12 each; 10,10,16 puts layers 20-35 on stage 2)."""
    base = ["layout", "--framework", "sglang", "--model", "qwen3-8b", "--parallel", "tp=2,pp=3"]
    first = "model.layers.{}.input_layernorm.weight  [4096] bfloat16"

    def first_layer(*extra: str) -> str:
        assert main([*base, "--rank", "5", *extra]) == 0
        return capsys.readouterr().out.splitlines()[2]

    assert first_layer() == first.format(24)
    assert first_layer("--pp-partition", "10,10,16") == first.format(20)
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "11,11,14")
    assert first_layer() == first.format(22)
    assert main([*base, "--rank", "0", "--pp-partition", "10,10"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "error: pp layer partition [10, 10] must have pp=3 entries summing to "
            "num_hidden_layers=36 (SGLANG_PP_LAYER_PARTITION, SGLang's rule)"
        )
    )


def test_plan_for_a_block_fp8_sglang_engine_sends_e4m3_and_scales(tmp_path, capsys) -> None:
    """A block-FP8 Qwen3 served by SGLang: the FP8 wire of refit_layouts (e4m3 weights and
    float32 block scales cross, as for vLLM). SGLang's FP8 shards are vLLM's for Qwen3
    (tests/test_sglang_truth.py proves SGLang's), so the plan is vLLM's, byte for byte."""
    from nemo_refit_reshard.spec import spec_from_hf_config
    from tests.helpers.model_configs import MODELS

    config = tmp_path / "config.json"
    config.write_text(json.dumps(MODELS["qwen3_fp8"]))
    argv = ["plan", "--model", str(config), "--train", "tp=2", "--infer", "tp=2", "--json"]
    assert main([*argv, "--infer-engine", "sglang"]) == 0
    sglang = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    vllm = json.loads(capsys.readouterr().out)
    assert sglang["fingerprint"] == vllm["fingerprint"]
    assert sglang["total_bytes"] == sglang["min_bytes"] == vllm["total_bytes"]
    spec = spec_from_hf_config(MODELS["qwen3_fp8"])
    fp8 = [t for t in spec if t.dtype == "float8_e4m3fn"]
    assert fp8 and sglang["total_bytes"] < 2 * spec.num_params  # less than BF16 weights
