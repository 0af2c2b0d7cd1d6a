"""NeMo RL's config read into our terms (``integrations/nemo_rl/config.py``, ``grpo.py``):
exact sizes from NeMo RL-shaped dicts, and one-line errors naming key, value, choices.
These need no NeMo RL; the overlays through NeMo RL's own loader, ``MasterConfig`` and
Hydra override parser are in tests/test_nemo_rl_reshard.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from nemo_refit_reshard.integrations.nemo_rl.config import (
    NemoRlConfigError,
    RefitConfig,
    colocated,
    infer_parallel,
    train_parallel,
)
from nemo_refit_reshard.integrations.nemo_rl.fp8 import fp8_spec
from nemo_refit_reshard.integrations.nemo_rl.grpo import (
    async_grpo,
    check_reshard_config,
    refit_config,
)
from nemo_refit_reshard.spec import load_model_spec as preset_spec
from nemo_refit_reshard.spec.parallel import InferParallel, TrainParallel


def config(**refit: Any) -> dict[str, Any]:
    return {
        "refit": {"backend": "reshard", **refit},
        "policy": {
            "model_name": "Qwen/Qwen3-30B-A3B",
            "precision": "bfloat16",
            "megatron_cfg": {
                "enabled": True,
                "tensor_model_parallel_size": 2,
                "pipeline_model_parallel_size": 1,
                "context_parallel_size": 1,
                "expert_model_parallel_size": 8,
                "expert_tensor_parallel_size": 1,
            },
            "generation": {
                "backend": "vllm",
                "colocated": {"enabled": False, "resources": {"gpus_per_node": 8}},
                "refit_transport": None,
                "vllm_cfg": {
                    "tensor_parallel_size": 4,
                    "pipeline_parallel_size": 1,
                    "expert_parallel_size": 8,
                    "precision": "bfloat16",
                },
            },
        },
        "cluster": {"gpus_per_node": 8, "num_nodes": 8},
    }


def test_sizes_from_nemo_rl_config() -> None:
    cfg = config()
    assert train_parallel(cfg["policy"], 48) == TrainParallel(tp=2, dp=24, ep=8, etp=1)
    # vLLM EP = DP·TP: ep 8 over tp 4 -> 2 vLLM data-parallel ranks per engine group.
    assert infer_parallel(cfg["policy"]["generation"], 16) == InferParallel(
        tp=4, dp=2, engine_dp=2, ep=8
    )
    cfg["policy"]["generation"]["vllm_cfg"]["expert_parallel_size"] = 4  # ep == tp
    assert infer_parallel(cfg["policy"]["generation"], 16) == InferParallel(tp=4, dp=4, ep=4)
    cfg["policy"]["megatron_cfg"]["virtual_pipeline_model_parallel_size"] = 2
    cfg["policy"]["megatron_cfg"]["pipeline_model_parallel_size"] = 2
    assert train_parallel(cfg["policy"], 48) == TrainParallel(tp=2, pp=2, vpp=2, dp=12, ep=8, etp=1)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c["policy"]["megatron_cfg"].update(enabled=False),
            "policy.megatron_cfg.enabled=False: refit.backend=reshard needs the Megatron "
            "policy (set policy.megatron_cfg.enabled=true)",
        ),
        (
            lambda c: c["policy"]["generation"].update(backend="trtllm"),
            "policy.generation.backend='trtllm': refit.backend=reshard serves vllm and sglang "
            "generation only",
        ),
        (
            lambda c: c["policy"]["megatron_cfg"].update(account_for_loss_in_pipeline_split=True),
            "policy.megatron_cfg.account_for_loss_in_pipeline_split=True: refit.backend=reshard "
            "models even pipeline splits and num_layers_in_first/last_pipeline_stage only; "
            "unset it",
        ),
        (
            lambda c: c["policy"].update(draft={"enabled": True}),
            "policy.draft.enabled=True: refit.backend=reshard refits the policy's own "
            "weights, not a draft model's; use refit.backend=nccl",
        ),
        (
            lambda c: c["policy"]["generation"]["vllm_cfg"].update(precision="int8"),
            "policy.generation.vllm_cfg.precision='int8' is not one of bfloat16, float16, "
            "float32 (or fp8 for vllm_cfg.precision)",
        ),
        (
            lambda c: c["policy"]["generation"]["vllm_cfg"].update(precision="fp8", is_mx=True),
            "policy.generation.vllm_cfg.is_mx=True with precision fp8 and "
            "refit.backend=reshard: MXFP8 generation is not modeled (block FP8 is: is_mx: false)",
        ),
        (
            lambda c: c["policy"]["generation"]["vllm_cfg"].update(
                precision="fp8", use_deep_gemm=True
            ),
            "policy.generation.vllm_cfg.use_deep_gemm=True with precision fp8 and "
            "refit.backend=reshard: vLLM's DeepGEMM kernels re-lay FP8 weights after loading "
            "and reshard writes them in place: set it to false (and VLLM_USE_DEEP_GEMM=0)",
        ),
        (
            lambda c: c["policy"]["generation"]["vllm_cfg"].update(
                precision="fp8", kv_cache_dtype="fp8"
            ),
            "policy.generation.vllm_cfg.kv_cache_dtype='fp8' with refit.backend=reshard: the "
            "FP8 KV cache's scales are not refit; use kv_cache_dtype: auto",
        ),
    ],
)
def test_config_errors_name_the_key(edit: Any, message: str) -> None:
    cfg = config()
    edit(cfg)
    with pytest.raises(NemoRlConfigError) as err:
        check_reshard_config(cfg)
    assert str(err.value) == message


def test_colocated_is_served() -> None:
    """NeMo RL's default (colocated) passes the config checks; the placement is checked
    against the GPUs the workers report (tests/test_nemo_rl_colocated.py,
    tests/test_nemo_rl_reshard.py)."""
    cfg = config()
    cfg["policy"]["generation"]["colocated"]["enabled"] = True
    check_reshard_config(cfg)
    del cfg["policy"]["generation"]["colocated"]  # absent: NeMo RL's default, true
    assert colocated(cfg["policy"]["generation"]) is True


def test_size_errors() -> None:
    cfg = config()
    with pytest.raises(NemoRlConfigError) as err:
        train_parallel(cfg["policy"], 7)
    assert str(err.value) == (
        "policy.megatron_cfg: tp·pp·cp = 2·1·1 = 2 does not divide the 7 training GPUs"
    )
    with pytest.raises(NemoRlConfigError) as err:
        train_parallel(cfg["policy"], 4)  # dp=2: ep=8 cannot fit
    assert str(err.value).startswith(
        "policy.megatron_cfg: training parallelism breaks Megatron's rule etp·ep·edp = tp·cp·dp"
    )
    cfg["policy"]["generation"]["vllm_cfg"]["expert_parallel_size"] = 6
    with pytest.raises(NemoRlConfigError) as err:
        infer_parallel(cfg["policy"]["generation"], 16)
    assert str(err.value) == (
        "policy.generation.vllm_cfg.expert_parallel_size=6 must be a multiple of "
        "tensor_parallel_size=4 (vLLM's EP = DP·TP)"
    )
    cfg["policy"]["generation"]["vllm_cfg"]["expert_parallel_size"] = 8
    with pytest.raises(NemoRlConfigError) as err:
        infer_parallel(cfg["policy"]["generation"], 12)
    assert str(err.value) == (
        "policy.generation.vllm_cfg: one engine group spans ep/tp·pp·tp = 8 GPUs, which "
        "does not divide the 12 inference GPUs"
    )


def test_refit_block() -> None:
    assert RefitConfig.from_config(None) == RefitConfig(backend="nccl")
    with pytest.raises(NemoRlConfigError) as err:
        refit_config(config(backend="bogus"))
    assert str(err.value) == "refit.backend='bogus' is not one of reshard, nccl, nccl_reshard"
    with pytest.raises(NemoRlConfigError) as err:
        refit_config(config(transprot="gloo"))
    assert str(err.value) == (
        "refit has unknown key(s) ['transprot']; known: backend, transport, timeout_s, "
        "bucket_mb, host, make_vocab_size_divisible_by, delta, delta_anchor_every, "
        "delta_baseline"
    )
    with pytest.raises(NemoRlConfigError) as err:
        refit_config(config(transport="nvlink"))
    assert str(err.value) == "refit.transport='nvlink' is not one of gloo, cupy-nccl"
    with pytest.raises(NemoRlConfigError) as err:
        refit_config(config(timeout_s=0))
    assert str(err.value) == "refit.timeout_s=0 must be a positive number"


def test_backend_sets_nemo_rl_switch() -> None:
    """``nccl_reshard`` turns on NeMo RL's own switch; the others leave it null, and a
    checkpoint-engine transport left in the config is a conflict, not overridden."""
    cfg = config(backend="nccl_reshard")
    assert refit_config(cfg).backend == "nccl_reshard"
    assert cfg["policy"]["generation"]["refit_transport"] == "nccl_reshard"
    for backend in ("reshard", "nccl"):
        cfg = config(backend=backend)
        assert refit_config(cfg).backend == backend
        assert cfg["policy"]["generation"]["refit_transport"] is None
    cfg = config()
    cfg["policy"]["generation"]["refit_transport"] = "nixl"
    with pytest.raises(NemoRlConfigError) as err:
        refit_config(copy.deepcopy(cfg))
    assert str(err.value).startswith(
        "policy.generation.refit_transport='nixl' conflicts with refit.backend=reshard"
    )


def test_fp8_generation_is_the_block_fp8_engine_nemo_rl_builds() -> None:
    """``vllm_cfg.precision: fp8``: the engine NeMo RL's init_fp8 starts — 128x128 blocks,
    every linear layer e4m3 except those of the first/last ``num_*_layers_in_bf16``
    layers (its ``ignored_layers``), embeddings, norms and lm_head in the model's dtype."""
    spec = preset_spec("small-qwen3")
    vcfg = {"precision": "fp8", "num_first_layers_in_bf16": 1, "num_last_layers_in_bf16": 0}
    fp8 = fp8_spec(spec, vcfg)
    assert fp8.arch.quant is not None and fp8.arch.quant.block == (128, 128)
    dtypes = {t.name: t.dtype for t in fp8}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "bfloat16"
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" not in dtypes
    assert dtypes["model.layers.1.self_attn.q_proj.weight"] == "float8_e4m3fn"
    assert dtypes["model.layers.1.mlp.down_proj.weight_scale_inv"] == "float32"
    assert dtypes["model.embed_tokens.weight"] == "bfloat16"
    assert sorted(fp8.arch.quant.ignored) == sorted(
        f"model.layers.0.{m}"
        for m in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        )
    )  # fmt: skip
    assert fp8_spec(spec, {"precision": "bfloat16"}) is spec
    moe = {"precision": "fp8", "num_last_layers_in_bf16": 1}
    with pytest.raises(NemoRlConfigError) as err:
        fp8_spec(preset_spec("small-qwen3-moe"), moe)
    assert str(err.value) == (
        "policy.generation.vllm_cfg.num_first_layers_in_bf16=0, num_last_layers_in_bf16=1: "
        "BF16 layers in a MoE model are not modeled (vLLM skips fused experts by another "
        "naming rule); set both to 0"
    )


def async_config(**edits: Any) -> dict[str, Any]:
    """``config()`` with NeMo RL's async GRPO on, as its async recipes set it."""
    cfg = config()
    cfg["grpo"] = {"async_grpo": {"enabled": True, "in_flight_weight_updates": True}}
    cfg["policy"]["generation"]["vllm_cfg"]["async_engine"] = True
    cfg["loss_fn"] = {"use_importance_sampling_correction": True}
    for path, value in edits.items():
        *head, last = path.split("__")
        node = cfg
        for key in head:
            node = node.setdefault(key, {})
        node[last] = value
    return cfg


def test_async_grpo_is_served() -> None:
    assert async_grpo(async_config()) is True
    assert async_grpo(config()) is False
    off = async_config()
    off["grpo"]["async_grpo"]["enabled"] = False
    assert async_grpo(off) is False


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {"policy__generation__vllm_cfg__async_engine": False},
            "grpo.async_grpo.enabled=True with policy.generation.vllm_cfg.async_engine: async "
            "GRPO generates with vLLM's async engine; set it to true",
        ),
        (
            {"policy__generation__colocated__enabled": True},
            "grpo.async_grpo.enabled=True with policy.generation.colocated.enabled: NeMo RL "
            "runs colocated async GRPO with Megatron generation only; give vLLM its own GPUs "
            "(false)",
        ),
        (
            {"loss_fn__use_importance_sampling_correction": False},
            "grpo.async_grpo.enabled=True with loss_fn.use_importance_sampling_correction: "
            "async GRPO trains on off-policy samples and needs it; set it to true",
        ),
        (
            {"grpo__reward_shaping__enabled": True},
            "grpo.async_grpo.enabled=True with grpo.reward_shaping.enabled: NeMo RL's async "
            "GRPO does not support it; turn it off",
        ),
    ],
)
def test_async_grpo_errors_name_the_key(edit: dict[str, Any], message: str) -> None:
    with pytest.raises(NemoRlConfigError) as err:
        async_grpo(async_config(**edit))
    assert str(err.value) == message
