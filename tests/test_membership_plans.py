"""A plan per set of engines, derived from the full plan (``plan/derive_members.py``,
cached by ``plan/membership.py``): every
remaining destination gets exactly its weights (checked against the layouts by
``verify_plan`` and a simulated refit), its bytes are the full plan's, and the floor and
baseline equal those of a plan built afresh for the same engines."""

from __future__ import annotations

import functools
import threading
from itertools import combinations

import pytest

from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import (
    Cluster,
    Colocation,
    Placement,
    PlanError,
    RefitPlan,
    Topology,
    plan_refit,
)
from nemo_refit_reshard.plan import membership as membership_module
from nemo_refit_reshard.plan.membership import (
    DerivationError,
    MembershipPlans,
    derive_plan,
    narrowed_layouts,
)
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.hf_models import TINY_CONFIGS
from tests.helpers.plan_checks import assert_delivers_exactly

SPEC = spec_from_hf_config(dict(TINY_CONFIGS["llama"], torch_dtype="float32"))
MOE = spec_from_hf_config(dict(TINY_CONFIGS["qwen3_moe"], torch_dtype="float32"))


def _layouts(spec, train: TrainParallel, infer: InferParallel):
    src = [megatron_layout(spec, train, r) for r in range(train.world_size)]
    dst = [vllm_layout(spec, infer, r) for r in range(infer.world_size)]
    return src, dst


def _engines(infer: InferParallel) -> tuple[tuple[int, ...], ...]:
    n = infer.engine_world_size
    return tuple(tuple(range(e * n, (e + 1) * n)) for e in range(infer.dp))


def _check(plan: RefitPlan, keep: tuple[int, ...], spec, src, dst, **fresh_args) -> RefitPlan:
    """Derive, then check it against the layouts and a fresh plan for the same ranks."""
    derived = derive_plan(plan, keep, spec, src, dst)
    kept = narrowed_layouts(dst, keep)
    assert_delivers_exactly(derived, spec, src, kept)
    s = plan.num_sources
    assert derived.stats.bytes_received[s:] == tuple(plan.stats.bytes_received[s + d] for d in keep)
    fresh = plan_refit(spec, src, kept, plan.bucket_bytes / 2**20, **fresh_args)
    assert derived.stats.min_bytes == fresh.stats.min_bytes
    assert derived.stats.baseline_bytes == fresh.stats.baseline_bytes
    assert RefitPlan.from_json(derived.to_json()).fingerprint == derived.fingerprint
    return derived


@pytest.mark.parametrize(
    ("spec", "train", "infer"),
    [
        (SPEC, TrainParallel(tp=2), InferParallel(tp=2, dp=3)),
        (MOE, TrainParallel(ep=2, dp=2), InferParallel(tp=2, ep=2, dp=3)),
    ],
    ids=["llama", "qwen3_moe-ep"],
)
def test_every_set_of_engines_gets_exactly_its_weights(spec, train, infer) -> None:
    src, dst = _layouts(spec, train, infer)
    plan = plan_refit(spec, src, dst, 0.05, relay="none")
    engines = _engines(infer)
    for size in (1, 2):
        for chosen in combinations(range(infer.dp), size):
            keep = tuple(d for e in chosen for d in engines[e])
            derived = _check(plan, keep, spec, src, dst, relay="none")
            # without relays, the training ranks send the full plan's bytes less what the
            # engines that left received
            gone = sum(plan.stats.bytes_received[plan.num_sources + d] for d in
                       set(range(len(dst))) - set(keep))  # fmt: skip
            assert derived.stats.total_bytes == plan.stats.total_bytes - gone
            assert derived.num_rounds <= plan.num_rounds


def test_a_ring_closes_around_the_replica_that_leaves() -> None:
    """Four replicas alone on their nodes form one ring (``test_domain.py``); without one
    of them the other three still take one copy from the training GPU and forward it."""
    cluster = Cluster(gpus_per_node=1, nvlink_latency_us=0.01, nic_latency_us=0.02)
    src = [megatron_layout(SPEC, TrainParallel(), 0)]
    dst = [vllm_layout(SPEC, InferParallel(dp=4), r) for r in range(4)]
    links = Topology(cluster, Placement.packed(1, 4, cluster))
    plan = plan_refit(SPEC, src, dst, 0.05, relay="domain", links=links)
    assert plan.relay_chains == ((1, 2, 3, 4),)
    model = plan.stats.min_bytes // 4
    for leaving in range(4):
        keep = tuple(d for d in range(4) if d != leaving)
        derived = derive_plan(plan, keep, SPEC, src, dst)
        assert_delivers_exactly(derived, SPEC, src, narrowed_layouts(dst, keep))
        assert derived.relay_chains == ((1, 2, 3),)
        assert derived.stats.bytes_sent[0] == model  # still one copy leaves the trainer
        assert sum(derived.stats.bytes_sent[1:]) == 2 * model  # two hops
        # what entered at the replica that left now enters at those left: none of them
        # brings in more than half the model (the full plan: a quarter each)
        assert max(derived.stats.bytes_sent[1:]) < model * 3 // 4


def test_nvlink_domain_runs_lose_a_member_and_keep_one_copy_per_domain() -> None:
    cluster = Cluster(gpus_per_node=4)
    src, dst = _layouts(SPEC, TrainParallel(tp=2), InferParallel(tp=2, dp=4))
    links = Topology(cluster, Placement.packed(2, 8, cluster))
    plan = plan_refit(SPEC, src, dst, 0.05, relay="domain", links=links)
    assert plan.relay_chains == ((2, 4), (6, 8), (3, 5), (7, 9))
    for chosen in [(1, 2, 3), (0, 2, 3), (0, 1), (3,)]:
        keep = tuple(d for e in chosen for d in _engines(InferParallel(tp=2, dp=4))[e])
        nodes = links.placement.nodes
        kept_links = Topology(cluster, Placement(2, nodes[:2] + tuple(nodes[2 + d] for d in keep)))
        derived = _check(plan, keep, SPEC, src, dst, relay="domain", links=kept_links)
        domains = len({(d // 4) for d in keep})  # engines 0-1 on node 0, 2-3 on node 1
        assert sum(derived.stats.bytes_sent[:2]) == domains * plan.stats.min_bytes // 4


def test_a_chain_plan_is_planned_again_and_says_why() -> None:
    src, dst = _layouts(SPEC, TrainParallel(tp=2), InferParallel(tp=2, dp=3))
    plan = plan_refit(SPEC, src, dst, 0.05, relay="chain")
    engines = _engines(InferParallel(tp=2, dp=3))
    with pytest.raises(DerivationError) as err:
        derive_plan(plan, (0, 1, 4, 5), SPEC, src, dst)
    assert str(err.value) == "destination rank 4 forwards to other engines (relay='chain')"
    refused = MembershipPlans(plan, SPEC, src, dst, engines)
    with pytest.raises(DerivationError):
        refused.for_engines([0, 2])

    def replan(kept, keep):
        return plan_refit(SPEC, src, kept, 0.05, relay="chain")

    plans = MembershipPlans(plan, SPEC, src, dst, engines, replan)
    made = plans.for_engines([2, 0])
    assert made.how == "re-planned: destination rank 4 forwards to other engines (relay='chain')"
    assert made.engines == (0, 2) and made.destinations == (0, 1, 4, 5)
    assert_delivers_exactly(made.plan, SPEC, src, narrowed_layouts(dst, (0, 1, 4, 5)))


def test_a_colocated_plan_keeps_each_remaining_rank_on_its_host() -> None:
    src, dst = _layouts(SPEC, TrainParallel(tp=2, dp=2), InferParallel(tp=2, dp=2))
    plan = plan_refit(SPEC, src, dst, 0.05, colocation=Colocation((3, 2, 1, 0)))
    derived = derive_plan(plan, (2, 3), SPEC, src, dst)
    assert derived.colocated_hosts == (1, 0)
    assert_delivers_exactly(derived, SPEC, src, narrowed_layouts(dst, (2, 3)))
    assert (
        derived.colocated_bytes()
        == plan_refit(
            SPEC, src, narrowed_layouts(dst, (2, 3)), 0.05, colocation=Colocation((1, 0))
        ).colocated_bytes()
    )


def test_membership_plans_are_cached_per_set_and_checked() -> None:
    infer = InferParallel(tp=2, dp=3)
    src, dst = _layouts(SPEC, TrainParallel(tp=2), infer)
    plan = plan_refit(SPEC, src, dst, 0.05, relay="none")
    plans = MembershipPlans(plan, SPEC, src, dst, _engines(infer))
    full = plans.for_engines(range(3))
    assert (full.how, full.plan) == ("full", plan)
    one = plans.for_engines([2, 1])
    assert one is plans.for_engines((1, 2)) and one.how == "derived"
    assert one.destinations == (2, 3, 4, 5) and one.refit_rank(4) == 2 + 2
    # derived twice from the same plan: the same plan, byte for byte
    again = MembershipPlans(plan, SPEC, src, dst, _engines(infer)).for_engines([1, 2])
    assert again.plan.fingerprint == one.plan.fingerprint
    with pytest.raises(PlanError) as err:
        plans.for_engines([])
    assert str(err.value) == "engines []: choose at least one of 0..2"
    with pytest.raises(PlanError) as err:
        plans.for_engines([3])
    assert str(err.value) == "engines [3]: choose at least one of 0..2"
    with pytest.raises(PlanError) as err:
        MembershipPlans(plan, SPEC, src, dst, ((0, 1), (2, 3)))
    assert str(err.value) == (
        "engines [[0, 1], [2, 3]] must hold every destination of the plan (0..5) exactly once"
    )
    with pytest.raises(PlanError) as err:
        derive_plan(plan, (3, 2), SPEC, src, dst)
    assert str(err.value) == (
        "destinations to keep must be distinct, increasing indices below 6; got [3, 2]"
    )


def test_planning_again_replaces_the_derived_plan_for_the_next_group() -> None:
    infer = InferParallel(tp=2, dp=3)
    src, dst = _layouts(SPEC, TrainParallel(tp=2), infer)
    plan = plan_refit(SPEC, src, dst, 0.05, relay="none")

    def replan(kept, keep):
        return plan_refit(SPEC, src, kept, 0.05, relay="none")

    plans = MembershipPlans(plan, SPEC, src, dst, _engines(infer), replan)
    derived = plans.for_engines([0, 2])
    fresh = plans.plan_again([0, 2])
    assert (derived.how, fresh.how) == ("derived", "planned again")
    assert fresh.plan == replan(narrowed_layouts(dst, (0, 1, 4, 5)), (0, 1, 4, 5))
    assert plans.for_engines([2, 0]) is fresh and plans.plan_again([0, 2]) is fresh
    assert fresh.plan.num_rounds < derived.plan.num_rounds  # the fresh one packs rounds
    with pytest.raises(PlanError) as err:
        MembershipPlans(plan, SPEC, src, dst, _engines(infer)).plan_again([0])
    assert str(err.value) == "planning again needs MembershipPlans(replan=...)"


def test_plans_derived_ahead_are_ready_and_the_same() -> None:
    infer = InferParallel(tp=2, dp=3)
    src, dst = _layouts(SPEC, TrainParallel(tp=2), infer)
    plan = plan_refit(SPEC, src, dst, 0.05, relay="none")
    plans = MembershipPlans(plan, SPEC, src, dst, _engines(infer))
    done = plans.derive_ahead([(1, 2), (0, 2), (0, 1)])
    # ready, waited for, or (not reached by the thread yet) derived here: never twice
    first = plans.for_engines([0, 2])
    assert done.result(timeout=300) in (2, 3)
    assert {k: v.how for k, v in plans._cache.items()} == {
        frozenset({1, 2}): "derived",
        frozenset({0, 2}): "derived",
        frozenset({0, 1}): "derived",
    }
    assert plans.for_engines([0, 2]) is first and first.how == "derived"
    inline = MembershipPlans(plan, SPEC, src, dst, _engines(infer)).for_engines([0, 2])
    assert inline.plan.fingerprint == first.plan.fingerprint
    assert plans.derive_ahead([(0, 2)]).result(timeout=300) == 0  # cached: nothing to do
    with pytest.raises(PlanError) as err:
        plans.derive_ahead([(0, 7)])
    assert str(err.value) == "engines [0, 7]: choose at least one of 0..2"


def test_keep_only_drops_the_plans_of_other_sets_but_the_full_one() -> None:
    infer = InferParallel(tp=1, dp=4)
    src, dst = _layouts(SPEC, TrainParallel(tp=2), infer)
    plan = plan_refit(SPEC, src, dst, 0.05, relay="none")
    plans = MembershipPlans(plan, SPEC, src, dst, _engines(infer))
    for engines in ([0, 1, 2, 3], [0, 1, 2], [0, 1], [1, 2], [3]):
        plans.for_engines(engines)
    assert plans.cached_sets() == [(0, 1), (0, 1, 2), (0, 1, 2, 3), (1, 2), (3,)]
    assert plans.keep_only([(1, 0), (2, 1)]) == 2  # (0, 1, 2) and (3,) dropped
    assert plans.cached_sets() == [(0, 1), (0, 1, 2, 3), (1, 2)]
    again = plans.for_engines([3])  # derived again on demand, the same plan
    assert (
        again.plan.fingerprint
        == MembershipPlans(plan, SPEC, src, dst, _engines(infer)).for_engines([3]).plan.fingerprint
    )
    with pytest.raises(PlanError) as err:
        plans.keep_only([(0, 4)])
    assert str(err.value) == "engines [0, 4]: choose at least one of 0..3"


class HeldDerivation:
    """The derive-ahead thread's derivation (``derive_plan.__wrapped__``), held at the
    start of each set until the test releases it: interleavings made, not hoped for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started, self.release = threading.Semaphore(0), threading.Semaphore(0)
        real = membership_module.derive_plan

        def held(*args, **kwargs):
            self.started.release()
            assert self.release.acquire(timeout=300), "never released"
            return real.__wrapped__(*args, **kwargs)

        wrapper = functools.wraps(real.__wrapped__)(lambda *a, **k: real(*a, **k))
        wrapper.__wrapped__ = held
        monkeypatch.setattr(membership_module, "derive_plan", wrapper)

    def wait_started(self) -> None:
        assert self.started.acquire(timeout=300), "the thread never started a set"


def _four_engines() -> MembershipPlans:
    infer = InferParallel(tp=1, dp=4)
    src, dst = _layouts(SPEC, TrainParallel(tp=2), infer)
    plan = plan_refit(SPEC, src, dst, 0.05, relay="none")
    return MembershipPlans(plan, SPEC, src, dst, _engines(infer))


def test_sets_dropped_while_derived_ahead_are_not_cached_nor_started(monkeypatch) -> None:
    plans, hold = _four_engines(), HeldDerivation(monkeypatch)
    done = plans.derive_ahead([(0, 2), (0, 3), (2, 3)])
    hold.wait_started()  # the thread derives (0, 2); (0, 3) and (2, 3) are queued
    plans.keep_only([(0, 3)])  # drops (0, 2) mid-derivation and (2, 3) unstarted
    hold.release.release()  # (0, 2): done, not cached
    hold.wait_started()  # (0, 3): kept, derived
    hold.release.release()
    assert done.result(timeout=300) == 2  # (2, 3) was never started
    assert plans.cached_sets() == [(0, 3)]


def test_a_set_dropped_then_asked_for_while_derived_ahead_is_cached(monkeypatch) -> None:
    """Engines 0-3 serve; the thread derives {0,1,3} (engine 2 lost next); engine 3 is
    lost first (the group for {0,1,2} drops {0,1,3}), then engine 2 too: the group for
    {0,1,3} waits for the thread's plan, which must stay cached for the next group."""
    plans, hold = _four_engines(), HeldDerivation(monkeypatch)
    done = plans.derive_ahead([(0, 1, 3)])
    hold.wait_started()
    plans.keep_only([(0, 1, 2)])
    threading.Timer(0.2, hold.release.release).start()
    waited = plans.for_engines([0, 1, 3])  # waits for the thread's derivation
    assert done.result(timeout=300) == 1 and waited.how == "derived"
    assert plans.cached_sets() == [(0, 1, 3)]  # asked for: cached, whatever keep_only said
    plans.keep_only([(0, 1, 3)])
    assert plans.for_engines([3, 1, 0]) is waited


def test_a_queued_set_built_by_the_driver_then_dropped_is_not_built_again(monkeypatch) -> None:
    plans, hold = _four_engines(), HeldDerivation(monkeypatch)
    done = plans.derive_ahead([(0, 1), (0, 2)])
    hold.wait_started()  # the thread holds (0, 1); (0, 2) queued
    assert plans.for_engines([0, 2]).how == "derived"  # the driver builds it first
    plans.keep_only([(0, 1)])  # then membership moves on: (0, 2) dropped
    hold.release.release()
    assert done.result(timeout=300) == 1  # (0, 1) only: (0, 2) is not derived again
    assert plans.cached_sets() == [(0, 1)]


def test_build_plans_again_with_the_full_plans_settings_where_it_cannot_derive() -> None:
    """Carried legs through a leaving engine cannot be derived (``carry``): ``build``'s
    fallback plans that set with the same relay mode, topology (the kept ranks' nodes)
    and carry."""
    cluster = Cluster(gpus_per_node=4, nvlink_latency_us=0.001, nic_latency_us=0.002)
    infer = InferParallel(tp=2, dp=3)
    src, dst = _layouts(SPEC, TrainParallel(tp=4), infer)
    links = Topology(cluster, Placement.packed(4, 6, cluster))
    args = dict(bucket_mb=0.05, relay="domain", links=links, carry=True)
    plans = MembershipPlans.build(SPEC, src, dst, _engines(infer), **args)
    assert plans.plan == plan_refit(SPEC, src, dst, **args)
    made = plans.for_engines([2])
    assert made.how == (
        "re-planned: a leaving engine carries, or is carried to, through relay buffers "
        "(carry: the plan's carried legs name it)"
    )
    kept = narrowed_layouts(dst, (4, 5))
    nodes = links.placement.nodes
    kept_links = Topology(cluster, Placement(4, nodes[:4] + (nodes[8], nodes[9])))
    assert made.plan == plan_refit(SPEC, src, kept, **{**args, "links": kept_links})
    assert_delivers_exactly(made.plan, SPEC, src, kept)


def test_carried_legs_to_a_leaving_engine_are_dropped_or_planned_again() -> None:
    """A plan with carried legs (``carry``): for every set of engines left, the plan
    is derived — the legs carried to engines that left dropped with them — or planned
    again; either way every remaining destination gets exactly its weights."""
    from nemo_refit_reshard.plan import is_relay

    cluster = Cluster(gpus_per_node=5, nvlink_latency_us=0.001, nic_latency_us=0.002)
    infer = InferParallel(tp=2, dp=4)
    src, dst = _layouts(SPEC, TrainParallel(tp=4), infer)
    links = Topology(cluster, Placement.packed(4, 8, cluster))
    args = dict(bucket_mb=0.05, relay="domain", links=links, carry=True)
    plans = MembershipPlans.build(SPEC, src, dst, _engines(infer), **args)

    def carried(plan: RefitPlan) -> int:
        return sum(is_relay(t.dst_tensor) for msgs in plan.class_rounds for m in msgs
                   for t in m.transfers)  # fmt: skip

    assert carried(plans.plan) > 0
    hows = set()
    for size in (1, 2, 3):
        for chosen in combinations(range(4), size):
            made = plans.for_engines(chosen)
            hows.add(made.how.split(":")[0])
            assert_delivers_exactly(made.plan, SPEC, src, narrowed_layouts(dst, made.destinations))
            if made.how == "derived":
                assert carried(made.plan) <= carried(plans.plan)
    assert hows == {"derived", "re-planned"}
