"""The driver's side of engines that come and go (``integrations/worker/membership.py``):
whom a failed step's outcomes blame, and the membership's record and groups."""

from __future__ import annotations

import pytest

from nemo_refit_reshard.integrations.worker.membership import (
    Membership,
    TrainingRankFailed,
    engines_to_fence,
    refit_step,
)
from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.plan.membership import MembershipPlans
from nemo_refit_reshard.spec import InferParallel, TrainParallel
from tests.helpers.elastic_parties import SPEC

PEER = "raised TransportError: refit rank 0: step 2 round 1: receive with rank 3 failed"


def test_dead_or_silent_ranks_are_blamed_before_raising_ones() -> None:
    outcomes = {
        ("training", 0): PEER,
        ("engine", 0, 0): "raised RuntimeError: CUDA out of memory",
        ("engine", 1, 0): "ok",
        ("engine", 1, 1): "dead",
        ("engine", 2, 0): "silent",
        ("engine", 3, 0): PEER,
    }
    assert engines_to_fence(outcomes) == {1: "rank 1 dead", 2: "rank 0 silent"}
    outcomes[("engine", 1, 1)] = outcomes[("engine", 2, 0)] = PEER
    assert engines_to_fence(outcomes) == {0: "rank 0 raised RuntimeError: CUDA out of memory"}
    outcomes[("engine", 0, 0)] = PEER  # everyone a victim: nobody to fence, try again
    assert engines_to_fence(outcomes) == {}


def test_a_failed_training_rank_stops_the_run() -> None:
    with pytest.raises(TrainingRankFailed) as err:
        engines_to_fence({("training", 1): "dead", ("engine", 0, 0): PEER})
    assert str(err.value) == (
        "training rank 1 failed the refit (dead): the run cannot continue without it; "
        "restart the run from its last checkpoint"
    )


def test_membership_records_and_groups() -> None:
    tp, ip = TrainParallel(tp=2), InferParallel(tp=2, dp=3)
    src = [megatron_layout(SPEC, tp, r) for r in range(2)]
    dst = [vllm_layout(SPEC, ip, r) for r in range(6)]
    plan = plan_refit(SPEC, src, dst, 0.05, relay="none")
    plans = MembershipPlans(plan, SPEC, src, dst, ((0, 1), (2, 3), (4, 5)))
    membership = Membership(plans, timeout_s=5)
    group = membership.group()
    assert group.engines == (0, 1, 2) and group.plan.how == "full"
    ranks = {p: e.group_rank for p, e in group.endpoints.items()}
    assert ranks == {
        ("training", 0): 0, ("training", 1): 1, ("engine", 0, 0): 2, ("engine", 0, 1): 3,
        ("engine", 1, 0): 4, ("engine", 1, 1): 5, ("engine", 2, 0): 6, ("engine", 2, 1): 7,
    }  # fmt: skip
    assert len({(e.port, e.secret) for e in group.endpoints.values()}) == 1
    membership.refitted((0, 1, 2), 1)
    membership.fence(1, "step 2: rank 0 dead")
    after = membership.group()
    assert after.plan.how == "derived" and after.plan.plan.num_destinations == 4
    # the cache keeps what the next failure can need: the full plan, the set serving and
    # each set of it less one (the last two maybe still being derived ahead)
    cached = set(membership.plans.cached_sets())
    assert {(0, 1, 2), (0, 2)} <= cached <= {(0, 1, 2), (0, 2), (0,), (2,)}, cached
    assert {p: e.group_rank for p, e in after.endpoints.items() if p[0] == "engine"} == {
        ("engine", 0, 0): 2, ("engine", 0, 1): 3, ("engine", 2, 0): 4, ("engine", 2, 1): 5,
    }  # fmt: skip
    assert after.endpoints[("training", 0)].port != group.endpoints[("training", 0)].port
    with pytest.raises(ValueError) as err:
        membership.admit(0)
    assert str(err.value) == "engine 0 is already serving; fence it before admitting"
    with pytest.raises(ValueError) as err:
        membership.catch_up(1)
    assert str(err.value) == "engine 1 is not joining: admit it first"
    membership.admit(1)
    assert membership.catch_up(1).engines == (1,)
    membership.refitted((1,), 1)
    assert str(membership) == "\n".join(
        [
            "engine      ranks  status    version  note",
            "     0        0-1  serving         1  ",
            "     1        2-3  serving         1  caught up to step 1",
            "     2        4-5  serving         1  ",
        ]
    )
    for e in range(3):
        membership.fence(e, "gone")
    with pytest.raises(RuntimeError) as err2:
        membership.group()
    assert str(err2.value) == (
        "no engine is serving: admit one (Membership.admit) before the next refit"
    )


class ScriptedParties:
    """``Parties`` whose outcomes are scripted per call (what failed, by party)."""

    def __init__(self, refits: list[dict], joins: list[dict] | None = None) -> None:
        self.refits, self.joins = refits, joins or []
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def _outcomes(self, group, script: list[dict]) -> dict:
        faults = script.pop(0) if script else {}
        return {p: faults.get(p, "ok") for p in group.endpoints}

    def join(self, group):
        self.calls.append(("join", group.engines))
        return self._outcomes(group, self.joins)

    def refit(self, group, step):
        self.calls.append(("refit", group.engines))
        return self._outcomes(group, self.refits)


def _membership() -> Membership:
    tp, ip = TrainParallel(tp=2), InferParallel(tp=2, dp=3)
    src = [megatron_layout(SPEC, tp, r) for r in range(2)]
    dst = [vllm_layout(SPEC, ip, r) for r in range(6)]
    plan = plan_refit(SPEC, src, dst, 0.05, relay="none")
    return Membership(
        MembershipPlans(plan, SPEC, src, dst, ((0, 1), (2, 3), (4, 5))), derive_ahead=False
    )


def test_refit_step_retries_an_unblamed_failure_once_then_raises() -> None:
    membership = _membership()
    parties = ScriptedParties([{("training", 0): PEER}, {}])
    group = refit_step(membership, parties, membership.group(), 4)
    assert group.engines == (0, 1, 2) and parties.calls == [
        ("refit", (0, 1, 2)), ("join", (0, 1, 2)), ("refit", (0, 1, 2)),
    ]  # fmt: skip
    parties = ScriptedParties([{("training", 0): PEER}, {("engine", 1, 1): PEER}])
    with pytest.raises(RuntimeError) as err:
        refit_step(membership, parties, group, 5)
    assert str(err.value) == (
        f"the refit of step 5 failed twice with no engine to blame: ('engine', 1, 1): {PEER}"
    )


def test_an_engine_that_fails_to_join_is_fenced_too() -> None:
    membership = _membership()
    parties = ScriptedParties(
        [{("engine", 0, 0): "dead"}], joins=[{("engine", 2, 1): "raised OSError: no route"}]
    )
    group = refit_step(membership, parties, membership.group(), 3)
    assert group.engines == (1,)
    assert parties.calls == [
        ("refit", (0, 1, 2)), ("join", (1, 2)), ("join", (1,)), ("refit", (1,)),
    ]  # fmt: skip
    assert [(r.status, r.version, r.note) for r in membership.engines.values()] == [
        ("fenced", None, "step 3: rank 0 dead"),
        ("serving", 3, ""),
        ("fenced", None, "step 3, joining: rank 1 raised OSError: no route"),
    ]
