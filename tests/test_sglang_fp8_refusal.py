"""An SGLang engine's block-FP8 parameters are refit in place only where SGLang keeps them
as loaded (NVIDIA Hopper): elsewhere ``fp8_relayout_problems`` names them (SGLang's
``process_weights_after_loading`` re-lays them there; docs/layouts.md, "Block FP8"). Its
attentions' KV-cache scales are no refit's: left out of the refit parameters, and
refused when calibrated (a refit would leave them fitted to the old weights)."""

from __future__ import annotations

import torch

from nemo_refit_reshard.integrations.sglang.receiver import (
    fp8_relayout_problems,
    kv_cache_scale_problems,
    refit_parameters,
)


def test_bf16_parameters_have_no_problem() -> None:
    assert fp8_relayout_problems({"w": torch.zeros(2, dtype=torch.bfloat16)}) == []


def test_fp8_parameters_off_hopper_are_named() -> None:
    params = {
        "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
        "model.layers.0.mlp.down_proj.weight_scale_inv": torch.zeros(1, 1),
        "model.norm.weight": torch.zeros(4),
    }
    assert fp8_relayout_problems(params) == [
        "1 block-FP8 parameters (model.layers.0.mlp.down_proj.weight, ...) on cpu: SGLang "
        "re-lays FP8 weights after loading there (UE8M0 requantization, pre-shuffle or "
        "repack), which an in-place refit would not match; refit FP8 SGLang engines on "
        "Hopper (sm90), or serve BF16"
    ]


def _mla_engine(k_scale: float) -> torch.nn.Module:
    """The parameter names of an FP8 DeepSeek layer's attention (SGLang's), one weight."""
    attn = torch.nn.Module()
    attn.kv_b_proj = torch.nn.Linear(2, 2, bias=False)
    for name in ("attn_mqa", "attn_mha"):
        radix = torch.nn.Module()
        radix.k_scale = torch.nn.Parameter(torch.tensor(k_scale), requires_grad=False)
        radix.v_scale = torch.nn.Parameter(torch.tensor(-1.0), requires_grad=False)
        setattr(attn, name, radix)
    layer = torch.nn.Module()
    layer.self_attn = attn
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    return model


def test_kv_cache_scales_are_not_refit_parameters() -> None:
    assert list(refit_parameters(_mla_engine(-1.0))) == ["layers.0.self_attn.kv_b_proj.weight"]


def test_sglangs_default_kv_cache_scales_are_kept() -> None:
    assert kv_cache_scale_problems(_mla_engine(-1.0)) == []  # as loaded, no checkpoint scale
    assert kv_cache_scale_problems(_mla_engine(1.0)) == []  # after SGLang's post-load pass


def test_calibrated_kv_cache_scales_are_refused() -> None:
    assert kv_cache_scale_problems(_mla_engine(0.5)) == [
        "2 calibrated KV-cache scales (layers.0.self_attn.attn_mqa.k_scale: 0.5, ...): a "
        "refit does not recalibrate them; serve from a checkpoint without k_scale / v_scale "
        "tensors"
    ]
