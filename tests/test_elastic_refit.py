"""Engines come and go between steps (``integrations/worker/membership.py``), with real
processes over gloo: an engine killed in a round of a step, one hung, two lost in one
step, a restarted engine admitted, a new one admitted while another leaves. In each,
the engines left end bit-exact at the step, a newcomer bit-exact after its catch-up,
the training ranks' failed attempt ends within one deadline, and the driver's view
(one printable object) matches what every engine reports it holds."""

from __future__ import annotations

import pytest

from nemo_refit_reshard.engine.delta import DeltaOptions
from nemo_refit_reshard.integrations.worker.membership import (
    Membership,
    admit_engine,
    refit_step,
)
from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.plan.membership import MembershipPlans
from nemo_refit_reshard.spec import InferParallel, TrainParallel
from tests.helpers.elastic_parties import SPEC, ProcessParties

TIMEOUT_S = 15.0  # every wait of a refit (a tiny model: ms); a failed attempt ends within it
DELTA_FORMS = {"positions", "gaps", "bitmap"}  # every form but dense


def _run(train: str, infer: str, delta: DeltaOptions | None = None):
    tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
    src = [megatron_layout(SPEC, tp, r) for r in range(tp.world_size)]
    dst = [vllm_layout(SPEC, ip, r) for r in range(ip.world_size)]
    plan = plan_refit(SPEC, src, dst, 0.05, relay="none")
    n = ip.engine_world_size
    engines = tuple(tuple(range(e * n, (e + 1) * n)) for e in range(ip.dp))
    membership = Membership(
        MembershipPlans(plan, SPEC, src, dst, engines), timeout_s=TIMEOUT_S,
        connect_timeout_s=600, delta=delta,
    )  # fmt: skip
    parties = ProcessParties(
        train, infer, deadline_s=4 * TIMEOUT_S, settle_s=TIMEOUT_S, sparse=delta is not None
    )
    for r in range(tp.world_size):
        parties.start(("training", r))
    for e in range(ip.dp):
        parties.start_engine(e)
    return membership, parties


def _holds(parties: ProcessParties, membership: Membership, step: int) -> None:
    """Every serving engine reports ``step``, whole and bit-exact, as the driver says."""
    serving = list(membership.serving)
    for party, report in parties.reports(serving).items():
        assert report["weights"]["step"] == step, (party, report)
        assert report["weights"]["stale"] is None and report["mismatches"] == 0, (party, report)
    assert all(membership.engines[e].version == step for e in serving)


def _failed_attempt(parties: ProcessParties, step: int) -> dict:
    first = next(c for c in parties.calls if c["step"] == step)
    # the training ranks' failed attempt ended within one deadline (plus a loaded
    # machine's slack), not at the driver's
    trainers = [s for p, s in first["answered_s"].items() if p[0] == "training"]
    assert max(trainers) < 2 * TIMEOUT_S, first
    return first["outcomes"]


@pytest.mark.slow
def test_killed_hung_and_restarted_engines() -> None:
    membership, parties = _run("tp=2", "tp=2,dp=3")
    try:
        group = membership.group()
        assert set(parties.join(group).values()) == {"ok"}
        parties.train_to(1)
        group = refit_step(membership, parties, group, 1)
        _holds(parties, membership, 1)

        # engine 1's first rank dies when round 1 of step 2 starts
        parties.train_to(2)
        parties.faults[(("engine", 1, 0), 2)] = ("die", 1)
        group = refit_step(membership, parties, group, 2)
        outcomes = _failed_attempt(parties, 2)
        assert outcomes[("engine", 1, 0)] == "dead"
        assert outcomes[("training", 0)].startswith("raised TransportError: ")
        assert group.engines == (0, 2) and group.plan.how == "derived"
        parties.stop_engine(1)
        _holds(parties, membership, 2)
        parties.train_to(3)
        group = refit_step(membership, parties, group, 3)
        _holds(parties, membership, 3)

        # engine 1 restarted: caught up to step 3 alone, then in the plan again
        parties.start_engine(1)
        group = admit_engine(membership, parties, 1, 3)
        assert group.engines == (0, 1, 2) and group.plan.how == "full"
        _holds(parties, membership, 3)
        parties.train_to(4)
        group = refit_step(membership, parties, group, 4)
        _holds(parties, membership, 4)

        # engine 2's second rank hangs in round 0 of step 5
        parties.train_to(5)
        parties.faults[(("engine", 2, 1), 5)] = ("hang", 0)
        group = refit_step(membership, parties, group, 5)
        assert _failed_attempt(parties, 5)[("engine", 2, 1)] == "silent"
        parties.stop_engine(2)
        assert group.engines == (0, 1)
        _holds(parties, membership, 5)
        assert str(membership) == "\n".join(
            [
                "engine      ranks  status    version  note",
                "     0        0-1  serving         5  ",
                "     1        2-3  serving         5  caught up to step 3",
                "     2        4-5  fenced          -  step 5: rank 1 silent",
            ]
        )
    finally:
        parties.close()


@pytest.mark.slow
def test_two_lost_in_one_step_then_one_admitted_while_another_leaves() -> None:
    membership, parties = _run("tp=2", "tp=1,dp=4")
    try:
        group = membership.group()
        assert set(parties.join(group).values()) == {"ok"}
        parties.train_to(1)
        group = refit_step(membership, parties, group, 1)

        # engines 1 and 3 die in step 2 (rounds 0 and 1): one attempt fences both
        parties.train_to(2)
        parties.faults[(("engine", 1, 0), 2)] = ("die", 0)
        parties.faults[(("engine", 3, 0), 2)] = ("die", 1)
        group = refit_step(membership, parties, group, 2)
        assert [c["engines"] for c in parties.calls if c["step"] == 2] == [(0, 1, 2, 3), (0, 2)]
        parties.stop_engine(1)
        parties.stop_engine(3)
        _holds(parties, membership, 2)

        # engine 3 restarted and admitted; in the next step engine 0 raises
        parties.start_engine(3)
        group = admit_engine(membership, parties, 3, 2)
        parties.train_to(3)
        parties.faults[(("engine", 0, 0), 3)] = ("raise", 1)
        group = refit_step(membership, parties, group, 3)
        assert _failed_attempt(parties, 3)[("engine", 0, 0)] == "raised RuntimeError: injected"
        assert group.engines == (2, 3)
        _holds(parties, membership, 3)
        assert [(e, r.status, r.version, r.note) for e, r in membership.engines.items()] == [
            (0, "fenced", None, "step 3: rank 0 raised RuntimeError: injected"),
            (1, "fenced", None, "step 2: rank 0 dead"),
            (2, "serving", 3, ""),
            (3, "serving", 3, "caught up to step 2"),
        ]
    finally:
        parties.close()


@pytest.mark.slow
def test_delta_refit_goes_on_across_membership_changes() -> None:
    """With delta refit: the retry after a loss is dense (its ranks are torn); the next
    step on the plan for the engines left goes as deltas; a restarted engine's catch-up
    is dense, and the step after its admission goes as deltas to every engine, the
    newcomer included (the group was primed with the version all of them hold)."""
    membership, parties = _run("tp=2", "tp=1,dp=3", delta=DeltaOptions())
    trainers = [("training", 0), ("training", 1)]

    def forms(parties_: list[tuple]) -> set[str]:
        """Every form the last step's messages of ``parties_`` went in (none: empty)."""
        out: set[str] = set()
        for report in parties.delta(parties_).values():
            out |= set(report["forms"]) | set(report["received"])
        assert out, "no message"
        return out

    try:
        group = membership.group()
        assert set(parties.join(group).values()) == {"ok"}
        for step in (1, 2):
            parties.train_to(step)
            group = refit_step(membership, parties, group, step)
        assert forms(trainers) <= DELTA_FORMS  # one element per tensor changed
        _holds(parties, membership, 2)

        parties.train_to(3)
        parties.faults[(("engine", 2, 0), 3)] = ("die", 0)
        group = refit_step(membership, parties, group, 3)
        parties.stop_engine(2)
        assert forms(trainers) == {"dense"}  # the retry: the survivors were torn
        parties.train_to(4)
        group = refit_step(membership, parties, group, 4)
        assert forms(trainers) <= DELTA_FORMS
        _holds(parties, membership, 4)

        parties.start_engine(2)
        group = admit_engine(membership, parties, 2, 4)
        assert group.version == 4 and group.engines == (0, 1, 2)
        parties.train_to(5)
        group = refit_step(membership, parties, group, 5)
        engines = [("engine", e, 0) for e in range(3)]
        assert forms(trainers) <= DELTA_FORMS and forms(engines) <= DELTA_FORMS
        _holds(parties, membership, 5)
    finally:
        parties.close()
