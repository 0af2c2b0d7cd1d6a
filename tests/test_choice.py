"""``relay="auto"`` (``plan/relay_choice.py``): the mode it picks has the lowest prediction of
the candidates, a candidate it did not schedule could not have won, and it says why."""

from __future__ import annotations

import pytest

from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import Cluster, Placement, Topology, plan_refit, predict_refit
from nemo_refit_reshard.plan.pass1_needs import find_needs
from nemo_refit_reshard.plan.relay_choice import ingress_bound
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.hf_models import TINY_CONFIGS

SPEC = spec_from_hf_config(dict(TINY_CONFIGS["llama"], torch_dtype="float32"))
MOE = spec_from_hf_config(dict(TINY_CONFIGS["qwen3_moe"], torch_dtype="float32"))

# (model, training, inference, GPUs per node)
CASES = [
    (SPEC, "tp=2,pp=2", "tp=2,dp=2", 4),
    (SPEC, "dp=4", "tp=1,dp=4", 2),  # replicas share nodes: domain forwards
    (SPEC, "tp=2", "tp=2,dp=4", 2),  # replicas on nodes of their own: rings
    (SPEC, "dp=4", "tp=2,dp=2", 2),  # the same, training NICs to spare: chain wins
    (SPEC, "dp=4", "tp=1,dp=2", 1),  # no NVLink at all: domain forwards nothing
    (SPEC, "tp=2,dp=2", "tp=1,dp=6", 3),
    (MOE, "ep=2,dp=2", "tp=2,dp=2", 2),
    (MOE, "tp=2,ep=2,etp=1", "tp=1,dp=4", 4),
]


def _setup(case):
    spec, train, infer, gpus = case
    tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
    sources = [megatron_layout(spec, tp, r) for r in range(tp.world_size)]
    destinations = [vllm_layout(spec, ip, r) for r in range(ip.world_size)]
    cluster = Cluster(gpus_per_node=gpus, nvlink_latency_us=0.5, nic_latency_us=1.0)
    placement = Placement.packed(len(sources), len(destinations), cluster)
    return spec, sources, destinations, cluster, placement


@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}->{c[2]}/{c[3]}" for c in CASES])
def test_auto_picks_the_lowest_prediction_and_pruned_modes_could_not_win(case) -> None:
    spec, sources, destinations, cluster, placement = _setup(case)
    links = Topology(cluster, placement)

    def predicted(relay: str) -> float:
        plan = plan_refit(spec, sources, destinations, 0.02, relay=relay, links=links)
        return predict_refit(plan, Topology(cluster, placement)).seconds

    plan = plan_refit(spec, sources, destinations, 0.02, links=links)  # relay="auto"
    choice = plan.relay_choice
    by_mode = {c.relay: c for c in choice.candidates}
    every = {mode: predicted(mode) for mode in ("none", "domain", "chain")}
    auto = predict_refit(plan, Topology(cluster, placement)).seconds
    assert auto == pytest.approx(min(every.values()), rel=1e-9)
    assert by_mode[choice.chosen].stage == 2
    assert by_mode[choice.chosen].seconds == pytest.approx(auto, rel=1e-9)
    for mode, c in by_mode.items():
        if c.same_as is not None:  # routes like the other: the same plan
            assert every[mode] == pytest.approx(every[c.same_as], rel=1e-9)
        elif c.stage < 2:  # not scheduled: its bound is below its real time, above ours
            assert auto <= c.seconds <= every[mode] * (1 + 1e-9)
    # ties go to the earlier candidate: none, domain, chain
    tied = [m for m in ("none", "domain", "chain") if every[m] == pytest.approx(auto, rel=1e-12)]
    assert choice.chosen == tied[0] or by_mode[tied[0]].same_as == choice.chosen


def test_auto_without_a_topology_is_the_direct_plan() -> None:
    spec, sources, destinations, _, _ = _setup(CASES[0])
    auto = plan_refit(spec, sources, destinations, 0.02)
    assert auto.relay_choice is None
    assert (
        auto.fingerprint == plan_refit(spec, sources, destinations, 0.02, relay="none").fingerprint
    )


def test_a_domain_that_forwards_nothing_is_the_none_plan_and_the_reason_says_so() -> None:
    spec, sources, destinations, cluster, placement = _setup(CASES[4])
    links = Topology(cluster, placement)
    plan = plan_refit(spec, sources, destinations, 0.02, links=links)

    def built(relay: str):
        return plan_refit(spec, sources, destinations, 0.02, relay=relay, links=links)

    assert built("domain").fingerprint == built("none").fingerprint
    assert plan.relay_choice.chosen == "chain"
    assert plan.fingerprint == built("chain").fingerprint

    def ms(relay: str) -> str:
        return f"{predict_refit(built(relay), Topology(cluster, placement)).seconds * 1e3:.6g} ms"

    assert plan.relay_choice.reason == (
        f"chain: predicted {ms('chain')}; none: predicted {ms('none')}; "
        "domain: routes exactly like none"
    )


def test_the_ingress_bound_is_each_ranks_bytes_over_its_fastest_link() -> None:
    spec, sources, destinations, cluster, placement = _setup(CASES[2])
    needs = find_needs(spec, sources, destinations)
    links = Topology(cluster, placement)
    # every inference rank stores half the model (TP=2) and is on a node of its own
    half = needs.group_bytes(needs.groups[0][0])
    assert ingress_bound(needs, links) == pytest.approx(half / cluster.nic_bytes_per_s)
