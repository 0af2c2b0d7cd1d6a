"""The colocated NeMo RL route's pieces that need no NeMo RL: the placement read from
the workers' reported GPUs (``plans.colocation``) and the policy worker's check that
the tensors a refit reads are still the model's live ones (``storage_problems``). The
route itself, through NeMo RL's classes, is in tests/test_nemo_rl_reshard.py."""

from __future__ import annotations

import socket

import pytest
import torch

from nemo_refit_reshard.integrations.nemo_rl.plans import colocation
from nemo_refit_reshard.integrations.nemo_rl.policy_worker import _storage_id, storage_problems
from nemo_refit_reshard.integrations.worker import DEVICE_ENV, device_name
from nemo_refit_reshard.plan import Colocation, PlanError
from nemo_refit_reshard.spec.parallel import InferParallel


def _reports(policy: list[str | None], engines: list[list[str | None]]):
    p = [{"rank": r, "gpu": g} for r, g in enumerate(policy)]
    e = [[{"engine_rank": k, "gpu": g} for k, g in enumerate(gpus)] for gpus in engines]
    return p, e


def test_placement_from_reported_gpus() -> None:
    """vLLM rank d's host is the policy rank reporting the same GPU, in any order; with
    vLLM DP inside an engine group (engine_dp=2) the ranks run across the group."""
    p, e = _reports(["a", "b", "c", "d"], [["d", "c"], ["b", "a"]])
    assert colocation(InferParallel(tp=2, dp=2), p, e) == Colocation((3, 2, 1, 0))
    p, e = _reports(["a", "b", "c", "d"], [["b", "a", "d", "c"]])  # one group, engine_dp=2
    infer = InferParallel(tp=2, dp=1, engine_dp=2, ep=4)
    assert colocation(infer, p, e) == Colocation((1, 0, 3, 2))


def test_unnamed_gpus_are_one_line() -> None:
    p, e = _reports(["a", None], [["a", None]])
    with pytest.raises(PlanError) as err:
        colocation(InferParallel(tp=2), p, e)
    assert str(err.value) == (
        "colocated refit: policy rank 1, vLLM rank 1 report no GPU (a CPU process names "
        "the GPU it stands for in $NRR_DEVICE)"
    )


def test_device_name_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert device_name("cpu") is None
    monkeypatch.setenv(DEVICE_ENV, "gpu5")
    assert device_name("cpu") == f"{socket.gethostname()}:gpu5"


def test_storage_resized_in_place_is_still_live() -> None:
    """Megatron DDP's offload and reload (``offload_to_cpu`` / ``reload_from_cpu``)
    resize a buffer's storage to 0 and back: the compiled views stay the live tensors,
    and a view taken before sees the values written after the reload."""
    weight = torch.arange(12.0).reshape(3, 4)
    view = weight[1:, :2]  # what a compiled program holds
    storages = {"w": _storage_id(weight)}
    backup = weight.clone()
    weight.untyped_storage().resize_(0)
    assert storage_problems(storages, {"w": weight}) == [
        "w: offloaded (its storage holds no data now)"
    ]
    weight.untyped_storage().resize_(backup.untyped_storage().nbytes())
    weight.copy_(backup * 10)
    assert storage_problems(storages, {"w": weight}) == []
    assert view.tolist() == [[40.0, 50.0], [80.0, 90.0]]


def test_replaced_parameter_is_named() -> None:
    """``param.data = ...`` or ``model.to(...)``: a new storage the compiled views do not
    read. Named, never refit from stale memory."""
    param = torch.nn.Parameter(torch.ones(4))
    storages = {"p": _storage_id(param), "gone": 0}
    param.data = torch.zeros(4)
    assert storage_problems(storages, {"p": param}) == [
        "p: replaced by a new tensor since the plan was loaded",
        "gone: no longer in the model",
    ]
