"""The drop-in NeMo RL checkpoint engine through NeMo RL's real classes on CPU.

``tests/nemo_rl_driver.py`` runs under the Python of ``scripts/setup_nemo_rl_cpu.sh``
(NeMo RL at its pinned commit, vLLM 0.25.1 — NeMo RL's pin — and transformers < 5.9):
NeMo RL's ``CheckpointEngineWeightSynchronizer`` drives policy workers with its real
policy-side mixins and vLLM workers with its real vLLM extension, which loads what the
engine yields through vLLM's own ``load_weights`` into vLLM's own model classes. NeMo
RL is not on the package index, so CI (no source at hand) skips these; docs/nemo_rl.md
says where they ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_refit_reshard.spec import spec_from_hf_config
from tests.helpers import vllm_env
from tests.helpers.checkpoints import write_steps
from tests.helpers.delta_updates import write_policy_steps
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires

pytestmark = [pytest.mark.slow, requires(vllm_env.nemo_rl_skip_reason)]


def drive(
    tmp: Path, model: str, tp: int, engines: int, steps: int, sparse: bool = False, **kwargs: Any
) -> dict:
    """``sparse``: each step changes ~1 % of the weights (``write_policy_steps``), as RL
    steps do; else every step's weights are new."""
    cfg = MODELS[model]
    (tmp / "config.json").write_text(json.dumps(cfg))
    spec = spec_from_hf_config(cfg)
    if sparse:
        checkpoints = write_policy_steps(spec, tmp, steps, seed=900)
    else:
        checkpoints = write_steps(spec, tmp, range(steps), seed=900)
    engine_kwargs = {
        "model": str(tmp),
        "infer": f"tp={tp}",
        "train_dtype": "float32",
        "infer_dtype": "float32",
        "host": "127.0.0.1",  # the refit group's rendezvous stays on loopback
        "timeout_s": 300,
        **kwargs,
    }
    spec_path, result = tmp / "spec.json", tmp / "result.json"
    spec_path.write_text(
        json.dumps(
            dict(
                config=cfg,
                policy=2,
                tp=tp,
                engines=engines,
                steps=steps,
                checkpoints=checkpoints,
                engine_kwargs=engine_kwargs,
            )
        )
    )
    proc = vllm_env.start(
        "nemo_rl_driver", str(spec_path), str(result), python=vllm_env.nemo_rl_python()
    )
    vllm_env.finish(proc, "NeMo RL driver")
    return json.loads(result.read_text())


def test_refit_through_nemo_rl_synchronizer(tmp_path: Path) -> None:
    """2 policy ranks -> 2 vLLM engines of tp=2, two refits with new weights: every vLLM
    parameter equals vLLM's own load of that step's checkpoint; stale until it is."""
    out = drive(tmp_path, "qwen3_moe", tp=2, engines=2, steps=2)
    assert "error" not in out, out.get("traceback")
    first, second = out["steps"]
    assert (first["stale_before"], first["stale_after"]) == (True, False)
    assert second["stale_after"] is False
    for step in out["steps"]:
        assert step["differ"] == [[]] * 4, step


def test_delta_through_nemo_rl_synchronizer(tmp_path: Path) -> None:
    """``delta: true`` in the engine's settings: three refits of sparse updates, each
    vLLM parameter equal to vLLM's own load of that step's checkpoint; the first dense
    (version 0), the later ones patches from both policy ranks (under a fifth of dense),
    applied by every vLLM rank; NeMo RL's metrics carry the delta's bytes."""
    out = drive(tmp_path, "qwen3_moe", tp=2, engines=2, steps=3, sparse=True, delta=True)
    assert "error" not in out, out.get("traceback")
    for k, step in enumerate(out["steps"]):
        assert step["differ"] == [[]] * 4, (k, step["differ"])
        assert [s["version"] for s in step["delta"]] == [k] * 6, step["delta"]
        policy, vllm = step["delta"][:2], step["delta"][2:]
        sent = sum(s["sent_bytes"] for s in policy)
        dense = sum(s["dense_bytes"] for s in policy)
        assert step["metrics"]["reshard/delta_version"] == k
        assert step["metrics"]["reshard/delta_sent_bytes"] == policy[0]["sent_bytes"]
        if k == 0:
            assert all(set(s["forms"]) == {"dense"} for s in policy), policy
            continue
        assert 0 < sent < dense / 5, (k, sent, dense)
        for s in vllm:  # every vLLM rank applied patches to its own parameters
            assert set(s["received"]) - {"dense"}, s


def test_unknown_setting_is_named(tmp_path: Path) -> None:
    out = drive(tmp_path, "qwen3_moe", tp=2, engines=1, steps=1, tp_size=2)
    where = 'policy.generation.refit_cfg["nemo_refit_reshard.integrations.nemo_rl:'
    assert where in out["error"], out["error"]
    assert "ReshardCheckpointEngine\"] has unknown key(s) ['tp_size']" in out["error"]


def test_overlay_loads_through_nemo_rl_config(tmp_path: Path) -> None:
    """configs/nemo_rl's overlay, next to NeMo RL's own configs, through NeMo RL's loader
    and its checkpoint-engine config translation, gives settings this engine accepts."""
    overlay = vllm_env.REPO / "configs" / "nemo_rl" / "grpo_math_8B_megatron_reshard_engine.yaml"
    probe = f"""
import json, pathlib, shutil, sys
import nemo_rl
from omegaconf import OmegaConf
from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
from nemo_rl.weight_sync.checkpoint_engine_config import checkpoint_engine_refit_config
configs = pathlib.Path(nemo_rl.__file__).parent.parent / "examples" / "configs"
work = pathlib.Path({str(tmp_path)!r}) / "configs"
shutil.copytree(configs, work)
shutil.copy({str(overlay)!r}, work)
register_omegaconf_resolvers()  # as examples/run_grpo.py does
cfg = OmegaConf.to_container(load_config(work / {overlay.name!r}), resolve=True)
print(json.dumps(checkpoint_engine_refit_config(cfg["policy"]["generation"])))
"""
    import subprocess

    python = vllm_env.nemo_rl_python()
    assert python is not None
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    engine_cfg = json.loads(out.stdout.strip().splitlines()[-1])
    from nemo_refit_reshard.integrations.checkpoint_engine import ReshardEngineConfig

    key = "nemo_refit_reshard.integrations.nemo_rl:ReshardCheckpointEngine"
    assert engine_cfg["backend"] == key
    kwargs = dict(engine_cfg["engine_kwargs"][key])
    assert kwargs.pop("release_after_refit") is False
    config = ReshardEngineConfig.from_engine_kwargs(kwargs, 1 << 20)
    assert (config.infer, config.transport) == ("tp=1,pp=1", "cupy-nccl")
    assert config.model == "meta-llama/Llama-3.1-8B-Instruct"
