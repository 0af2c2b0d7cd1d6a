"""Each planner pass on its own (``plan/build.py`` lists them): its typed result, with
values worked out by hand, and ``plan_refit`` as exactly their composition."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest

from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.layouts.base import Box
from nemo_refit_reshard.plan import (
    DTYPE_BYTES,
    Cluster,
    Placement,
    PlanConfig,
    PlanError,
    Topology,
    plan_refit,
    predict_refit,
)
from nemo_refit_reshard.plan.base import message_order
from nemo_refit_reshard.plan.cluster import nvlink_domains
from nemo_refit_reshard.plan.pass1_needs import find_needs
from nemo_refit_reshard.plan.pass2_fanout import plan_fanout
from nemo_refit_reshard.plan.pass3_senders import _PAIR_KEY, balance, choose_senders
from nemo_refit_reshard.plan.pass4_routes import plan_routes
from nemo_refit_reshard.plan.pass5_rounds import plan_rounds
from nemo_refit_reshard.plan.pass6_messages import to_messages
from nemo_refit_reshard.plan.pass7_assemble import assemble_plan
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.hf_models import TINY_CONFIGS

SPEC = spec_from_hf_config(dict(TINY_CONFIGS["llama"], torch_dtype="float32"))
TENSOR_BYTES = sum(t.numel for t in SPEC) * 4


def _layouts(train: str, infer: str):
    tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
    return (
        [megatron_layout(SPEC, tp, r) for r in range(tp.world_size)],
        [vllm_layout(SPEC, ip, r) for r in range(ip.world_size)],
    )


def _links(gpus_per_node: int, num_sources: int, num_destinations: int) -> Topology:
    cluster = Cluster(gpus_per_node=gpus_per_node, nvlink_latency_us=0.01, nic_latency_us=0.02)
    return Topology(cluster, Placement.packed(num_sources, num_destinations, cluster))


def test_needs_one_group_per_replica_set_cut_by_the_holders() -> None:
    src, dst = _layouts("tp=2", "dp=3")
    needs = find_needs(SPEC, src, dst)
    assert needs.groups == ((2, 3, 4),)
    assert list(needs.by_group) == [2]
    # every element of the model once, each cut held by exactly the TP rank(s) storing it
    group = needs.by_group[2]
    assert sum(n.numel for n in group) == sum(t.numel for t in SPEC)
    assert needs.group_bytes(2) == TENSOR_BYTES
    q = [n for n in group if n.dst_piece.canonical == "model.layers.0.self_attn.q_proj.weight"]
    assert sorted(tuple(h.rank for h in n.region.holders) for n in q) == [(0,), (1,)]
    norm = [n for n in group if n.dst_piece.canonical == "model.norm.weight"]
    assert [tuple(h.rank for h in n.region.holders) for n in norm] == [(0, 1)]
    # a member's needs are its group's, addressed to it
    assert [n.dst for n in needs.of(4)] == [4] * len(group)
    assert [n._replace(dst=2) for n in needs.of(4)] == group
    assert str(needs).startswith("Needs: 2 sources -> 3 destinations in 1 replica group(s)")


def test_fanout_per_relay_mode() -> None:
    src, dst = _layouts("tp=2", "dp=2")
    needs = find_needs(SPEC, src, dst)
    count = len(needs.by_group[2])
    none = plan_fanout(needs, PlanConfig(relay="none", links=None))
    assert none.groups == ((2, 3),) and none.members == {2: (2, 3)} and none.chains == []
    assert len(none.needs) == count
    chain = plan_fanout(needs, PlanConfig(relay="chain", links=None))
    assert chain.groups == ((2,), (3,)) and chain.members == {2: (2,), 3: (3,)}
    assert [n.dst for n in chain.needs] == [2] * count + [3] * count
    # both replicas on one node: one run, entered once, forwarded inside
    domain = plan_fanout(needs, PlanConfig(relay="domain", links=_links(2, 2, 2)))
    assert domain.runs_of == {2: [(2, 3)]} and domain.members == {2: (2,)}
    assert domain.chains == [(2, 3)] and domain.lone == ()
    with pytest.raises(PlanError, match='relay="domain" needs a topology'):
        plan_fanout(needs, PlanConfig(relay="domain", links=None))


def test_senders_reuse_the_fixed_part_across_relay_modes() -> None:
    """Pass 3 for a second relay mode of the same needs reuses the first one's fixed
    transfers (``Fixed``) and gives what building it afresh gives: the fixed transfers
    merged with the chosen ones exactly as one stable sort orders them, coalesced."""
    src, dst = _layouts("tp=2,pp=2", "tp=2,dp=4")  # norms held twice, the rest once
    links = _links(4, len(src), len(dst))
    needs = find_needs(SPEC, src, dst)
    plans = {}
    for mode in ("domain", "none"):
        settings = PlanConfig(relay=mode, links=links)
        fanout = plan_fanout(needs, settings)
        plans[mode] = (fanout, settings, choose_senders(needs, fanout, settings))
    fanout, settings, first = plans["domain"]
    again = choose_senders(needs, plans["none"][0], plans["none"][1], first)
    assert again.fixed is first.fixed  # reused, not rebuilt
    assert again.transfers == plans["none"][2].transfers
    fixed = first.fixed
    assert fixed.open and fixed.transfers  # both parts present: the merge is exercised
    chosen = balance(fixed, links, fanout.members)
    merged, keys = fixed.merged(chosen)
    assert merged == sorted(fixed.transfers + chosen, key=_PAIR_KEY)
    assert keys == [_PAIR_KEY(t) for t in merged]
    # ties: fixed transfers with the keys of chosen ones (told apart by a box) go first
    twins = [t._replace(canonical_box=Box((9, 9), (1, 1))) for t in chosen[::2]]
    tied = replace(fixed, transfers=fixed.transfers + twins)
    merged, _ = tied.merged(chosen)
    assert merged == sorted(tied.transfers + chosen, key=_PAIR_KEY)
    assert [merged.index(t) < merged.index(c) for t, c in zip(twins, chosen[::2])] == [True] * len(
        twins
    )


def test_senders_split_a_replicated_tensor_evenly_between_its_holders() -> None:
    """Two DP replicas hold everything; one destination. Without a topology the
    balancer gives each of them half the bytes (to within one row of one tensor)."""
    src, dst = _layouts("dp=2", "tp=1")
    needs = find_needs(SPEC, src, dst)
    fanout = plan_fanout(needs, PlanConfig(relay="none", links=None))
    senders = choose_senders(needs, fanout, PlanConfig(links=None))
    load = senders.load(fanout.members)
    assert sum(load.values()) == TENSOR_BYTES
    biggest_row = max(t.numel // t.shape[0] for t in SPEC) * 4
    assert abs(load[0] - load[1]) <= biggest_row
    for t in senders.transfers:  # each from a rank that holds the box
        assert any(t.canonical_box.contained_in(p.canonical_box) for p in src[t.src].pieces())


def test_routes_chain_hops_follow_each_other() -> None:
    src, dst = _layouts("tp=1", "dp=3")
    needs = find_needs(SPEC, src, dst)
    fanout = plan_fanout(needs, PlanConfig(relay="chain", links=None))
    routes = plan_routes(
        choose_senders(needs, fanout, PlanConfig(links=None)), fanout, PlanConfig(links=None), 1
    )
    assert len(routes.hops) == 2  # three replicas: two hops after the first delivery
    sent = sum(t.nbytes for t in routes.direct)
    assert sent == TENSOR_BYTES  # one copy leaves the training rank
    assert [sum(t.nbytes for t in level) for level in routes.hops] == [TENSOR_BYTES] * 2
    delivered = {(t.dst, t.dst_tensor, t.dst_box) for t in routes.direct}
    for level in routes.hops:  # a hop sends on what the level before delivered
        assert {(t.src, t.src_tensor, t.src_box) for t in level} <= delivered
        delivered = {(t.dst, t.dst_tensor, t.dst_box) for t in level}


def test_routes_lower_bound_counts_every_copy_and_is_below_the_prediction() -> None:
    src, dst = _layouts("tp=1", "dp=2")
    links = _links(1, 1, 2)  # every rank on its own node: all NIC
    needs = find_needs(SPEC, src, dst)
    fanout = plan_fanout(needs, PlanConfig(relay="none", links=links))
    routes = plan_routes(
        choose_senders(needs, fanout, PlanConfig(links=links)), fanout, PlanConfig(links=links), 1
    )
    busy = routes.link_seconds(links)
    spb = 1 / links.cluster.nic_bytes_per_s
    # the training rank sends both copies over its NIC; each replica takes one
    assert busy[(0, "nic", "out")] == pytest.approx(2 * TENSOR_BYTES * spb)
    assert busy[(1, "nic", "in")] == busy[(2, "nic", "in")] == pytest.approx(TENSOR_BYTES * spb)
    rounds = plan_rounds(routes, PlanConfig(2**16, links=links))
    assert routes.lower_bound(links) == pytest.approx(2 * TENSOR_BYTES * spb)
    assert rounds.seconds >= routes.lower_bound(links)


def test_rounds_bound_staging_and_messages_are_one_per_pair() -> None:
    src, dst = _layouts("tp=2", "tp=1,dp=2")
    needs = find_needs(SPEC, src, dst)
    fanout = plan_fanout(needs, PlanConfig(relay="none", links=None))
    routes = plan_routes(
        choose_senders(needs, fanout, PlanConfig(links=None)), fanout, PlanConfig(links=None), 2
    )
    bucket = 2**14
    rounds = plan_rounds(routes, PlanConfig(bucket, links=None))
    assert rounds.seconds is None and len(rounds.transfers) > 1
    for ts in rounds.transfers:  # per rank and direction at most one bucket a round
        sent, received = defaultdict(int), defaultdict(int)
        for t in ts:
            sent[t.src] += t.nbytes * len(routes.members[t.dst])
            received[t.dst] += t.nbytes
        assert max(sent.values()) <= bucket and max(received.values()) <= bucket
    messages = to_messages(rounds.transfers)
    assert str(messages).startswith(f"Messages: {len(rounds.transfers)} round(s)")
    for r, msgs in enumerate(messages.rounds):
        assert [(m.src, m.dst) for m in msgs] == sorted(
            {(t.src, t.dst) for t in rounds.transfers[r]}
        )
        for m in msgs:
            assert m.round == r and list(m.transfers) == sorted(m.transfers, key=message_order)
    assert sum(m.nbytes for msgs in messages.rounds for m in msgs) == TENSOR_BYTES


def test_timed_rounds_carry_the_prediction_of_the_plan() -> None:
    src, dst = _layouts("tp=2,pp=2", "tp=2,dp=2")
    links = _links(2, 4, 4)
    plan = plan_refit(SPEC, src, dst, 0.01, relay="domain", links=links)
    needs = find_needs(SPEC, src, dst)
    fanout = plan_fanout(needs, PlanConfig(relay="domain", links=links))
    routes = plan_routes(
        choose_senders(needs, fanout, PlanConfig(links=links)), fanout, PlanConfig(links=links), 4
    )
    rounds = plan_rounds(routes, PlanConfig(int(0.01 * 2**20), links=links))
    predicted = predict_refit(plan, links).seconds
    assert rounds.seconds == pytest.approx(predicted, rel=1e-9)
    assert str(rounds).startswith(f"Rounds: {len(rounds.transfers)} round(s)")


@pytest.mark.parametrize("relay", ["none", "chain", "domain"])
def test_plan_refit_is_the_composition_of_the_passes(relay: str) -> None:
    """Running the passes by hand and ``plan_refit`` give the same plan, byte for byte."""
    src, dst = _layouts("tp=2", "tp=1,dp=3")
    links = _links(2, 2, 3)
    plan = plan_refit(SPEC, src, dst, 0.02, relay=relay, links=links)
    needs = find_needs(SPEC, src, dst)
    fanout = plan_fanout(needs, PlanConfig(relay=relay, links=links))
    senders = choose_senders(needs, fanout, PlanConfig(links=links))
    routes = plan_routes(senders, fanout, PlanConfig(links=links), len(src))
    rounds = plan_rounds(routes, PlanConfig(int(0.02 * 2**20), links=links))
    messages = to_messages(rounds.transfers)
    assert [list(r) for r in plan.class_rounds] == messages.rounds
    assert plan.relay_chains == tuple(routes.chains)
    config = PlanConfig(int(0.02 * 2**20), relay, links)
    assembled = assemble_plan(SPEC, src, dst, config, needs, routes, messages, None)
    assert assembled.fingerprint == plan.fingerprint
    wire = sum(
        t.canonical_box.numel * DTYPE_BYTES[t.dtype]
        for msgs in messages.rounds
        for m in msgs
        for t in m.transfers
    )
    assert wire == sum(t.nbytes for ts in rounds.transfers for t in ts)


def test_c_speed_helpers_equal_their_python_definitions() -> None:
    """``sizes_of``, ``in_message_order``, ``Message.shared`` and the unchecked boxes of
    ``map_sub_box`` / ``intersect`` give exactly what the plain definitions give, mixed
    dtypes and relay buffers included."""
    from nemo_refit_reshard.layouts.base import Box, map_sub_box
    from nemo_refit_reshard.plan.base import Transfer, in_message_order, is_relay, legs, sizes_of
    from nemo_refit_reshard.plan.pass6_messages import Message

    def t(dst_tensor: str, row: int, dtype: str, src_tensor: str = "w") -> Transfer:
        box = Box((row, 0), (2, 3))
        return Transfer(0, 1, src_tensor, box, dst_tensor, box, "c", box, dtype)

    one = [t("b", 4, "bfloat16"), t("a", 6, "bfloat16"), t("a", 2, "bfloat16", "v")]
    mixed = [*one, t("a", 0, "float32"), t("b", 8, "float16")]
    for ts in (one, mixed, []):
        assert list(sizes_of(ts)) == [x.nbytes for x in ts]
        for reverse in (False, True):
            assert in_message_order(ts, reverse) == sorted(ts, key=message_order, reverse=reverse)
    first, _ = legs(mixed[0], 5)  # into rank 5's relay buffer
    m = Message(0, 0, 1, (first, *mixed))
    assert m.nbytes == sum(x.nbytes for x in m.transfers) == 6 * (2 + 2 + 2 + 4 + 2 + 2)
    assert m.shared == Message(0, 0, 1, tuple(mixed)) != m
    assert [is_relay(x.dst_tensor) for x in m.transfers] == [True] + [False] * len(mixed)
    plain = Message(0, 0, 1, tuple(mixed))
    assert plain.shared is plain
    assert Message(0, 0, 5, (first,)).shared is None
    outer, image = Box((4, 0), (8, 6)), Box((0, 2, 0), (8, 1, 6))
    mapped = map_sub_box(outer, image, Box((6, 1), (2, 5)))
    assert mapped == Box((2, 2, 1), (2, 1, 5)) and mapped.numel == 10
    shifted = map_sub_box(outer, Box((10, 0), (8, 6)), Box((6, 1), (2, 5)))
    assert shifted == Box((12, 1), (2, 5)) and shifted.numel == 10
    assert hash(shifted) == hash(Box((12, 1), (2, 5)))
    common = Box((0, 0), (4, 4)).intersect(Box((2, 1), (4, 4)))
    assert common == Box((2, 1), (2, 3)) and common.numel == 6
    assert Box((0, 0), (1, 4)).followed_by(Box((1, 0), (1, 4))) == Box((0, 0), (2, 4))


def test_nvlink_domains_whole_or_contiguous() -> None:
    """Ranks of equal parity share NVLink: whole domains gather every such rank; the
    contiguous runs (what relay chains and ``relay="domain"`` runs take) stop at the
    first rank of another domain, and on a packed placement both agree."""

    class Parity:
        def link(self, src: int, dst: int) -> tuple[str, float]:
            return ("nvlink", 1e-9) if src % 2 == dst % 2 else ("nic", 1e-8)

        def latency(self, link: str) -> float:
            return 1e-6

    ranks = [2, 3, 4, 5, 7]
    assert nvlink_domains(ranks, Parity()) == [[2, 4], [3, 5, 7]]
    assert nvlink_domains(ranks, Parity(), contiguous=True) == [[2], [3], [4], [5, 7]]
    packed = _links(4, 4, 8)  # nodes of 4: inference ranks 4..7 on one, 8..11 on the next
    assert nvlink_domains(range(4, 12), packed) == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert nvlink_domains(range(4, 12), packed, contiguous=True) == [[4, 5, 6, 7], [8, 9, 10, 11]]
