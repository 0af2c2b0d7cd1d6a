"""The CPU GRPO app with engines that come and go (``faults:``, ``grpo_cpu/elastic.py``):
training runs every step; after every refit the engines serving hold the trainer's
weights bit for bit and report the step; a lost engine is fenced and its actors ended,
a restarted or new one caught up and back in the plan."""

from __future__ import annotations

import pytest
import torch

from nemo_refit_reshard.grpo_cpu.config import FaultSettings, GrpoRunConfig, RefitSettings
from nemo_refit_reshard.grpo_cpu.driver import RefitEvent, run_grpo
from nemo_refit_reshard.grpo_cpu.trainer import GrpoConfig
from nemo_refit_reshard.spec.parallel import InferParallel, TrainParallel

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _config(steps: int, **faults) -> GrpoRunConfig:
    return GrpoRunConfig(
        train=TrainParallel(tp=2),
        infer=InferParallel(tp=2, dp=2),
        grpo=GrpoConfig(prompts_per_step=4, group_size=4),
        num_steps=steps,
        refit=RefitSettings(timeout_s=TIMEOUT_S, compare_broadcast=False),
        faults=FaultSettings(**faults),
        progress=False,
    )


class Holds:
    """``after_refit``: the engines serving hold the trainer's weights and say so."""

    def __init__(self) -> None:
        self.replicas: list[tuple[int, tuple[int, ...]]] = []

    def __call__(self, event: RefitEvent) -> None:
        assert event.elastic is not None
        want = event.cluster.trainer_canonical()
        got = event.cluster.generator_canonical(event.replicas)
        bad = sorted(n for n in want if not torch.equal(want[n], got[n]))
        assert not bad, f"step {event.step}: engines {event.replicas} differ in {bad}"
        for rank, w in event.elastic.weights(event.replicas).items():
            assert (w["step"], w["stale"]) == (event.step, None), (rank, w)
        for e in event.replicas:
            assert event.elastic.membership.engines[e].version == event.step
        # an engine out of the run has no actor left (it receives nothing more)
        out = [a for a in event.cluster.generators if a.replica not in event.replicas]
        assert all(a.handle is None for a in out), out
        self.replicas.append((event.step, event.replicas))


@pytest.mark.slow
def test_an_engine_lost_in_step_2_and_restarted_before_step_4(ray_session) -> None:
    cfg = _config(5, lose_engine_at_step=2, add_engine_at_step=4)
    holds = Holds()
    reports = run_grpo(cfg, after_refit=holds)
    assert holds.replicas == [
        (0, (0, 1)), (1, (0, 1)), (2, (0,)), (3, (0,)), (4, (0, 1)), (5, (0, 1)),
    ]  # fmt: skip
    assert [r.engines for r in reports] == [(0, 1), (0,), (0,), (0, 1), (0, 1)]
    full, half = reports[0].refit_bytes["reshard"], reports[1].refit_bytes["reshard"]
    assert half * 2 == full and reports[3].refit_bytes["reshard"] == full
    for r in reports:  # generation used whole weights only: the trainer's log-probs match
        assert r.max_logprob_diff < 1e-5, r


@pytest.mark.slow
def test_a_new_engine_joins_at_step_2(ray_session) -> None:
    cfg = _config(3, add_engine_at_step=2, engine=0)
    holds = Holds()
    reports = run_grpo(cfg, after_refit=holds)
    assert holds.replicas == [(0, (1,)), (1, (1,)), (2, (0, 1)), (3, (0, 1))]
    assert [r.engines for r in reports] == [(1,), (0, 1), (0, 1)]


@pytest.mark.parametrize(
    ("section", "extra", "message"),
    [
        (
            {"lose_engine_at_step": 2},
            {"refit": {"compare_broadcast": True}},
            "faults: engines that come and go refit with the reshard backend only: set "
            "refit.backend: reshard, refit.compare_broadcast: false, refit.verify: false",
        ),
        (
            {"lose_engine_at_step": 3, "add_engine_at_step": 3},
            {},
            "faults.lose_engine_at_step and faults.add_engine_at_step are both 3: the engine "
            "joins before that step generates and would die in its refit; choose different "
            "steps",
        ),
        (
            {"add_engine_at_step": 9},
            {},
            "faults.add_engine_at_step=9 must be a step of the run (1..5)",
        ),
        (
            {"engine": 1},
            {},
            "faults.engine applies with faults.lose_engine_at_step or "
            "faults.add_engine_at_step; set one, or drop faults.engine",
        ),
        (
            {"lose_engine_at_step": 2, "engine": 2},
            {},
            "faults.engine=2 with infer.dp=2: the run needs another engine serving while it "
            "is out (infer.dp >= 2, faults.engine in 0..1)",
        ),
        (
            {"lose_engine_at_step": 2},
            {"grpo": {"prompts_per_step": 3, "num_steps": 5}, "infer": {"tp": 2, "dp": 3}},
            "grpo.prompts_per_step=3 must split evenly over the generation replicas serving "
            "while an engine is out=2",
        ),
        (
            {"lose_engine_at": 2},
            {},
            "unknown config key(s) faults.lose_engine_at; valid: faults.add_engine_at_step, "
            "faults.engine, faults.lose_engine_at_step",
        ),
    ],
)
def test_fault_settings_are_checked_before_anything_starts(section, extra, message) -> None:
    cfg = {
        "grpo": {"num_steps": 5, "prompts_per_step": 4},
        "infer": {"tp": 2, "dp": 2},
        "refit": {"compare_broadcast": False},
        "faults": section,
    }
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    with pytest.raises(ValueError) as err:
        GrpoRunConfig.from_dict(cfg)
    assert str(err.value) == message
