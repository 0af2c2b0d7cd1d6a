"""Live Megatron tensors matched to the layout (errors; the real-model path is in
tests/test_megatron_truth.py::test_live_tensors_through_framework_wrappers)."""

from __future__ import annotations

import pytest
import torch

from nemo_refit_reshard.integrations.megatron import (
    match_layout,
    megatron_live_tensors,
    unwrap,
)
from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout
from nemo_refit_reshard.plan import PlanError
from nemo_refit_reshard.spec import TrainParallel, load_model_spec


def layout():
    return megatron_layout(
        load_model_spec("small-qwen3"),
        TrainParallel(tp=2),
        0,
        MegatronOptions(params_dtype="float32"),
    )


def live_for(lay) -> dict[str, torch.Tensor]:
    return {t.name: torch.nn.Parameter(torch.zeros(t.shape)) for t in lay.tensors}


def test_every_difference_is_listed() -> None:
    lay = layout()
    live = live_for(lay)
    gone = "decoder.layers.0.self_attention.linear_qkv.weight"
    del live[gone]
    live["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.nn.Parameter(torch.zeros(3))
    live["decoder.layers.0.mlp.router.expert_bias"] = torch.zeros(4)  # a buffer: not required
    with pytest.raises(PlanError) as err:
        match_layout(live, lay)
    assert str(err.value).splitlines()[:3] == [
        "Megatron rank 0: live tensors and layout disagree:",
        f"  {gone}: in the layout, not in the model",
        "  decoder.layers.0.self_attention.linear_qkv.bias: a model parameter the layout "
        "does not cover",
    ]


def test_wrappers_and_chunks() -> None:
    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    inner = torch.nn.Linear(2, 3)
    assert unwrap(Wrapper(Wrapper(inner))) is inner
    chunks = [Wrapper(torch.nn.Linear(2, 3)), Wrapper(torch.nn.Linear(3, 4))]
    live = megatron_live_tensors(chunks)
    assert sorted(live) == ["model0.bias", "model0.weight", "model1.bias", "model1.weight"]
    assert live["model1.weight"] is chunks[1].module.weight
    assert sorted(megatron_live_tensors(Wrapper(inner))) == ["bias", "weight"]
