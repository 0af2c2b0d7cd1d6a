"""An SGLang engine's block-FP8 parameters are refit in place only where SGLang keeps them
as loaded (NVIDIA Hopper): elsewhere ``fp8_relayout_problems`` names them (SGLang's
``process_weights_after_loading`` re-lays them there; docs/layouts.md, "Block FP8")."""

from __future__ import annotations

import torch

from nemo_refit_reshard.integrations.sglang.receiver import fp8_relayout_problems


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
