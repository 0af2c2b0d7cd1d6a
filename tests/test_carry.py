"""Carried transfers: a busy training rank hands bytes to an NVLink neighbour, which
sends them on from its relay buffer one round later (``plan/pass4_routes/carry.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_refit_reshard.engine.checksum import (
    combine,
    compare,
    receiver_checksums,
    relay_routes,
    sender_checksums,
)
from nemo_refit_reshard.engine.program import RankProgram
from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import (
    Placement,
    PlanError,
    Topology,
    is_relay,
    plan_refit,
    predict_refit,
    relay_tensor,
    relayed_to,
    verify_plan,
)
from nemo_refit_reshard.spec import InferParallel, TrainParallel
from tests.helpers.carried_plan import CLUSTER, SPEC, carried_plan
from tests.helpers.plan_checks import assert_delivers_exactly


def _nic_bytes(plan) -> list[int]:
    """Bytes each training rank sends to the inference node."""
    out = [0, 0]
    for msgs in plan.rounds:
        for m in msgs:
            if m.src < 2 <= m.dst:
                out[m.src] += m.nbytes
    return out


def test_relay_names_round_trip() -> None:
    name = relay_tensor(7, "model.layers.0.mlp.gate_up_proj.weight")
    assert is_relay(name) and not is_relay("model.norm.weight")
    assert relayed_to(name) == (7, "model.layers.0.mlp.gate_up_proj.weight")
    assert relayed_to("model.norm.weight") is None


def test_the_busier_stage_hands_bytes_to_its_nvlink_neighbour() -> None:
    plain, *_ = carried_plan(carry=False)
    plan, sources, destinations, placement = carried_plan()
    before, after = _nic_bytes(plain), _nic_bytes(plan)
    assert before[1] > 1.25 * before[0]  # stage 1 is the busy one
    assert sum(after) == sum(before) == plan.stats.min_bytes
    # within the 3 % the carrier stops at, plus one row of the last cut transfer
    assert abs(after[1] - after[0]) <= 0.06 * sum(after) / 2 + 256 * 4
    legs1 = [(m, t) for r in plan.rounds for m in r for t in m.transfers if is_relay(t.dst_tensor)]
    legs2 = {
        (m.round, m.src, t.src_tensor, t.src_box): t
        for r in plan.rounds
        for m in r
        for t in m.transfers
        if is_relay(t.src_tensor)
    }
    assert legs1 and all(m.src == 1 and m.dst == 0 for m, _ in legs1)  # over NVLink
    assert len(legs2) == len(legs1)
    for m, t in legs1:  # leg 2 leaves the relay buffer one round later, to the real owner
        second = legs2[(m.round + 1, 0, t.dst_tensor, t.dst_box)]
        owner, tensor = relayed_to(t.dst_tensor)
        assert (second.dst, second.dst_tensor, second.dst_box) == (owner, tensor, t.dst_box)
        assert second.canonical_box == t.canonical_box and second.canonical == t.canonical
    carried = sum(t.nbytes for _, t in legs1)
    assert plan.stats.total_bytes == plan.stats.min_bytes + carried
    assert plan.stats.bytes_sent[:2] == (after[0] + 0, after[1] + carried)
    # NIC time evens out, so the prediction drops
    assert (
        predict_refit(plan, Topology(CLUSTER, placement)).seconds
        < predict_refit(plain, Topology(CLUSTER, placement)).seconds
    )
    # the carrier's relay buffer: two halves, each the largest round's carried bytes
    tensors = {t.name: torch.zeros(t.shape) for t in sources[0].tensors}
    program = RankProgram(plan, 0, tensors)
    per_round: dict[int, int] = {}
    for m, t in legs1:
        per_round[m.round] = per_round.get(m.round, 0) + -(-t.nbytes // 16) * 16
    assert program.relay_buffer.numel() == 2 * max(per_round.values())
    assert "model.layers.2.mlp.down_proj.weight" not in plan.expected_tensors(0)


def test_carried_plan_is_exact_once_and_bit_exact() -> None:
    plan, sources, destinations, _ = carried_plan()
    src, dst, _ = assert_delivers_exactly(plan, SPEC, sources, destinations)
    # Checksums: the first sender counts what it hands over, the routes send it on.
    shapes = {t.name: t.shape for t in SPEC}
    sent = [sender_checksums(plan.messages_of(r), r, src[r], shapes) for r in range(2)]
    received = combine(
        receiver_checksums(lay, 2 + lay.rank, t, shapes) for lay, t in zip(destinations, dst)
    )
    routes = relay_routes(m for r in plan.rounds for m in r)
    assert routes and compare(combine(sent, routes), received) == []
    # without the routes the carried bytes show up as missing at their owners
    missing = compare(combine(sent), received)
    assert missing and {rank for rank, *_ in missing} >= {0, 2}
    # a corrupted carried element is caught
    first = next(t for r in plan.rounds for m in r for t in m.transfers if is_relay(t.dst_tensor))
    owner, tensor = relayed_to(first.dst_tensor)
    dst[owner - 2][tensor][first.dst_box.slices()].view(-1)[0] += 1
    received = combine(
        receiver_checksums(lay, 2 + lay.rank, t, shapes) for lay, t in zip(destinations, dst)
    )
    assert [(r, n) for r, n, *_ in compare(combine(sent, routes), received)] == [(owner, tensor)]


def test_a_relay_send_without_its_first_leg_is_refused() -> None:
    plan, sources, destinations, _ = carried_plan()
    dropped = tuple(
        tuple(
            dataclasses.replace(
                m, transfers=tuple(t for t in m.transfers if not is_relay(t.dst_tensor))
            )
            for m in msgs
        )
        for msgs in plan.class_rounds
    )
    broken = dataclasses.replace(plan, class_rounds=dropped)
    tensors = {t.name: torch.zeros(t.shape) for t in sources[0].tensors}
    with pytest.raises(PlanError, match="from its relay buffer .* did not receive it in round"):
        RankProgram(broken, 0, tensors)
    with pytest.raises(AssertionError, match="from its relay\nbuffer|from its relay buffer"):
        verify_plan(broken, sources, destinations)


def test_a_lone_inference_rank_gets_part_of_its_copy_through_a_neighbour() -> None:
    """8 training ranks (tp=2, dp=4) on node 0; vLLM tp=2, dp=3 with ranks 8, 9, 10 on
    node 1 and 11, 12, 13 on node 2. TP rank 0's group is {8, 10, 12}, TP rank 1's
    {9, 11, 13}: 9 is alone on node 1 and 12 alone on node 2, each taking a whole shard
    through its NIC while its two neighbours (one run) take half a shard each. Planned
    on their own, part of what 9 and 12 need comes through those neighbours' relay
    buffers and NVLink: every NIC on nodes 1 and 2 takes about 2/3 of a shard."""
    sources = [megatron_layout(SPEC, TrainParallel(tp=2, dp=4), r) for r in range(8)]
    destinations = [vllm_layout(SPEC, InferParallel(tp=2, dp=3), r) for r in range(6)]
    cluster = dataclasses.replace(CLUSTER, gpus_per_node=8)
    placement = Placement.explicit((0,) * 8 + (1, 1, 1, 2, 2, 2), 8, 6, cluster)
    links = Topology(cluster, placement)

    def nic_in(plan) -> list[int]:
        out = [0] * 14
        for msgs in plan.rounds:
            for m in msgs:
                if placement.node(m.src) != placement.node(m.dst):
                    out[m.dst] += m.nbytes
        return out

    plain = plan_refit(SPEC, sources, destinations, 0.1, relay="domain", links=links, carry=False)
    plan = plan_refit(SPEC, sources, destinations, 0.1, relay="domain", links=links)
    shard = plan.stats.min_bytes // 6
    before = nic_in(plain)
    assert before[9] == before[12] == shard
    assert before[8] + before[10] == before[11] + before[13] == shard
    legs1 = [t for r in plan.rounds for m in r for t in m.transfers if is_relay(t.dst_tensor)]
    # (the training ranks may also even out their own sending among themselves)
    inward = [t for t in legs1 if t.dst >= 8]
    assert {t.dst for t in inward} == {8, 10, 11, 13} and {t.src for t in inward} <= set(range(8))
    assert {relayed_to(t.dst_tensor)[0] for t in inward} == {9, 12}
    hops = [m for r in plan.rounds for m in r if (m.src, m.dst) in {(8, 9), (10, 9), (11, 12)}]
    assert hops and all(is_relay(t.src_tensor) for m in hops for t in m.transfers)
    after = nic_in(plan)
    assert sum(after[8:]) == sum(before[8:])  # the same bytes, spread out
    # within 3 % or 16 message latencies' worth of bytes (what carrying must beat)
    mean = shard * 2 / 3
    slack = max(0.03 * mean, 16 * cluster.nic_latency_s * cluster.nic_bytes_per_s) + 4 * 64
    assert max(after[8:]) <= mean + slack
    assert_delivers_exactly(plan, SPEC, sources, destinations)
    assert (
        predict_refit(plan, Topology(cluster, placement)).seconds
        < 0.85 * predict_refit(plain, Topology(cluster, placement)).seconds
    )


def test_carrying_is_dropped_where_it_would_not_pay() -> None:
    """The same cluster with a 20 kB bucket: each rank's staging, not its NIC, bounds
    the rounds, so a carried leg only adds a round and staging. The planner prices the
    plan both ways and sends everything directly."""
    sources = [megatron_layout(SPEC, TrainParallel(tp=2, dp=4), r) for r in range(8)]
    destinations = [vllm_layout(SPEC, InferParallel(tp=2, dp=3), r) for r in range(6)]
    cluster = dataclasses.replace(CLUSTER, gpus_per_node=8)
    placement = Placement.explicit((0,) * 8 + (1, 1, 1, 2, 2, 2), 8, 6, cluster)
    links = Topology(cluster, placement)
    plain = plan_refit(SPEC, sources, destinations, 0.02, relay="domain", links=links, carry=False)
    plan = plan_refit(SPEC, sources, destinations, 0.02, relay="domain", links=links)
    assert not [t for r in plan.rounds for m in r for t in m.transfers if is_relay(t.dst_tensor)]
    assert plan.stats.total_bytes == plan.stats.min_bytes
    assert (
        predict_refit(plan, Topology(cluster, placement)).seconds
        <= predict_refit(plain, Topology(cluster, placement)).seconds * 1.02
    )
    verify_plan(plan, sources, destinations)
