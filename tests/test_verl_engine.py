"""The veRL ``reshard`` checkpoint engine through veRL's real manager on CPU (gloo).

``tests/verl_driver.py`` runs under the Python of ``scripts/setup_verl_cpu.sh`` (veRL
pins its own transformers): Ray on this machine, veRL's ``CheckpointEngineManager``,
``RayWorkerGroup``, ``CheckpointEngineWorker`` and ``RolloutReplica``; stand-ins only
for the actor worker (it yields each step's full HF tensors) and the server adapter
(it records what the engine yields: vLLM's copying each yield, or, with
``rollout.name=sglang``, ``SGLangBucketAdapter`` holding buckets as veRL's SGLang
adapter does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_refit_reshard.integrations.checkpoint_engine import ReshardEngineConfig, plan_full_tensors
from nemo_refit_reshard.layouts import vllm_layouts
from nemo_refit_reshard.layouts.refit import engine_layouts
from nemo_refit_reshard.spec import InferParallel, spec_from_hf_config
from tests.helpers import vllm_env
from tests.helpers.checkpoints import write_steps
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires

LOCAL = {"host": "127.0.0.1"}  # the refit group's rendezvous stays on loopback
pytestmark = [pytest.mark.slow, requires(vllm_env.verl_skip_reason)]


def model_dir(tmp: Path) -> Path:
    d = tmp / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MODELS["qwen3_moe"]))
    return d


def checkpoints(model: Path, steps: int) -> list[str]:
    spec = spec_from_hf_config(json.loads((model / "config.json").read_text()))
    return write_steps(spec, model.parent, range(steps), seed=500)


def drive(tmp: Path, **spec: Any) -> dict[str, Any]:
    spec_path, result = tmp / "spec.json", tmp / "result.json"
    spec_path.write_text(json.dumps(spec))
    proc = vllm_env.start("verl_driver", str(spec_path), str(result), python=vllm_env.verl_python())
    vllm_env.finish(proc, "veRL driver")
    out = json.loads(result.read_text())
    assert "error" not in out, out.get("traceback")
    return out


def updates(tmp: Path, mode: str, steps: int = 3) -> tuple[list[dict[str, Any]], Any]:
    """2 actor ranks -> 2 replicas of tp=2; every rollout GPU's yields checked each step."""
    work = tmp / mode
    work.mkdir()
    model = model_dir(work)
    kwargs = {"model": str(model), "infer": "tp=2", "timeout_s": 300, "mode": mode, **LOCAL}
    out = drive(
        work,
        actors=2,
        infer="tp=2",
        replicas=2,
        steps=steps,
        checkpoints=checkpoints(model, steps),
        engine_kwargs=kwargs,
    )
    plan = plan_full_tensors(ReshardEngineConfig.from_engine_kwargs(kwargs, 1 << 20), 2, 4)
    assert len(out["steps"]) == steps
    for step in out["steps"]:
        assert "error" not in step, step
        for check in step["checks"]:
            assert check["wrong"] == check["extra"] == check["missing"] == [], check
            assert check["yielded"] > 0
        assert step["metrics"]["reshard/plan"] == plan.plan.fingerprint[:16]
    return out["steps"], plan


def received(step: dict[str, Any]) -> int:
    return sum(c["bytes_received"] for c in step["checks"])


def test_reshard_through_verl_manager(tmp_path: Path) -> None:
    """Three updates with new weights each: every rollout GPU yields exactly its shard's
    canonical values (bf16 on the wire from fp32 actors) and receives only those bytes;
    the gather-broadcast baseline through the same manager delivers the same values
    with every full tensor sent to every GPU."""
    steps, plan = updates(tmp_path, "reshard")
    spec = spec_from_hf_config(MODELS["qwen3_moe"])
    shards = vllm_layouts(spec, InferParallel(tp=2, dp=2))
    needed = 2 * sum(p.canonical_box.numel for lay in shards for p in lay.pieces())
    assert [received(s) for s in steps] == [needed] * 3 == [plan.bytes] * 3
    base_steps, _ = updates(tmp_path, "broadcast", steps=2)
    assert [received(s) for s in base_steps] == [plan.broadcast_bytes] * 2
    assert plan.broadcast_bytes == 4 * 2 * sum(t.numel for t in spec)
    assert round(plan.broadcast_bytes / needed, 2) == 1.98


def test_sglang_rollout_through_verl_manager(tmp_path: Path) -> None:
    """``rollout.name=sglang`` with ``engine_kwargs.reshard.infer_engine=sglang``, through
    veRL's real manager and workers: the stand-in for veRL's SGLang server adapter
    (``SGLangBucketAdapter`` in tests/programs/verl_driver.py) runs veRL's own
    ``get_named_tensor_buckets``, holds every bucket's references as the real adapter
    does, and names every TP rank's tensors by TP rank 0's (``zip(strict=True)``).
    Two updates, 2 actor ranks -> 2 SGLang replicas of tp=2 (dense Qwen3, one 1 MiB
    bucket holding many same-shape tensors): every rank's SGLang shard is bit-exact.
    With one scratch tensor per shape (the vLLM path) the bucket's same-shape tensors
    would all carry the last one's values."""
    work = tmp_path / "sglang"
    work.mkdir()
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODELS["qwen3"]))
    kwargs = {"model": str(model), "infer": "tp=2", "infer_engine": "sglang", "timeout_s": 300}
    spec = spec_from_hf_config(MODELS["qwen3"])
    out = drive(
        work,
        actors=2,
        infer="tp=2",
        replicas=2,
        steps=2,
        checkpoints=write_steps(spec, work, range(2), seed=700),
        engine_kwargs={**kwargs, **LOCAL},
        rollout_name="sglang",
    )
    plan = plan_full_tensors(ReshardEngineConfig.from_engine_kwargs(kwargs, 1 << 20), 2, 4)
    shards = engine_layouts(spec, InferParallel(tp=2, dp=2), "sglang")
    needed = 2 * sum(p.canonical_box.numel for lay in shards for p in lay.pieces())
    assert len(out["steps"]) == 2
    for step in out["steps"]:
        assert "error" not in step, step
        for check in step["checks"]:
            assert check["wrong"] == check["extra"] == check["missing"] == [], check
            assert check["buckets"] == [len(spec.tensors)], check  # one bucket, all held
        assert step["metrics"]["reshard/plan"] == plan.plan.fingerprint[:16]
        assert received(step) == needed == plan.bytes


def test_config_error_fails_first_update_before_any_transfer(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    out = drive(
        tmp_path,
        actors=2,
        infer="tp=3",
        replicas=1,
        steps=1,
        checkpoints=checkpoints(model, 1),
        engine_kwargs={"model": str(model), "infer": "tp=3", "timeout_s": 300, **LOCAL},
    )
    (step,) = out["steps"]
    assert "tp=3 must divide num_attention_heads=4 (vLLM's rule)" in step["error"], step


def test_dead_rollout_worker_fails_the_update_by_name(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    out = drive(
        tmp_path,
        actors=2,
        infer="tp=2",
        replicas=1,
        steps=2,
        checkpoints=checkpoints(model, 2),
        engine_kwargs={"model": str(model), "infer": "tp=2", "timeout_s": 60, **LOCAL},
        kill_rollout_before_step=1,
    )
    first, second = out["steps"]
    assert "error" not in first
    assert "RolloutWorker" in second["error"] and "died" in second["error"].lower(), second
    assert second["seconds"] < 60


@pytest.mark.parametrize("rollout", ["vllm", "sglang"])
def test_example_overrides_compose_with_verls_config(tmp_path: Path, rollout: str) -> None:
    """examples/verl/run_grpo_megatron_reshard.sh's overrides, composed by veRL's own Hydra
    config (``--cfg job`` prints it without training), select this engine (and, with
    ``ROLLOUT_NAME=sglang``, SGLang's rollout and layouts)."""
    import os
    import subprocess

    import yaml

    python = vllm_env.verl_python()
    assert python is not None
    env = dict(vllm_env.vllm_env(), PATH=f"{Path(python).parent}{os.pathsep}{os.environ['PATH']}")
    script = vllm_env.REPO / "examples" / "verl" / "run_grpo_megatron_reshard.sh"
    out = subprocess.run(
        ["bash", str(script), "--cfg", "job"],
        env=dict(env, MODEL_PATH=str(model_dir(tmp_path)), ROLLOUT_TP="2", ROLLOUT_NAME=rollout),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    engine = cfg["actor_rollout_ref"]["rollout"]["checkpoint_engine"]
    assert engine["backend"] == "reshard"
    assert engine["custom_backend_module"] == "nemo_refit_reshard.integrations.verl"
    kwargs = engine["engine_kwargs"]["reshard"]
    config = ReshardEngineConfig.from_engine_kwargs(kwargs, 2048 << 20)
    assert (config.infer, config.transport, config.bucket_mb) == ("tp=2", "cupy-nccl", 2048)
    assert config.infer_engine == cfg["actor_rollout_ref"]["rollout"]["name"] == rollout
    assert cfg["trainer"]["v1"]["trainer_mode"] == "separate_async"
    assert cfg["actor_rollout_ref"]["hybrid_engine"] is False


def test_replicas_removed_added_and_lost_through_verls_elastic_calls(tmp_path: Path) -> None:
    """veRL's own ``remove_replicas`` / ``add_replicas`` between updates, and the caller's
    recovery from a dead rollout worker (remove its replica, update again): every update
    after a change joins a new refit group planned for the replicas serving (a re-added
    replica leaves its old group), and every serving GPU holds exactly its shard of that
    step; the failed attempt ends within the refit timeout."""
    model = model_dir(tmp_path)
    kwargs = {"model": str(model), "infer": "tp=1", "timeout_s": 60, **LOCAL}
    out = drive(
        tmp_path,
        actors=2,
        infer="tp=1",
        replicas=3,
        steps=5,
        checkpoints=checkpoints(model, 5),
        engine_kwargs=kwargs,
        membership={"1": [0, 2], "2": [0, 1, 2]},
        kill_rollout_before_step=3,
        remove_dead_and_retry=True,
    )
    failed = [s for s in out["steps"] if "error" in s]
    done = [s for s in out["steps"] if "error" not in s]
    assert len(failed) == 1 and "RolloutWorker" in failed[0]["error"], failed
    assert failed[0]["seconds"] < 60
    # veRL appends an added replica: its rollout ranks come last in the new group
    assert [s["replicas"] for s in done] == [[0, 1, 2], [0, 2], [0, 2, 1], [0, 1], [0, 1]]
    config = ReshardEngineConfig.from_engine_kwargs(kwargs, 1 << 20)
    for step in done:
        plan = plan_full_tensors(config, 2, len(step["replicas"]))
        assert step["metrics"]["reshard/plan"] == plan.plan.fingerprint[:16]
        assert [c["rank"] for c in step["checks"]] == step["replicas"]
        for check in step["checks"]:
            assert check["wrong"] == check["extra"] == check["missing"] == [], check
            assert check["bytes_received"] == plan.bytes // len(step["replicas"])
