"""The ``reshard`` trainer engine's weight sources (no vLLM needed): every rank's layouts
agree, and each rank's tensors are its live storage under the layout's names."""

from __future__ import annotations

import pytest
import torch

from nemo_refit_reshard.integrations.vllm.transfer_sources import DTensorSource, FullModuleSource
from nemo_refit_reshard.layouts import fsdp2_placements
from nemo_refit_reshard.plan import PlanError
from nemo_refit_reshard.spec import spec_from_hf_config
from tests.helpers.model_configs import MODELS


def _full(spec) -> dict[str, torch.Tensor]:
    return {t.name: torch.zeros(t.shape) for t in spec}


def test_full_module_source_sends_the_live_tensors() -> None:
    spec = spec_from_hf_config(MODELS["qwen3"], name="qwen3")
    tensors = _full(spec)
    source = FullModuleSource(tensors, spec, world_size=2, rank=1)
    assert source.world_size == 2 and [lay.rank for lay in source.layouts()] == [0, 1]
    live = source.tensors()
    assert set(live) == set(tensors)
    assert all(live[n].data_ptr() == tensors[n].data_ptr() for n in live)


def test_dtensor_source_layouts_and_missing_tensor() -> None:
    spec = spec_from_hf_config(MODELS["qwen3"], name="qwen3")
    source = DTensorSource({}, spec, (2,), 0, fsdp2_placements((2,)))
    assert len(source.layouts()) == 2
    with pytest.raises(PlanError, match="tensors the layout needs are not in the module"):
        source.tensors()
