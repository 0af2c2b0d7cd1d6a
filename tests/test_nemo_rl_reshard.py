"""``refit.backend: reshard`` through NeMo RL's real GRPO refit, worker and config classes.

``tests/nemo_rl_reshard_driver.py`` runs under the Python of ``scripts/setup_nemo_rl_cpu.sh``
built on Python >= 3.12 (``nemo_rl.algorithms.grpo`` refuses older Pythons): NeMo RL's
``refit_policy_generation`` calls our ``ReshardWeightSynchronizer``, which plans from the
NeMo RL config and the workers' reports, and moves the local shards of real Megatron-core
models (held by our subclass of NeMo RL's ``MegatronPolicyWorkerImpl``) into vLLM 0.25.1's
own model classes through NeMo RL's vLLM RPC mixin. The overlays go through NeMo RL's
config loader, Hydra override parser and ``MasterConfig``. CI has no NeMo RL source, so
these skip there, saying how to install it; docs/nemo_rl.md says where they ran.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from nemo_refit_reshard.spec import spec_from_hf_config
from tests.helpers import vllm_env
from tests.test_vllm_truth import MODELS

_SKIP = vllm_env.nemo_rl_grpo_skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]


TP2 = dict(train="tp=2", megatron_cfg={"tensor_model_parallel_size": 2}, vllm_tp=2, vllm_pp=1)
# Megatron PP and vLLM PP > 1 (which NeMo RL's nccl_reshard refuses).
PP2 = dict(train="pp=2", megatron_cfg={"pipeline_model_parallel_size": 2}, vllm_tp=1, vllm_pp=2)
FOUR_LAYERS = {"num_hidden_layers": 4, "layer_types": ["full_attention"] * 4}  # pp=2 splits it


def drive(tmp: Path, scenario: str, steps: int, sizes: dict = TP2, **refit: Any) -> dict:
    cfg = dict(MODELS["qwen3"], **(FOUR_LAYERS if sizes is PP2 else {}))
    (tmp / "config.json").write_text(json.dumps(cfg))
    checkpoints = []
    for step in range(steps + 1):  # 0: what vLLM loads at start-up
        g = torch.Generator().manual_seed(700 + step)
        path = tmp / f"step{step}.safetensors"
        tensors = {t.name: torch.randn(t.shape, generator=g) for t in spec_from_hf_config(cfg)}
        save_file(tensors, str(path))
        checkpoints.append(str(path))
    spec = dict(
        config=cfg,
        model_dir=str(tmp),
        engines=2,
        **sizes,
        checkpoints=checkpoints,
        scenario=scenario,
        refit={
            "backend": "reshard",
            "transport": "gloo",
            "host": "127.0.0.1",  # the refit group's rendezvous stays on loopback
            "timeout_s": 120,
            **refit,
        },
    )
    spec_path, result = tmp / "spec.json", tmp / "result.json"
    spec_path.write_text(json.dumps(spec))
    python = vllm_env.nemo_rl_grpo_python()
    proc = vllm_env.start("nemo_rl_reshard_driver", str(spec_path), str(result), python=python)
    vllm_env.finish(proc, "NeMo RL reshard driver")
    out = json.loads(result.read_text())
    assert "error" not in out, out.get("traceback")
    return out


@pytest.mark.parametrize("sizes", [TP2, PP2], ids=["tp2", "pp2"])
def test_grpo_refit_moves_local_shards_bit_exact(tmp_path: Path, sizes: dict) -> None:
    """2 Megatron ranks (tp=2; pp=2) -> 2 vLLM engines (tp=2; pp=2), two refits of new weights:
    every vLLM parameter equals vLLM's own load of that step's checkpoint; stale until
    the first sync. The policy worker is our subclass of NeMo RL's Megatron worker where
    Megatron-Bridge imports, else (on CPU) the mixin that subclass adds, on its own."""
    out = drive(tmp_path, "refit", steps=2, sizes=sizes)
    worker = out["policy_worker"]
    mro = worker["mro"]
    assert "nemo_refit_reshard.integrations.nemo_rl.policy_worker.ReshardPolicyWorkerMixin" in mro
    if worker["import_error"] is None:  # Megatron-Bridge importable: NeMo RL's own worker
        assert mro[0] == (
            "nemo_refit_reshard.integrations.nemo_rl.megatron_worker."
            "ReshardMegatronPolicyWorkerImpl"
        )
        base = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorkerImpl"
        assert base in mro
    else:  # on CPU: every Megatron-Bridge release imports Transformer Engine at load
        assert (
            "megatron.bridge" in worker["import_error"]
            or "transformer_engine" in (worker["import_error"])
        )
    assert out["plan"].startswith("reshard plan ")
    want = {
        "tp=2": "Megatron tp=2,pp=1,vpp=1,cp=1,dp=1,ep=1,etp=2 -> vLLM tp=2,pp=1,dp=2,",
        "pp=2": "Megatron tp=1,pp=2,vpp=1,cp=1,dp=1,ep=1,etp=1 -> vLLM tp=1,pp=2,dp=2,",
    }[sizes["train"]]
    assert want in out["plan"], out["plan"]
    first, second = out["steps"]
    assert (first["stale_before"], first["stale_after"]) == (True, False)
    assert (second["stale_before"], second["stale_after"]) == (False, False)
    for step in out["steps"]:
        assert step["differ"] == [[]] * 4, step
        assert step["metrics"]["reshard/bytes"] > 0
    assert out["closed"] is True


def test_wrong_config_is_named_before_any_transfer(tmp_path: Path) -> None:
    """The NeMo RL config says tp=1 while the Megatron workers run tp=2."""
    claims_tp1 = dict(TP2, megatron_cfg={"tensor_model_parallel_size": 1})
    out = drive(tmp_path, "refit", steps=1, sizes=claims_tp1)
    error = out["init_error"]
    assert error.startswith(
        "PlanError: Megatron policy workers do not match the planned layout "
        "tp=1,pp=1,vpp=1,cp=1,dp=2,ep=1,etp=1"
    ), error
    assert "rank 1: tp=1 (planned 0), dp=0 (planned 1)" in error
    assert "tp_size=2 (config 1)" in error
    assert "steps" not in out


def test_dead_vllm_worker_is_named_and_leaves_weights_stale(tmp_path: Path) -> None:
    """A vLLM worker killed before the second refit: the refit raises, naming its
    engine; every other worker gives up within the refit timeout; stale again."""
    out = drive(tmp_path, "dead_worker", steps=2, timeout_s=60)
    first, second = out["steps"]
    assert first["differ"] == [[]] * 4 and first["stale_after"] is False
    error = second["error"]
    assert error.startswith("RuntimeError: refit step 2 failed on "), error
    assert "vLLM engine 1: " in error, error
    assert "ActorDiedError" in error or "RayActorError" in error, error
    assert second["stale_after"] is True
    # The surviving engine's workers: each either received all of step 2 (its senders
    # were alive) or knows its weights may be torn — never fresh with a partial step.
    for status in out["surviving_status"]:
        complete = status["step"] == 2 and status["stale"] is None
        torn = status["step"] == 1 and status["stale"].startswith(
            "the refit of step 2 failed (TransportError: refit rank "
        )
        assert complete or torn, status


def test_overlays_through_nemo_rl_config(tmp_path: Path) -> None:
    """configs/nemo_rl's reshard overlays with NeMo RL's own defaults, through its loader,
    Hydra override parser and ``MasterConfig``: our refit block passes through
    ``MasterConfig`` untouched and selects the backend; an unknown backend is refused."""
    configs = vllm_env.REPO / "configs" / "nemo_rl"
    example = vllm_env.REPO / "examples" / "nemo_rl" / "run_grpo.py"
    probe = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("run_grpo", {str(example)!r})
run_grpo = importlib.util.module_from_spec(spec); spec.loader.exec_module(run_grpo)
from nemo_rl.algorithms.grpo import MasterConfig
from nemo_refit_reshard.integrations.nemo_rl.grpo import check_reshard_config, refit_config
out = {{}}
for name, overrides in [
    ("grpo_math_qwen3_8B_megatron_reshard.yaml", []),
    ("grpo_math_qwen3_8B_megatron_reshard.yaml", ["refit.backend=nccl_reshard"]),
    ("grpo_math_qwen30ba3b_megatron_reshard.yaml", ["refit.transport=gloo"]),
]:
    raw = run_grpo.load({str(configs)!r} + "/" + name, overrides, None)
    refit = refit_config(raw)
    if refit.backend == "reshard":
        check_reshard_config(raw)
    master = MasterConfig(**raw)
    out[name + " " + " ".join(overrides)] = dict(
        refit=master.refit,
        model=master.policy["model_name"],
        megatron=[master.policy["megatron_cfg"].get(k) for k in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "expert_model_parallel_size")],
        vllm=[master.policy["generation"]["vllm_cfg"][k] for k in (
            "tensor_parallel_size", "expert_parallel_size")],
        transport=master.policy["generation"]["refit_transport"],
    )
print(json.dumps(out))
"""
    python = vllm_env.nemo_rl_grpo_python()
    assert python is not None
    got = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    dense = out["grpo_math_qwen3_8B_megatron_reshard.yaml "]
    assert dense["refit"] == {
        "backend": "reshard",
        "transport": "cupy-nccl",
        "timeout_s": 600,
        "bucket_mb": 512,
        "make_vocab_size_divisible_by": 128,
    }
    assert (dense["model"], dense["megatron"], dense["vllm"], dense["transport"]) == (
        "Qwen/Qwen3-8B",
        [2, 2, 1],
        [2, 1],
        None,
    )
    ours = out["grpo_math_qwen3_8B_megatron_reshard.yaml refit.backend=nccl_reshard"]
    assert (ours["refit"]["backend"], ours["transport"]) == ("nccl_reshard", "nccl_reshard")
    moe = out["grpo_math_qwen30ba3b_megatron_reshard.yaml refit.transport=gloo"]
    assert moe["model"] == "Qwen/Qwen3-30B-A3B"
    assert (moe["megatron"], moe["vllm"], moe["refit"]["transport"]) == ([2, 1, 8], [4, 8], "gloo")

    bad = subprocess.run(
        [
            python,
            str(example),
            "--config",
            str(configs / "grpo_math_qwen3_8B_megatron_reshard.yaml"),
            "refit.backend=bogus",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: refit.backend='bogus' is not one of reshard, nccl, nccl_reshard"
    )
    assert "Traceback" not in bad.stderr
