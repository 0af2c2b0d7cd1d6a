"""NeMo RL's SGLang generation (``policy.generation.backend: sglang``) read into our terms
(``integrations/nemo_rl/sglang_config.py``) and planned from the config and the policy
workers' reports (``plans.plan_nemo_rl_sglang``): exact sizes, placement and one-line
errors. These need no NeMo RL and no SGLang; the route through NeMo RL's own SGLang
classes is in tests/test_nemo_rl_sglang.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from nemo_refit_reshard.integrations.nemo_rl.config import NemoRlConfigError, RefitConfig
from nemo_refit_reshard.integrations.nemo_rl.grpo import check_reshard_config
from nemo_refit_reshard.integrations.nemo_rl.plans import plan_nemo_rl_sglang
from nemo_refit_reshard.integrations.nemo_rl.sglang_config import (
    check_sglang_servers,
    sglang_infer_parallel,
)
from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout, megatron_position
from nemo_refit_reshard.layouts.fp8_wire import live_tensors
from nemo_refit_reshard.plan import PlanError
from nemo_refit_reshard.spec import load_model_spec
from nemo_refit_reshard.spec.parallel import InferParallel, TrainParallel

BASE: dict[str, Any] = {
    "refit": {"backend": "reshard"},
    "policy": {
        "model_name": "qwen3-0.6b",
        "precision": "bfloat16",
        "megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 2},
        "generation": {  # NeMo RL's examples/configs/grpo_math_1B_sglang.yaml, tp 2
            "backend": "sglang",
            "colocated": {"enabled": True},
            "sglang_cfg": {
                "model_path": "qwen3-0.6b",
                "dtype": "bfloat16",
                "tp_size": 2,
                "dp_size": 1,
                "pp_size": 1,
                "ep_size": 1,
                "sglang_server_config": {"num_gpus": 4, "num_gpus_per_engine": 2},
            },
        },
    },
}


def config() -> dict[str, Any]:
    return copy.deepcopy(BASE)


def test_sizes() -> None:
    generation = config()["policy"]["generation"]
    assert sglang_infer_parallel(generation, 2) == InferParallel(tp=2, dp=2)
    generation["sglang_cfg"]["ep_size"] = 2  # experts over a server's tp ranks
    assert sglang_infer_parallel(generation, 2) == InferParallel(tp=2, dp=2, ep=2)
    check_reshard_config(config())  # NeMo RL's SGLang example passes as it is


def _sglang(**edit: Any):
    return lambda c: c["policy"]["generation"]["sglang_cfg"].update(**edit)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c["policy"]["generation"]["colocated"].update(enabled=False),
            "policy.generation.colocated.enabled=False with backend=sglang: NeMo RL runs "
            "SGLang colocated only (its setup would wait for inference ranks that never "
            "join its collective); set it to true",
        ),
        (
            _sglang(dp_size=2),
            "policy.generation.sglang_cfg.dp_size=2: NeMo RL passes it as SGLang's "
            "--dp-size (replicas inside one server), whose update_weights_from_tensor SGLang "
            "refuses; set it to 1 and run more servers (sglang_server_config.num_gpus)",
        ),
        (
            _sglang(pp_size=2),
            "policy.generation.sglang_cfg.pp_size=2: the SGLang layouts are tensor "
            "parallel only; set it to 1",
        ),
        (
            _sglang(ep_size=4),
            "policy.generation.sglang_cfg.ep_size=4: SGLang's experts are planned over "
            "ep_size 1 or tp_size=2; set one of them",
        ),
        (_sglang(tp_size=0), "policy.generation.sglang_cfg.tp_size=0 must be a positive integer"),
        (
            _sglang(sglang_server_config={"num_gpus": 4, "num_gpus_per_engine": 4}),
            "policy.generation.sglang_cfg.sglang_server_config.num_gpus_per_engine=4 must "
            "equal tp_size=2 (one SGLang server per tp_size GPUs)",
        ),
        (
            lambda c: c["refit"].update(delta=True),
            "refit.delta=true with policy.generation.backend=sglang: delta refits are served "
            "for vLLM generation only; set refit.delta=false",
        ),
        (
            lambda c: c["policy"]["generation"].update(refit_transport="nccl_reshard"),
            "policy.generation.refit_transport='nccl_reshard': refit.backend=reshard "
            "replaces NeMo RL's refit transports; set it to null",
        ),
    ],
)
def test_config_errors_name_the_key(edit: Any, message: str) -> None:
    cfg = config()
    edit(cfg)
    with pytest.raises(NemoRlConfigError) as err:
        check_reshard_config(cfg)
    assert str(err.value) == message


def _reports(train: TrainParallel, gpus: list[str | None]) -> list[dict[str, Any]]:
    """What each policy worker's ``reshard_describe`` answers, made from the layouts (the
    route test has real Megatron workers answer it)."""
    spec = load_model_spec("qwen3-0.6b")
    sizes = {
        "tp_size": train.tp, "pp_size": train.pp, "vpp_size": train.vpp, "cp_size": train.cp,
        "dp_size": train.dp, "ep_size": train.ep, "etp_size": train.expert_tp,
    }  # fmt: skip
    out = []
    for r in range(train.world_size):
        layout = megatron_layout(spec, train, r, MegatronOptions())
        tensors = {n: [list(s), d] for n, (s, d) in live_tensors(layout).items()}
        out.append(
            {
                "rank": r,
                "position": {**megatron_position(train, r).as_dict(), **sizes},
                "options": {},
                "tensors": tensors,
                "gpu": gpus[r],
            }
        )
    return out


def test_plan_places_sglang_rank_d_on_policy_rank_d() -> None:
    """NeMo RL puts server i's tp rank k on the placement group's GPU i·tp + k, the
    policy rank i·tp + k's: the plan's hosts are the identity, slices for every rank."""
    train = TrainParallel(tp=2, dp=2)
    reports = _reports(train, ["n:a", "n:b", "n:c", "n:d"])
    plan = plan_nemo_rl_sglang(config(), RefitConfig(backend="reshard"), reports, engines=2)
    assert plan.plan.colocated_hosts == (0, 1, 2, 3)
    assert (plan.train, plan.infer) == (train, InferParallel(tp=2, dp=2))
    assert len(plan.slices) == 8
    assert str(plan).startswith(f"reshard plan {plan.plan.fingerprint[:12]}: Megatron ")
    assert " -> SGLang tp=2" in str(plan)
    assert set(plan.engine_slices(6, 2)) == {"6", "7"}


def test_plan_refusals() -> None:
    train = TrainParallel(tp=2)
    refit = RefitConfig(backend="reshard")
    with pytest.raises(PlanError) as err:
        plan_nemo_rl_sglang(config(), refit, _reports(train, ["n:a", None]), engines=1)
    assert str(err.value) == (
        "colocated refit: policy rank 1 report no GPU (a CPU process names the GPU it "
        "stands for in $NRR_DEVICE)"
    )
    with pytest.raises(PlanError) as err:
        plan_nemo_rl_sglang(config(), refit, _reports(train, ["n:a", "n:b"]), engines=2)
    assert str(err.value) == (
        "colocated SGLang: 2 servers of tp 2 need 4 GPUs, the policy runs on 2; give "
        "SGLang at most the policy's GPUs (sglang_server_config.num_gpus)"
    )


def test_servers_must_carry_our_loader() -> None:
    """NeMo RL's own SGLang worker (no ``begin_weight_update``) is named before any
    request: SGLang would refuse our load_format inside its scheduler."""

    class Ours:
        def begin_weight_update(self) -> bool:
            return True

    check_sglang_servers([Ours(), Ours()])
    with pytest.raises(NemoRlConfigError) as err:
        check_sglang_servers([Ours(), object()])
    assert str(err.value) == (
        "SGLang servers [1] were started by NeMo RL's own SGLangGenerationWorker, without "
        "our refit loader: call grpo.policy_factory(refit, config) before NeMo RL's setup "
        "(examples/nemo_rl/run_grpo.py does)"
    )
