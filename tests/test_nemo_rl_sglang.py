"""``refit.backend: reshard`` with NeMo RL's SGLang generation, through NeMo RL's own classes.

``tests/programs/nemo_rl_sglang_driver.py`` runs under NeMo RL's Python >= 3.12: NeMo
RL's ``refit_policy_generation`` calls our SGLang synchronizer (installed by our
``install_synchronizer``), which plans from the NeMo RL config and the policy workers'
reports and refits two SGLang servers colocated with two real Megatron-core tp=2 policy
workers (our subclass of NeMo RL's Megatron worker). Every SGLang call goes through
NeMo RL's own ``SGLangGeneration`` and ``SGLangGenerationWorker`` (our subclass, which
NeMo RL's own ``init`` starts with our loader in the server arguments) over HTTP to a
CPU stand-in of the SGLang server (``tests/programs/sglang_http_stand_in.py``, under
SGLang's venv: SGLang 0.5.23's own model classes, weight-update manager and weight
updater, our loader called by SGLang). Stand-ins are listed in both programs'
docstrings. CI has no NeMo RL source, so these skip there, saying how to install it.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from nemo_refit_reshard.integrations.sglang import LOADER
from nemo_refit_reshard.spec import spec_from_hf_config
from tests.helpers import vllm_env
from tests.helpers.checkpoints import write_steps
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires

pytestmark = [
    pytest.mark.slow,
    requires(vllm_env.nemo_rl_grpo_skip_reason),
    requires(vllm_env.sglang_skip_reason),
]

POLICY_GPUS = ["gpu0", "gpu1"]


def drive(tmp: Path, steps: int, sglang_gpus: list[str], timeout_s: float = 120) -> dict[str, Any]:
    cfg = dict(MODELS["qwen3"])
    (tmp / "config.json").write_text(json.dumps(cfg))
    # step 0: what SGLang loads at start-up and the policy trains from
    checkpoints = write_steps(spec_from_hf_config(cfg), tmp, range(steps + 1), seed=900)
    spec = dict(
        config=cfg,
        name="qwen3",
        model_dir=str(tmp),
        train="tp=2",
        megatron_cfg={"tensor_model_parallel_size": 2},
        sglang_tp=1,
        servers=2,
        checkpoints=checkpoints,
        policy_gpus=POLICY_GPUS,
        sglang_gpus=sglang_gpus,
        sglang_python=vllm_env.sglang_python(),
        refit={
            "backend": "reshard",
            "transport": "gloo",
            "host": "127.0.0.1",
            "timeout_s": timeout_s,
        },
    )
    spec_path, result = tmp / "spec.json", tmp / "result.json"
    spec_path.write_text(json.dumps(spec))
    python = vllm_env.nemo_rl_grpo_python()
    proc = vllm_env.start("nemo_rl_sglang_driver", str(spec_path), str(result), python=python)
    vllm_env.finish(proc, "NeMo RL SGLang driver")
    out = json.loads(result.read_text())
    assert "error" not in out, out.get("traceback")
    return out


def _events(step: int) -> list[dict[str, Any]]:
    """What one SGLang server receives for GRPO's step ``step``, in order: NeMo RL's
    ``finish_generation`` after generating (flush, release everything), then the refit:
    wake the weights, our step in SGLang's session, flush, wake the KV cache."""
    return [
        {"path": "/flush_cache"},
        {"path": "/release_memory_occupation", "tags": ["weights", "kv_cache", "cuda_graph"]},
        {"path": "/resume_memory_occupation", "tags": ["weights"]},
        *_session(str(step)),
        {"path": "/flush_cache"},
        {"path": "/resume_memory_occupation", "tags": ["kv_cache", "cuda_graph"]},
    ]


def _session(version: str | None) -> list[dict[str, Any]]:
    update = {"load_format": LOADER, "weight_version": version, "flush_cache": False}
    return [
        {"path": "/begin_weight_update"},
        {"path": "/update_weights_from_tensor", **update},
        {"path": "/end_weight_update"},
    ]


def test_grpo_refits_sglang_servers_bit_exact(tmp_path: Path) -> None:
    """Two GRPO refits (NeMo RL's ``refit_policy_generation``, colocated) from Megatron
    tp=2 into two SGLang servers of tp 1: after each, every SGLang parameter equals its
    canonical slices of that step's checkpoint, in its storage, and the server recorded
    the step as its weight version; NeMo RL's calls and ours reach each server in order."""
    out = drive(tmp_path, steps=2, sglang_gpus=POLICY_GPUS)
    assert out["installed_worker"] == "ReshardSGLangGenerationWorker"
    assert out["server_args"]["custom_weight_loader"] == [LOADER]
    assert "init_error" not in out, out["init_error"]
    assert out["synchronizer"] == "ReshardSGLangWeightSynchronizer"
    assert " -> SGLang tp=1,pp=1,dp=2,engine_dp=1,ep=1," in out["plan"], out["plan"]
    assert "; colocated: " in out["plan"], out["plan"]
    assert len(out["steps"]) == 2
    for k, step in enumerate(out["steps"], start=1):
        assert "error" not in step, step["error"]
        assert (step["stale_before"], step["stale_after"]) == (k == 1, False)
        assert step["metrics"]["reshard/bytes"] > 0
        for server in step["report"]:
            [rank] = server["ranks"]
            assert (rank["differ"], rank["moved"]) == ([], []), rank
            assert rank["status"]["step"] == k and rank["status"]["stale"] is None
            assert rank["status"]["errors"] == []
    policy_step = ["prepare_for_training", "offload_before_refit", "reshard_step"]
    assert out["policy_calls"] == [(policy_step + ["offload_after_refit"]) * 2] * 2
    setup = [{"path": "/flush_cache"}] * 2 + [
        {"path": "/release_memory_occupation", "tags": ["weights", "kv_cache", "cuda_graph"]}
    ]
    for server in out["final"]:
        assert server["events"] == setup + _session(None) + _events(1) + _events(2) + _session(
            None
        )  # connect, two steps, close
    assert out["closed"] is True
    assert out["shm_left"] == []  # every policy rank's staging released at shutdown
    assert out["exit_codes"] == [0, 0]


def test_misplaced_sglang_rank_is_refused_before_it_connects(tmp_path: Path) -> None:
    """The servers' GPUs swapped against NeMo RL's placement: each SGLang rank finds its
    GPU is not its planned host's and refuses, naming both, before reading any staging;
    SGLang answers ``success=False`` and the driver names every server."""
    out = drive(tmp_path, steps=1, sglang_gpus=["gpu1", "gpu0"], timeout_s=60)
    error = out["init_error"]
    assert error.startswith("RuntimeError: connecting the colocated refit failed on "), error
    for mine, host in (("gpu1", "gpu0"), ("gpu0", "gpu1")):
        assert (
            f"SGLang 0.5.23 engine rank 0 runs on GPU {socket.gethostname()}:{mine}, but the plan "
            f"made the training rank on GPU {socket.gethostname()}:{host} its host"
        ) in error, error
    for server in out["init_status"]:
        [rank] = server["ranks"]
        assert rank["status"]["step"] is None and len(rank["status"]["errors"]) == 1
    # the failed join released what the policy ranks opened (their shared-memory staging)
    assert out["shm_left"] == []
    assert out["exit_codes"] == [0, 0]


def test_overlay_through_nemo_rl_config() -> None:
    """configs/nemo_rl's SGLang overlay over NeMo RL's own ``grpo_math_1B_sglang.yaml``,
    through NeMo RL's loader and ``MasterConfig``: our refit block passes, NeMo RL's SGLang
    keys give the planned sizes."""
    import subprocess

    config = vllm_env.REPO / "configs/nemo_rl/grpo_math_qwen3_8B_megatron_reshard_sglang.yaml"
    example = vllm_env.REPO / "examples" / "nemo_rl" / "run_grpo.py"
    probe = f"""
import importlib.util, json
spec = importlib.util.spec_from_file_location("run_grpo", {str(example)!r})
run_grpo = importlib.util.module_from_spec(spec); spec.loader.exec_module(run_grpo)
from nemo_rl.algorithms.grpo import MasterConfig
from nemo_refit_reshard.integrations.nemo_rl.config import train_parallel
from nemo_refit_reshard.integrations.nemo_rl.grpo import check_reshard_config, refit_config
from nemo_refit_reshard.integrations.nemo_rl.sglang_config import sglang_infer_parallel
raw = run_grpo.load({str(config)!r}, [], None)
refit = refit_config(raw)
check_reshard_config(raw)
master = MasterConfig(**raw)
g = master.policy["generation"]
servers = g["sglang_cfg"]["sglang_server_config"]["num_gpus"] // g["sglang_cfg"]["tp_size"]
print(json.dumps(dict(
    backend=refit.backend, engine=g["backend"], dtype=g["sglang_cfg"]["dtype"],
    per_engine=g["sglang_cfg"]["sglang_server_config"]["num_gpus_per_engine"],
    sizes=[str(train_parallel(master.policy, 8)), str(sglang_infer_parallel(g, servers))],
)))
"""
    python = vllm_env.nemo_rl_grpo_python()
    assert python is not None
    got = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-3000:]
    assert json.loads(got.stdout.strip().splitlines()[-1]) == {
        "backend": "reshard",
        "engine": "sglang",
        "dtype": "bfloat16",
        "per_engine": 4,
        "sizes": ["tp=2,pp=2,vpp=1,cp=1,dp=2,ep=1,etp=1", "tp=4,pp=1,dp=2,engine_dp=1,ep=1"],
    }
