"""The worker-side API's contract: endpoint validation, call order, plan/group agreement."""

from __future__ import annotations

import pytest
import torch

from nemo_refit_reshard.engine.rendezvous import free_port
from nemo_refit_reshard.integrations.worker import RefitEndpoint, RefitWorker, describe_tensors
from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.hf_models import TINY_CONFIGS


def test_endpoint_round_trip_and_validation() -> None:
    e = RefitEndpoint("127.0.0.1", 1234, world_size=3, group_rank=2)
    assert RefitEndpoint.from_json(e.to_json()) == e
    with pytest.raises(ValueError, match="unknown refit transport 'nccl'"):
        RefitEndpoint("h", 1, 2, 0, transport="nccl")
    with pytest.raises(ValueError, match="refit rank 2 outside a group of 2"):
        RefitEndpoint("h", 1, 2, 2)


def test_describe_tensors() -> None:
    d = describe_tensors({"a": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(4)})
    assert d == {"a": [[2, 3], "bfloat16"], "b": [[4], "float32"]}


def test_call_order_and_plan_for_another_group() -> None:
    spec = spec_from_hf_config(TINY_CONFIGS["llama"])
    plan = plan_refit(
        spec, [megatron_layout(spec, TrainParallel(), 0)], [vllm_layout(spec, InferParallel(), 0)]
    )
    worker = RefitWorker(RefitEndpoint("127.0.0.1", free_port(), 1, 0, timeout_s=10), {})
    with pytest.raises(RuntimeError, match=r"call join\(\) before load_plan\(\)"):
        worker.load_plan(plan)
    with pytest.raises(RuntimeError, match=r"call load_plan\(\) before refit\(\)"):
        worker.refit()
    worker.join()  # a one-rank group forms at once
    with pytest.raises(ValueError, match="the plan spans 2 ranks but this refit group has 1"):
        worker.load_plan(plan.to_json())
    worker.close()
