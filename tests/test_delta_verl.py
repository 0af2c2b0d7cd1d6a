"""Delta refit through veRL's ``reshard`` checkpoint engine (``delta: true`` in its settings).

The end-to-end test runs veRL 0.9.1's real ``CheckpointEngineManager`` on CPU
(``tests/programs/verl_delta_driver.py``: ``verl_driver``'s parties, under
``.venv-verl``): 2 actor ranks -> 2 rollout replicas of tp=2, four updates whose
checkpoints each change about 1 % of the previous one's elements (the actors hand over
float32, the wire and the rollout hold BF16). The option checks run without veRL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_refit_reshard.engine.delta import DeltaOptions
from nemo_refit_reshard.integrations.checkpoint_engine import (
    CheckpointEngineRank,
    ReshardEngineConfig,
    plan_full_tensors,
)
from nemo_refit_reshard.integrations.worker import RefitEndpoint
from nemo_refit_reshard.plan import PlanError
from nemo_refit_reshard.spec import spec_from_hf_config
from tests.helpers import vllm_env
from tests.helpers.delta_updates import write_policy_steps
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires

WHERE = "checkpoint_engine.engine_kwargs.reshard"


def config(**kwargs: object) -> ReshardEngineConfig:
    return ReshardEngineConfig.from_engine_kwargs({"model": "small-qwen3-moe", **kwargs}, 1 << 20)


def test_delta_options_from_engine_kwargs() -> None:
    assert config().delta_options is None
    assert config(delta=True).delta_options == DeltaOptions()
    on = config(delta=True, delta_anchor_every=4, delta_baseline="host")
    assert on.delta_options == DeltaOptions(anchor_every=4, baseline="host")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"delta": "yes"}, f"{WHERE}.delta='yes' must be true or false"),
        ({"delta": True, "delta_anchor_every": -1}, "delta_anchor_every=-1 must be an integer"),
        ({"delta": True, "delta_anchor_every": 2.5}, "delta_anchor_every=2.5 must be an integer"),
        ({"delta": True, "delta_baseline": "gpu"}, "delta_baseline='gpu'; choose from"),
        ({"delta_anchor_every": 3}, f"{WHERE}.delta_anchor_every applies to delta refits only"),
        ({"delta_baseline": "host"}, "set checkpoint_engine.engine_kwargs.reshard.delta: true"),
        ({"delta": True, "mode": "broadcast"}, "delta: true needs mode reshard"),
    ],
)
def test_bad_delta_options_are_refused_by_name(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        config(**kwargs)
    assert message in str(err.value)


def test_an_endpoint_without_the_settings_delta_is_refused_before_joining() -> None:
    """A rank whose endpoint does not carry the settings' delta (a driver that built it
    from other settings) refuses, before any rendezvous: the group would disagree."""
    on = config(delta=True, infer="tp=2")
    plan = plan_full_tensors(on, 1, 2)
    rank = CheckpointEngineRank(on)
    endpoint = RefitEndpoint("127.0.0.1", 1, 3, 0, timeout_s=5)
    with pytest.raises(PlanError, match=r"settings say delta=DeltaOptions\(.*its endpoint None"):
        rank.join(endpoint, plan.slices[0])
    assert not rank.joined


def updates(tmp: Path, steps: int, **delta: Any) -> dict[str, Any]:
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODELS["qwen3_moe"]))
    spec = spec_from_hf_config(MODELS["qwen3_moe"])
    checkpoints = write_policy_steps(spec, tmp, steps, seed=500)
    kwargs = {"model": str(model), "infer": "tp=2", "timeout_s": 300, "host": "127.0.0.1"}
    spec_path, result = tmp / "spec.json", tmp / "result.json"
    spec_path.write_text(
        json.dumps(
            dict(
                actors=2,
                infer="tp=2",
                replicas=2,
                steps=steps,
                checkpoints=checkpoints,
                engine_kwargs={**kwargs, **delta},
            )
        )
    )
    proc = vllm_env.start(
        "verl_delta_driver", str(spec_path), str(result), python=vllm_env.verl_python()
    )
    vllm_env.finish(proc, "veRL delta driver")
    out = json.loads(result.read_text())
    assert "error" not in out, out.get("traceback")
    return out


@pytest.mark.slow
@requires(vllm_env.verl_skip_reason)
def test_delta_through_verl_manager(tmp_path: Path) -> None:
    """Four updates through veRL's manager with ``delta: true``: every rollout GPU yields
    exactly its shard's canonical values of that step's checkpoint after each (bit for
    bit, BF16); the first update is dense (version 0), each later one sends the actor
    ranks' messages as patches, together fewer bytes than dense, and every rollout rank
    received patches; veRL's metrics carry an actor rank's delta bytes."""
    out = updates(tmp_path, 4, delta=True)
    assert len(out["steps"]) == 4
    for k, step in enumerate(out["steps"]):
        for check in step["checks"]:
            assert check["wrong"] == check["extra"] == check["missing"] == [], (k, check)
            assert check["yielded"] > 0
        actors, rollout = step["delta"][:2], step["delta"][2:]
        assert [s["version"] for s in step["delta"]] == [k] * 6, step["delta"]
        sent = sum(s["sent_bytes"] for s in actors)
        dense = sum(s["dense_bytes"] for s in actors)
        assert dense > 0
        metrics = step["metrics"]
        assert metrics["reshard/delta_version"] == k
        assert metrics["reshard/delta_dense_bytes"] in [s["dense_bytes"] for s in actors]
        if k == 0:  # nothing to compare against yet: every message whole
            assert sent > dense, (sent, dense)  # the messages plus their headers
            assert all(set(s["forms"]) == {"dense"} for s in actors), actors
            continue
        assert sent < dense / 5, (k, sent, dense)
        assert all(s["changed"] < s["units"] for s in actors), actors
        for s in rollout:  # every rollout GPU applied patches to its own buffers
            assert set(s["received"]) - {"dense"}, s
