"""The ``layout`` and ``models`` commands: exact text, JSON equal to the layout, clear errors."""

from __future__ import annotations

import json

import pytest

from nemo_refit_reshard.cli import main
from nemo_refit_reshard.layouts import megatron_layout
from nemo_refit_reshard.spec import TrainParallel, load_model_spec
from tests.helpers.hf_models import TINY_CONFIGS


@pytest.fixture()
def llama_config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIGS["llama"]))
    return str(path)


def test_layout_text_megatron_qkv(llama_config, capsys) -> None:
    rc = main(
        [
            "layout",
            "--framework",
            "megatron",
            "--model",
            llama_config,
            "--parallel",
            "tp=2",
            "--rank",
            "1",
            "--filter",
            "layers.0.self_attention.linear_qkv",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    # 4 query heads in 2 groups (head_dim 16): rank 1 holds group 1 = [q2 q3 | k1 | v1].
    assert lines[2:] == [
        "decoder.layers.0.self_attention.linear_qkv.weight  [64, 64] bfloat16",
        "    [0:32, 0:64] <- model.layers.0.self_attn.q_proj.weight[32:64, 0:64]",
        "    [32:48, 0:64] <- model.layers.0.self_attn.k_proj.weight[16:32, 0:64]",
        "    [48:64, 0:64] <- model.layers.0.self_attn.v_proj.weight[16:32, 0:64]",
        "1 of 15 local tensors shown; 47,424 local elements",
    ]
    assert lines[0].startswith("megatron rank 1 of 2 (tp=1, cp=0, dp=0, pp=0")


def test_layout_text_vllm_vocab_padding(llama_config, capsys) -> None:
    rc = main(
        [
            "layout",
            "--framework",
            "vllm",
            "--model",
            llama_config,
            "--parallel",
            "tp=4",
            "--rank",
            "3",
            "--filter",
            "embed_tokens",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    # vocab 100 padded to 128, 32 rows per rank: rank 3 holds ids 96..99 and 28 padding rows.
    assert lines[2:5] == [
        "model.embed_tokens.weight  [32, 64] bfloat16",
        "    [0:4, 0:64] <- model.embed_tokens.weight[96:100, 0:64]",
        "    [4:32, 0:64] padding",
    ]


def test_layout_json_is_the_layout(capsys) -> None:
    rc = main(
        [
            "layout",
            "--framework",
            "megatron",
            "--model",
            "qwen3-30b-a3b",
            "--parallel",
            "tp=2,pp=2,dp=2,ep=4,etp=1",
            "--rank",
            "5",
            "--json",
        ]
    )
    assert rc == 0
    payload = json.loads(capsys.readouterr().out)
    want = megatron_layout(
        load_model_spec("qwen3-30b-a3b"), TrainParallel.parse("tp=2,pp=2,dp=2,ep=4,etp=1"), 5
    ).to_json()
    assert payload == {"model": "qwen3-30b-a3b", **want}
    # rank 5 = tp 1 of stage 1 (layers 24..47), expert-parallel rank 1 (experts 32..63)
    assert payload["position"] == {"tp": 1, "cp": 0, "dp": 0, "pp": 1, "etp": 0, "ep": 1, "edp": 0}
    names = [t["name"] for t in payload["tensors"]]
    first_expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert names.count(first_expert) == 1
    fc1 = payload["tensors"][names.index(first_expert)]
    assert [p["canonical"] for p in fc1["pieces"]] == [
        "model.layers.24.mlp.experts.32.gate_proj.weight",
        "model.layers.24.mlp.experts.32.up_proj.weight",
    ]


def test_layout_errors_exit_2(capsys) -> None:
    rc = main(["layout", "--framework", "vllm", "--model", "qwen3-30b-a3b", "--parallel", "tp=3"])
    assert rc == 2
    assert "error: tp=3 must divide num_attention_heads=32" in capsys.readouterr().err


@pytest.mark.parametrize(
    "version, expert", [("0.33.0", "experts.routed_experts"), ("0.11.0", "experts")]
)
def test_layout_follows_the_vllm_version(version: str, expert: str, capsys) -> None:
    argv = ["layout", "--framework", "vllm", "--model", "small-qwen3-moe", "--parallel", "tp=2"]
    assert main([*argv, "--vllm-version", version, "--json"]) == 0
    names = {t["name"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert f"model.layers.0.mlp.{expert}.w13_weight" in names


def test_layout_of_an_sglang_rank(capsys) -> None:
    """SGLang's rank 1 of tp=4: a KV head of 8 per rank, q heads 8..15 (qwen3-8b:
    32 heads, 8 KV heads, head_dim 128)."""
    argv = ["layout", "--framework", "sglang", "--model", "qwen3-8b", "--parallel", "tp=4"]
    assert main([*argv, "--rank", "1", "--filter", "layers.0.self_attn.qkv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "sglang rank 1 of 4 (dp=0, engine_dp=0, pp=0, tp=1); model qwen3-8b"
    assert out[3:6] == [
        "    [0:1024, 0:4096] <- model.layers.0.self_attn.q_proj.weight[1024:2048, 0:4096]",
        "    [1024:1280, 0:4096] <- model.layers.0.self_attn.k_proj.weight[256:512, 0:4096]",
        "    [1280:1536, 0:4096] <- model.layers.0.self_attn.v_proj.weight[256:512, 0:4096]",
    ]


def test_layout_of_an_sglang_deepseek_rank_fuses_the_shared_expert(capsys) -> None:
    """SGLang's default on CUDA for DeepSeek-V3 (256 routed experts, 1 shared, no ep): the
    shared expert is routed expert 256, so every MoE layer's w13 holds 257 experts."""
    argv = ["layout", "--framework", "sglang", "--model", "deepseek-v3", "--parallel", "tp=8"]
    assert main([*argv, "--filter", "layers.3.mlp.experts.w13"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "model.layers.3.mlp.experts.w13_weight  [257, 512, 7168] bfloat16"


def test_layout_sglang_states_sglangs_rule(capsys) -> None:
    argv = ["layout", "--framework", "sglang", "--model", "qwen2.5-7b", "--parallel", "tp=8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: tp=8 must divide num_attention_heads=28 (SGLang's rule)" in err


def test_layout_unknown_vllm_version_exits_2(capsys) -> None:
    argv = ["layout", "--framework", "vllm", "--model", "small-qwen3", "--vllm-version", "0.9.2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: vLLM 0.9.2 is not a release whose parameter layout this provider knows" in err


def test_models_lists_presets(capsys) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3        deepseek_v3    684.49B params  46183 tensors" in out
    assert len(out.splitlines()) == 13  # 11 public models + 2 small synthetic demo models
