"""The CPU GRPO app with engines that come and go (``faults:``, ``grpo_cpu/elastic.py``):
training runs every step; after every refit the engines serving hold the trainer's
weights bit for bit and report the step; a lost engine is fenced and its actors ended,
a restarted or new one caught up and back in the plan. What the driver says while it
waits out a lost engine, and ``refit.verify`` over every group (the example's run with
faults and verify on; the lines and the per-group rank mapping on fake Ray calls)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nemo_refit_reshard.grpo_cpu import elastic
from nemo_refit_reshard.grpo_cpu.cluster import ActorInfo, RefitVerifyError
from nemo_refit_reshard.grpo_cpu.config import FaultSettings, GrpoRunConfig, RefitSettings
from nemo_refit_reshard.grpo_cpu.driver import RefitEvent, run_grpo
from nemo_refit_reshard.grpo_cpu.trainer import GrpoConfig
from nemo_refit_reshard.integrations.worker.membership import DEAD, OK
from nemo_refit_reshard.spec.parallel import InferParallel, TrainParallel

TIMEOUT_S = 10.0
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_cpu.py"


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
            "refit.backend: reshard, refit.compare_broadcast: false",
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


def test_faults_with_verify_are_accepted() -> None:
    cfg = GrpoRunConfig.from_dict(
        {
            "grpo": {"num_steps": 5, "prompts_per_step": 4},
            "infer": {"tp": 2, "dp": 2},
            "refit": {"compare_broadcast": False, "verify": True},
            "faults": {"lose_engine_at_step": 2, "add_engine_at_step": 4},
        }
    )
    assert cfg.refit.verify and cfg.faults.active


def test_the_lines_said_while_engines_come_and_go() -> None:
    assert elastic.lost_engine_line("step 5", 1, "rank 0 dead", 60.0, 5, (0,)) == (
        "step 5: engine 1 lost (rank 0 dead); waiting up to 60 s (refit.timeout_s) for the "
        "other refit ranks to time out, then engine 0 refits step 5 again on a plan without "
        "engine 1"
    )
    assert elastic.lost_engine_line("step 5", 0, "rank 1 dead", 60.0, 5, (1, 2)) == (
        "step 5: engine 0 lost (rank 1 dead); waiting up to 60 s (refit.timeout_s) for the "
        "other refit ranks to time out, then engines 1,2 refit step 5 again on a plan without "
        "engine 0"
    )
    catch_up = "before step 10, catch-up to step 9"
    assert elastic.lost_engine_line(catch_up, 1, "rank 0 dead", 60.0, 9, ()) == (
        "before step 10, catch-up to step 9: engine 1 lost (rank 0 dead); waiting up to 60 s "
        "(refit.timeout_s) for the other refit ranks to time out, then the run goes on "
        "without it"
    )
    assert elastic.waiting_line("step 5", 30.0, 60.0) == (
        "step 5: still waiting for the other refit ranks to time out (30 s of their 60 s deadline)"
    )
    assert elastic.verified_line(catch_up, (1,), 35, 2) == (
        "before step 10, catch-up to step 9: refit.verify: engine 1 bit-exact "
        "(35 destination tensors on 2 ranks)"
    )


class TransportError(Exception):
    """Stands in for the transport's error (only its type name is read)."""


class _FakeRay:
    """``ray.wait`` / ``ray.get`` over scripted calls on a fake clock: each call (its
    ref is its party) ends ``after`` seconds from the start with a value or an error."""

    def __init__(self, script: dict[tuple, tuple[float, Any]]) -> None:
        self.now = 1000.0
        self.ends = {party: (self.now + after, value) for party, (after, value) in script.items()}

    def clock(self) -> float:
        return self.now

    def wait(self, refs: list, num_returns: int, timeout: float) -> tuple[list, list]:
        first = min(refs, key=lambda r: self.ends[r][0])
        if self.ends[first][0] <= self.now + timeout:
            self.now = max(self.now, self.ends[first][0])
            return [first], [r for r in refs if r != first]
        self.now += timeout
        return [], refs

    def get(self, ref: tuple) -> Any:
        value = self.ends[ref][1]
        if isinstance(value, BaseException):
            raise value
        return value


def _fake_parties(monkeypatch, script: dict[tuple, tuple[float, Any]], verify: bool):
    """RayParties over 2 training actors and 2 engines of tp=2 whose refit calls end as
    ``script`` says; the lines they say, and the group of every party in ``script``
    (engine ranks numbered after the training ranks in engine order, as a group's are)."""
    ray = pytest.importorskip("ray")
    from ray.exceptions import RayActorError, RayError

    class TaskError(RayError):
        """Ray's error for a call that raised: the actor's exception as ``cause``."""

        def __init__(self, cause: BaseException) -> None:
            super().__init__(str(cause))
            self.cause = cause

    def ending(value: Any) -> Any:
        if value == DEAD:
            return RayActorError()
        return TaskError(value) if isinstance(value, BaseException) else value

    fake = _FakeRay({party: (after, ending(value)) for party, (after, value) in script.items()})
    monkeypatch.setattr(ray, "wait", fake.wait)
    monkeypatch.setattr(ray, "get", fake.get)

    class Handle:
        def __init__(self, party: tuple) -> None:
            self.refit = SimpleNamespace(remote=lambda backend, step, check: party)

    trainers = [ActorInfo("training", r, r, handle=Handle(("training", r))) for r in range(2)]
    generators = [
        ActorInfo("generation", 2 + d, d, d // 2, d % 2, handle=Handle(("engine", d // 2, d % 2)))
        for d in range(4)
    ]
    cfg = GrpoRunConfig(refit=RefitSettings(compare_broadcast=False, verify=verify))
    cluster = SimpleNamespace(cfg=cfg, trainers=trainers, generators=generators)
    said: list[str] = []
    parties = elastic.RayParties(cluster, say=said.append)
    parties.clock = fake.clock
    ordered = sorted(script, key=lambda p: (p[0] != "training", p[1:]))
    group = SimpleNamespace(
        engines=tuple(sorted({p[1] for p in script if p[0] == "engine"})),
        endpoints={p: SimpleNamespace(group_rank=i) for i, p in enumerate(ordered)},
    )
    return parties, group, said


def test_a_lost_engine_is_said_at_once_and_the_wait_every_15_s(monkeypatch) -> None:
    """Engine 1's rank 0 dies 0.5 s into step 5's refit; the others raise the transport's
    timeout 60.2 s in: one line at 0.5 s, then one at 15, 30, 45 and 60 s."""
    timeout = TransportError("refit step 5: no progress for 60 s")
    script = {
        ("training", 0): (60.2, timeout),
        ("training", 1): (60.2, timeout),
        ("engine", 0, 0): (60.2, timeout),
        ("engine", 0, 1): (60.2, timeout),
        ("engine", 1, 0): (0.5, DEAD),
        ("engine", 1, 1): (60.2, timeout),
    }
    parties, group, said = _fake_parties(monkeypatch, script, verify=False)
    outcomes = parties.refit(group, 5)
    assert outcomes[("engine", 1, 0)] == DEAD
    assert outcomes[("engine", 1, 1)] == (
        "raised TransportError: refit step 5: no progress for 60 s"
    )
    assert said == [
        "step 5: engine 1 lost (rank 0 dead); waiting up to 60 s (refit.timeout_s) for the "
        "other refit ranks to time out, then engine 0 refits step 5 again on a plan without "
        "engine 1",
        *(
            f"step 5: still waiting for the other refit ranks to time out ({s} s of their "
            "60 s deadline)"
            for s in (15, 30, 45, 60)
        ),
    ]


def _result(checksums: dict[tuple[int, str], int]) -> dict[str, Any]:
    return {"seconds": 0.01, "checksums": checksums}


def test_verify_checks_a_group_by_its_own_ranks(monkeypatch) -> None:
    """Engine 1 alone with the training ranks (engine 0 fenced, or a catch-up): its ranks
    are group ranks 2 and 3. A match says so; a mismatch names the actor of group rank 3
    (engine 1's tp rank 1, refit rank 5 of the full plan), not the full plan's rank 3."""
    sent = {
        ("training", 0): (0.1, _result({(2, "qkv_proj"): 5, (3, "qkv_proj"): 3})),
        ("training", 1): (0.1, _result({(3, "qkv_proj"): 4})),
    }
    good = {
        **sent,
        ("engine", 1, 0): (0.1, _result({(2, "qkv_proj"): 5})),
        ("engine", 1, 1): (0.1, _result({(3, "qkv_proj"): 7})),
    }
    parties, group, said = _fake_parties(monkeypatch, good, verify=True)
    parties.label = "before step 4, catch-up to step 3"
    assert set(parties.refit(group, 3).values()) == {OK}
    assert parties.take_verified() == [
        "before step 4, catch-up to step 3: refit.verify: engine 1 bit-exact "
        "(2 destination tensors on 2 ranks)"
    ]
    assert parties.take_verified() == [] and said == []

    bad = {**good, ("engine", 1, 1): (0.1, _result({(3, "qkv_proj"): 8}))}
    parties, group, _ = _fake_parties(monkeypatch, bad, verify=True)
    with pytest.raises(RefitVerifyError) as err:
        parties.refit(group, 3)
    assert str(err.value) == (
        "step 3, refit (reshard): checksum mismatch in 1 destination tensor(s):\n  "
        "generation actor replica 1 tp rank 1 (inference rank 3, refit rank 5): qkv_proj "
        "(received 0x0000000000000008, sent 0x0000000000000007)"
    )


def _example_main():
    spec = importlib.util.spec_from_file_location("grpo_cpu_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.slow
def test_the_example_with_faults_and_verify_checks_every_engine(
    ray_session, monkeypatch, capsys
) -> None:
    """``examples/grpo_cpu.py`` with an engine lost in step 2 and back before step 4,
    ``refit.verify=true``: every refit is checked over the engines that ran it, the
    newcomer's catch-up included, and the wait for the lost engine is said at once."""
    monkeypatch.setattr(elastic, "WAIT_PROGRESS_S", 1e6)  # lines by time: not in this test
    argv = [
        "faults.lose_engine_at_step=2",
        "faults.add_engine_at_step=4",
        "refit.compare_broadcast=false",
        "refit.verify=true",
        f"refit.timeout_s={TIMEOUT_S:.0f}",
        "grpo.num_steps=5",
        "grpo.prompts_per_step=4",
        "grpo.group_size=4",
        "model.hidden_size=64",
        "model.intermediate_size=128",
    ]
    assert _example_main()(argv) == 0
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    both = "engines 0,1 bit-exact (70 destination tensors on 4 ranks)"
    one = "bit-exact (35 destination tensors on 2 ranks)"
    assert [line for line in lines if re.match(r"(before )?step \d+[:,]", line)] == [
        f"step 0: refit.verify: {both}",
        f"step 1: refit.verify: {both}",
        "step 2: engine 1 lost (rank 0 dead); waiting up to 10 s (refit.timeout_s) for the "
        "other refit ranks to time out, then engine 0 refits step 2 again on a plan without "
        "engine 1",
        "step 2: engine 1 fenced (step 2: rank 0 dead)",
        f"step 2: refit.verify: engine 0 {one}",
        f"step 3: refit.verify: engine 0 {one}",
        "before step 4: engine 1 serving",
        f"before step 4, catch-up to step 3: refit.verify: engine 1 {one}",
        f"step 4: refit.verify: {both}",
        f"step 5: refit.verify: {both}",
    ]
    steps = [re.search(r"engines (\S+)", line) for line in lines if re.match(r"step +\d+  ", line)]
    assert [m[1] for m in steps if m] == ["0,1", "0", "0", "0,1", "0,1"]
    assert lines[lines.index("engine      ranks  status    version  note") + 1 :][:2] == [
        "     0        0-1  serving         5",
        "     1        2-3  serving         5  caught up to step 3",
    ]
