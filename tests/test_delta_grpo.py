"""Delta refit in the CPU GRPO app (``refit.delta``), end to end on Ray.

A short GRPO run (Megatron tp=2 training actors -> two vLLM-layout tp=2 BF16 replicas)
with real GRPO steps between refits, at a learning rate whose Adam steps leave most
BF16 elements as they were (RL's regime), and ``refit.verify`` on:

* after every refit (step 0 and each GRPO step) the generator's canonical weights equal
  the trainer's cast to BF16, bit for bit, and the checksums of every delta step agree
  (``refit.verify`` raises otherwise);
* the training actors sent fewer bytes than the same messages weigh dense in every
  delta step (step 0, the first refit, is dense: nothing is held yet), and the step
  report carries those figures;
* every step changed some BF16 weights (the deltas are not empty by accident);
* the config refuses a delta refit the app cannot honour, saying what to set.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nemo_refit_reshard.engine.delta import DeltaOptions
from nemo_refit_reshard.grpo_cpu.config import GrpoRunConfig, RefitSettings
from nemo_refit_reshard.grpo_cpu.driver import RefitEvent, run_grpo
from nemo_refit_reshard.grpo_cpu.report import format_step, summary
from nemo_refit_reshard.grpo_cpu.trainer import GrpoConfig
from nemo_refit_reshard.spec.parallel import InferParallel, TrainParallel

TIMEOUT_S = 10.0


def delta_config(steps: int = 3, **refit: Any) -> GrpoRunConfig:
    return GrpoRunConfig(
        train=TrainParallel.parse("tp=2"),
        infer=InferParallel.parse("tp=2,dp=2"),
        infer_dtype="bfloat16",
        # Adam steps of ~1e-5 on weights of ~0.02: a few percent of BF16 elements change
        grpo=GrpoConfig(prompts_per_step=4, group_size=4, lr=1e-5),
        num_steps=steps,
        refit=RefitSettings(
            timeout_s=TIMEOUT_S, compare_broadcast=False, verify=True, delta=True, **refit
        ),
        progress=False,
    )


class DeltaCheck:
    """``after_refit``: bit-exact in BF16, the step's delta bytes, BF16 elements changed."""

    def __init__(self) -> None:
        self.delta: dict[int, tuple[int, int] | None] = {}
        self.changed: dict[int, int] = {}
        self.previous: dict[str, torch.Tensor] | None = None

    def __call__(self, event: RefitEvent) -> None:
        # BF16 both: the generator's values, exactly, and the trainer's cast as on the wire
        got = {n: t.to(torch.bfloat16) for n, t in event.cluster.generator_canonical().items()}
        want = {n: t.to(torch.bfloat16) for n, t in event.cluster.trainer_canonical().items()}
        assert want.keys() == got.keys()
        bad = sorted(n for n in want if not torch.equal(want[n], got[n]))
        assert not bad, f"step {event.step}: generator differs in {bad}"
        if self.previous is not None:
            self.changed[event.step] = sum(
                int((want[n].view(torch.int16) != self.previous[n].view(torch.int16)).sum())
                for n in want
            )
        self.previous = want
        self.delta[event.step] = event.cluster.last_delta


@pytest.mark.slow
def test_delta_grpo_run_is_verified_and_sends_less_than_dense() -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        cfg = delta_config()
        check = DeltaCheck()
        reports = run_grpo(cfg, after_refit=check)
    finally:
        ray.shutdown()
    assert sorted(check.delta) == [0, 1, 2, 3]
    first = check.delta[0]
    assert first is not None and first[0] >= first[1] > 0  # dense, plus its headers
    for r in reports:
        assert r.metrics["grad_norm"] > 0, r  # a real GRPO update before each refit
        assert check.changed[r.step] > 0, (r.step, check.changed)
        assert r.delta_bytes == check.delta[r.step]
        sent, dense = r.delta_bytes
        assert dense == first[1] and 0 < sent < dense, (r.step, r.delta_bytes)
        assert "delta sent " in format_step(r, "reshard")
    assert "delta refit: sent " in summary(reports, "reshard", 1.0)


def test_delta_settings_reach_every_endpoint() -> None:
    cfg = GrpoRunConfig.from_dict(
        {"refit": {"delta": True, "delta_anchor_every": 4, "compare_broadcast": False}}
    )
    assert cfg.refit.delta_options == DeltaOptions(anchor_every=4)
    assert GrpoRunConfig.from_dict({}).refit.delta_options is None  # the YAML's default


@pytest.mark.parametrize(
    "refit, message",
    [
        (
            {"delta": True, "backend": "broadcast", "compare_broadcast": False},
            "refit.delta: true needs refit.backend: reshard (a delta refit sends the reshard "
            "plan's messages in their smallest form; 'broadcast' has no such messages); set "
            "refit.backend: reshard, or refit.delta: false",
        ),
        (
            {"delta": True},
            "refit.delta: true with refit.compare_broadcast: true: the broadcast comparison "
            "would write every weight before the delta refit",
        ),
        (
            {"delta_anchor_every": 3},
            "refit.delta_anchor_every=3 applies to delta refits only; set refit.delta: true, "
            "or drop refit.delta_anchor_every",
        ),
        ({"delta": "yes"}, "refit.delta='yes' must be true or false"),
        (
            {"delta": True, "compare_broadcast": False, "delta_anchor_every": -1},
            "refit.delta_anchor_every=-1 must be an integer >= 0",
        ),
        ({"deltas": True}, r"unknown config key(s) refit.deltas; valid: "),
    ],
    ids=["broadcast", "compare", "anchor-alone", "not-bool", "negative", "unknown"],
)
def test_delta_config_errors_are_clear(refit: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        GrpoRunConfig.from_dict({"refit": refit})
    assert str(info.value).startswith(message), str(info.value)
