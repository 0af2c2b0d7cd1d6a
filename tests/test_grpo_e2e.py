"""End-to-end GRPO on Ray: Megatron training actors refit vLLM-layout generation actors.

Every run uses the 2-layer toy policy in float32 and one shared Ray session:

* after every refit (step 0 and each GRPO step), the canonical weights reassembled from
  the generation actors equal those of the training actors bit for bit, and the
  generator's and trainer's log-probabilities of the sampled tokens agree within 1e-5
  (reshard, broadcast, and a pp=2/dp=2 trainer with both backends and checksums);
* that comparison catches a deliberately broken plan (one tensor never sent), and
  ``refit.verify`` raises on it, naming the tensor;
* a generation actor that dies mid-refit fails the step with an error naming it,
  well within ``refit.timeout_s``, and every actor is shut down.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch

from nemo_refit_reshard.grpo_cpu.cluster import GrpoActorError, RefitVerifyError
from nemo_refit_reshard.grpo_cpu.config import GrpoRunConfig, RefitSettings
from nemo_refit_reshard.grpo_cpu.driver import RefitEvent, run_grpo
from nemo_refit_reshard.grpo_cpu.report import StepReport
from nemo_refit_reshard.grpo_cpu.trainer import GrpoConfig
from nemo_refit_reshard.spec.parallel import InferParallel, TrainParallel

pytestmark = pytest.mark.slow

DROPPED = "model.layers.1.mlp.down_proj.weight"
TIMEOUT_S = 10.0


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield
    ray.shutdown()


def config(
    train: str = "tp=2",
    infer: str = "tp=2,dp=2",
    steps: int = 2,
    **refit: Any,
) -> GrpoRunConfig:
    return GrpoRunConfig(
        train=TrainParallel.parse(train),
        infer=InferParallel.parse(infer),
        grpo=GrpoConfig(prompts_per_step=4, group_size=4),
        num_steps=steps,
        refit=RefitSettings(**{"timeout_s": TIMEOUT_S, "compare_broadcast": False, **refit}),
        progress=False,
    )


class WeightCheck:
    """``after_refit`` hook: generator weights must equal the trainer's, bit for bit."""

    def __init__(self) -> None:
        self.checked: list[tuple[int, str]] = []

    def __call__(self, event: RefitEvent) -> None:
        want = event.cluster.trainer_canonical()
        got = event.cluster.generator_canonical()
        assert want.keys() == got.keys()
        bad = sorted(n for n in want if not torch.equal(want[n], got[n]))
        assert not bad, f"step {event.step} ({event.backend}): generator differs in {bad}"
        self.checked.append((event.step, event.backend))


def _check_reports(reports: list[StepReport], cfg: GrpoRunConfig) -> None:
    assert [r.step for r in reports] == list(range(1, cfg.num_steps + 1))
    for r in reports:
        assert r.max_logprob_diff < 1e-5, r
        assert set(r.refit_seconds) == set(cfg.refit.backends)
        assert all(0 < s < TIMEOUT_S for s in r.refit_seconds.values())
        assert 0.0 <= r.reward <= 1.0 and r.metrics["grad_norm"] > 0


@pytest.mark.parametrize("backend", ["reshard", "broadcast"])
def test_refit_makes_generator_equal_trainer(backend: str) -> None:
    cfg = config(backend=backend)
    check = WeightCheck()
    reports = run_grpo(cfg, after_refit=check)
    assert check.checked == [(0, backend), (1, backend), (2, backend)]
    _check_reports(reports, cfg)
    if backend == "reshard":  # the plan moves each destination element once
        assert reports[0].refit_bytes["reshard"] < 0.5 * _broadcast_bytes(cfg)


def _broadcast_bytes(cfg: GrpoRunConfig) -> int:
    from nemo_refit_reshard.grpo_cpu.plans import build_layouts
    from nemo_refit_reshard.plan import plan_broadcast

    spec, sources, destinations = build_layouts(cfg.policy, cfg.train, cfg.infer, "float32")
    return plan_broadcast(spec, sources, destinations).total_bytes


def test_pipeline_and_data_parallel_trainer_both_backends_verified() -> None:
    """pp=2 x dp=2 training ranks -> two tp=1 generation replicas (no replica world);
    each step refits with broadcast, then reshard, with checksums on."""
    cfg = config(train="pp=2,dp=2", infer="tp=1,dp=2", compare_broadcast=True, verify=True)
    check = WeightCheck()
    reports = run_grpo(cfg, after_refit=check)
    assert check.checked == [(s, b) for s in range(3) for b in ("broadcast", "reshard")]
    _check_reports(reports, cfg)


def test_broken_refit_is_caught_by_the_weight_comparison() -> None:
    cfg = dataclasses.replace(config(steps=1), test_only_drop_tensor=DROPPED)
    with pytest.raises(
        AssertionError, match=rf"step 0 \(reshard\): generator differs in \['{DROPPED}'\]"
    ):
        run_grpo(cfg, after_refit=WeightCheck())


def test_verify_raises_on_the_broken_refit_naming_the_tensor() -> None:
    cfg = dataclasses.replace(config(steps=1, verify=True), test_only_drop_tensor=DROPPED)
    with pytest.raises(RefitVerifyError) as info:
        run_grpo(cfg)
    text = str(info.value)
    assert text.startswith("step 0, refit (reshard): checksum mismatch in 4 destination tensor(s)")
    assert f"refit rank 2): {DROPPED} (received" in text  # inference rank 0 = refit rank 2
    assert text.count(DROPPED) == 4  # on every generation rank, and nothing else


def test_generation_actor_dying_mid_refit_fails_the_step_promptly() -> None:
    # replica 1, tp rank 0 = inference rank 2 = refit rank 4 (after 2 training ranks)
    cfg = dataclasses.replace(config(steps=3), test_only_exit=(4, 2))
    events: list[RefitEvent] = []
    t_last = [0.0]

    def remember(event: RefitEvent) -> None:
        events.append(event)
        t_last[0] = time.monotonic()

    with pytest.raises(GrpoActorError) as info:
        run_grpo(cfg, after_refit=remember)
    failed_after = time.monotonic() - t_last[0]  # generate + train + the failing refit
    text = str(info.value)
    assert text.startswith(
        "step 2, refit (reshard) failed: generation actor replica 1 tp rank 0 "
        "(inference rank 2, refit rank 4) died"
    ), text
    assert info.value.dead == [
        "generation actor replica 1 tp rank 0 (inference rank 2, refit rank 4)"
    ]
    assert [e.step for e in events] == [0, 1]
    assert failed_after < TIMEOUT_S, failed_after  # Ray reports the death; no transport wait

    # every actor was shut down (ray.kill is asynchronous: poll until each one is gone)
    deadline = time.monotonic() + 30
    alive = list(events[-1].cluster.actors)
    while alive and time.monotonic() < deadline:
        alive = [a for a in alive if _answers(a.handle)]
        time.sleep(0.2)
    assert alive == [], [str(a) for a in alive]


def _answers(handle: Any) -> bool:
    import ray
    from ray.exceptions import RayActorError

    try:
        ray.get(handle.describe.remote(), timeout=30)
        return True
    except RayActorError:
        return False


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError) as info:
        GrpoRunConfig.from_dict({"refit": {"backend": "nccl"}})
    assert str(info.value) == "unknown refit.backend 'nccl'; choose one of: reshard, broadcast"
