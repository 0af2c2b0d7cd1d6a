"""Planner pieces with hand-computed expectations, and bad input."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from nemo_refit_reshard.engine.program import RankProgram
from nemo_refit_reshard.layouts import (
    Box,
    MegatronOptions,
    RankLayout,
    megatron_layout,
    vllm_layout,
)
from nemo_refit_reshard.layouts.base import LocalTensor
from nemo_refit_reshard.plan import PlanError, RefitPlan, plan_broadcast, plan_refit
from nemo_refit_reshard.plan.result.serialize import NameTable, message_json
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.hf_models import TINY_CONFIGS

LLAMA = spec_from_hf_config(dict(TINY_CONFIGS["llama"], torch_dtype="float32"))
MOE = spec_from_hf_config(dict(TINY_CONFIGS["qwen3_moe"], torch_dtype="float32"))


def _layouts(spec, train: str, infer: str):
    tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
    return (
        [megatron_layout(spec, tp, r) for r in range(tp.world_size)],
        [vllm_layout(spec, ip, r) for r in range(ip.world_size)],
    )


def test_bytes_equal_destination_needs() -> None:
    src, dst = _layouts(LLAMA, "tp=2,pp=2", "tp=4,dp=2")
    plan = plan_refit(LLAMA, src, dst)
    # Every destination holds a 1/4 TP slice of the model (norms whole), float32.
    need = sum(p.canonical_box.numel * 4 for lay in dst for p in lay.pieces())
    assert plan.stats.total_bytes == plan.stats.min_bytes == need
    assert sum(plan.stats.bytes_received) == need
    # The baseline moves every needed tensor whole to each of the 8 destinations.
    assert plan.stats.baseline_bytes == plan_broadcast(LLAMA, src, dst).total_bytes
    # 8 destinations (2 replicas of TP=4) receive each tensor whole instead of 2 copies
    # of the model in total: close to 4x, less the norms every TP rank needs whole.
    assert 3.5 * plan.stats.total_bytes < plan.stats.baseline_bytes < 4.5 * plan.stats.total_bytes


def test_replicas_share_the_sending() -> None:
    """dp=4 training replicas -> one inference rank: each replica sends about a quarter."""
    src, dst = _layouts(LLAMA, "dp=4", "tp=1")
    plan = plan_refit(LLAMA, src, dst)
    sent = plan.stats.bytes_sent[:4]  # the four training ranks
    assert plan.stats.bytes_sent[4:] == (0,)  # the inference rank only receives
    assert sum(sent) == plan.stats.min_bytes
    assert max(sent) - min(sent) <= max(sent) * 0.1, sent
    assert max(sent) < 0.3 * sum(sent)


def test_bucket_bounds_staging_per_round() -> None:
    src, dst = _layouts(LLAMA, "tp=2", "tp=2")
    bucket_mb = 16 / 1024  # 16 KiB
    plan = plan_refit(LLAMA, src, dst, bucket_mb=bucket_mb)
    assert plan.stats.num_rounds > 1
    for messages in plan.rounds:
        staged: dict[tuple[int, str], int] = defaultdict(int)  # per rank and direction
        for m in messages:
            staged[(m.src, "send")] += m.nbytes
            staged[(m.dst, "recv")] += m.nbytes
            assert len({(x.src, x.dst) for x in messages}) == len(messages)  # one per pair
        assert max(staged.values()) <= 16 * 1024


def test_qkv_regroups_from_megatron_interleave_to_vllm_order() -> None:
    """Megatron rows [q0 q1 k0 v0 | q2 q3 k1 v1] become vLLM [q0..q3 | k0 k1 | v0 v1]."""
    src, dst = _layouts(LLAMA, "tp=1", "tp=1")
    plan = plan_refit(LLAMA, src, dst)
    qkv = sorted(
        (t.dst_box.offsets[0], t.dst_box.sizes[0], t.src_box.offsets[0])
        for m in plan.rounds[0]
        for t in m.transfers
        if t.dst_tensor == "model.layers.0.self_attn.qkv_proj.weight"
    )
    assert qkv == [
        (0, 32, 0),
        (32, 32, 64),
        (64, 16, 32),
        (80, 16, 96),
        (96, 16, 48),
        (112, 16, 112),
    ]


def test_engine_merges_adjacent_copies() -> None:
    """Same TP on both sides: Megatron [gate; up] rows land in vLLM [gate; up] rows as one copy."""
    src, dst = _layouts(LLAMA, "tp=2", "tp=2")
    plan = plan_refit(LLAMA, src, dst)
    fc1 = [
        t
        for m in plan.rounds[0]
        for t in m.transfers
        if t.src == 0 and t.src_tensor == "decoder.layers.0.mlp.linear_fc1.weight"
    ]
    assert len(fc1) == 2  # the plan keeps one transfer per canonical tensor (gate, up)
    tensors = {t.name: torch.zeros(t.shape) for t in src[0].tensors}
    program = RankProgram(plan, 0, tensors)
    fc1_live = tensors["decoder.layers.0.mlp.linear_fc1.weight"]
    copies = [
        live
        for _, live in program.rounds[0].copies_out
        if live.untyped_storage().data_ptr() == fc1_live.untyped_storage().data_ptr()
    ]
    assert [tuple(c.shape) for c in copies] == [(96, 64)]  # both halves, one copy


def test_plan_json_round_trip_and_tamper() -> None:
    src, dst = _layouts(MOE, "ep=2,dp=2", "tp=2")
    plan = plan_refit(MOE, src, dst)
    again = RefitPlan.from_json(plan.to_json())
    assert again == plan
    data = json.loads(plan.to_json())
    data["rounds"][0][0]["t"][0][1][0] += 1
    with pytest.raises(PlanError, match="does not match its fingerprint"):
        RefitPlan.from_json(json.dumps(data))
    data["version"] = 99
    with pytest.raises(PlanError, match="plan version 99 is not 2"):
        RefitPlan.from_json(json.dumps(data))


def test_plan_text_is_the_json_of_its_body() -> None:
    """The plan text writes its rounds directly (``serialize.rounds_text``): the same
    characters as json's encoder gives for the ``message_json`` rows."""
    plan = plan_refit(MOE, *_layouts(MOE, "tp=2,ep=2,etp=1", "tp=2,engine_dp=2,ep=4"))
    names = NameTable()
    rounds = [[message_json(m, names) for m in msgs] for msgs in plan.class_rounds]
    body = plan._body(rounds, names)
    assert body["rounds"] and len(names.names) > 10
    assert plan.to_json() == json.dumps(
        dict(body, fingerprint=plan.fingerprint), separators=(",", ":")
    )


def test_plan_is_deterministic() -> None:
    a = plan_refit(MOE, *_layouts(MOE, "tp=2,ep=2,etp=1", "tp=2,engine_dp=2,ep=4"))
    b = plan_refit(MOE, *_layouts(MOE, "tp=2,ep=2,etp=1", "tp=2,engine_dp=2,ep=4"))
    assert a.fingerprint == b.fingerprint and a.to_json() == b.to_json()


def test_specs_disagree_lists_mismatches() -> None:
    other = spec_from_hf_config(
        dict(TINY_CONFIGS["llama"], intermediate_size=128, tie_word_embeddings=True)
    )
    src, dst = _layouts(LLAMA, "tp=1", "tp=1")
    with pytest.raises(PlanError) as err:
        plan_refit(LLAMA, src, dst, destination_spec=other)
    text = str(err.value)
    assert "disagree on 7 tensor(s)" in text
    assert "lm_head.weight: only in the source spec" in text
    assert (
        "model.layers.0.mlp.down_proj.weight: source shape [64, 96] != destination [64, 128]"
        in text
    )


def test_destination_region_no_source_holds() -> None:
    src, dst = _layouts(LLAMA, "tp=1", "tp=1")
    stripped = RankLayout(
        src[0].framework,
        0,
        1,
        src[0].position,
        src[0].replicas,
        tuple(t for t in src[0].tensors if t.name != "decoder.final_layernorm.weight"),
    )
    with pytest.raises(
        PlanError,
        match=r"destination rank 0 needs model\.norm\.weight\[0:64\] "
        r"\(for model\.norm\.weight\) but the source ranks hold "
        r"only 0 of its 64 elements",
    ):
        plan_refit(LLAMA, [stripped], dst)


def test_live_tensor_mismatch_is_reported_before_any_transfer() -> None:
    src, dst = _layouts(LLAMA, "tp=1", "tp=2")
    plan = plan_refit(LLAMA, src, dst)
    tensors = {t.name: torch.zeros(t.shape) for t in dst[1].tensors}
    tensors["model.norm.weight"] = torch.zeros(65)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].double()
    del tensors["lm_head.weight"]
    with pytest.raises(PlanError) as err:
        RankProgram(plan, 2, tensors)
    assert str(err.value).splitlines() == [
        "destination rank 1: live tensors do not match the plan:",
        "  lm_head.weight: missing (the plan expects [64, 64] float32)",
        "  model.embed_tokens.weight: dtype torch.float64, the plan expects float32",
        "  model.norm.weight: shape [65], the plan expects [64]",
    ]


def test_partially_overlapping_sources_are_rejected() -> None:
    src, _ = _layouts(LLAMA, "tp=1", "tp=1")
    norm = (
        src[0].tensor("model.norm.weight")
        if False
        else src[0].tensor("decoder.final_layernorm.weight")
    )
    from nemo_refit_reshard.layouts.base import Piece

    odd = LocalTensor(
        "odd",
        (40,),
        "float32",
        (Piece("model.norm.weight", Box((10,), (40,)), "odd", Box((0,), (40,))),),
    )
    other = RankLayout("megatron", 1, 2, {}, (1,), (odd,))
    first = RankLayout("megatron", 0, 2, {}, (0,), (norm,))
    _, dst = _layouts(LLAMA, "tp=1", "tp=1")
    with pytest.raises(PlanError, match="overlap without being identical"):
        plan_refit(LLAMA, [first, other], dst)


def test_megatron_fp32_master_to_bf16_inference_halves_bytes() -> None:
    tp = TrainParallel(tp=2)
    src = [megatron_layout(LLAMA, tp, r, MegatronOptions(params_dtype="float32")) for r in (0, 1)]
    from nemo_refit_reshard.layouts import VllmOptions

    dst = [vllm_layout(LLAMA, InferParallel(), 0, VllmOptions(params_dtype="bfloat16"))]
    plan = plan_refit(LLAMA, src, dst)
    assert plan.stats.total_bytes == LLAMA.num_params * 2
    assert {t.dtype for m in plan.rounds[0] for t in m.transfers} == {"bfloat16"}


def test_replica_messages_are_packed_once() -> None:
    """One training rank -> 4 inference replicas: each slice is packed once, sent 4 times."""
    src, dst = _layouts(LLAMA, "tp=1", "tp=2,dp=4")
    plan = plan_refit(LLAMA, src, dst)
    tensors = {t.name: torch.zeros(t.shape) for t in src[0].tensors}
    program = RankProgram(plan, 0, tensors)
    sends = [buf for phase in program.rounds for _, buf in phase.sends]
    assert len(sends) == 8  # one message per inference rank
    distinct = {(b.data_ptr(), b.numel()) for b in sends}
    assert len(distinct) == 2  # ... but only one staged copy per TP shard
    assert program.send_buffers[0].numel() <= plan.stats.total_bytes // 4 + 64


def test_relay_chain_takes_replicas_off_the_training_nic() -> None:
    """One training rank, 4 inference replicas: direct sends 4 copies, the chain sends 1."""
    from nemo_refit_reshard.plan import verify_plan

    src, dst = _layouts(LLAMA, "tp=1", "tp=2,dp=4")
    direct = plan_refit(LLAMA, src, dst)
    chain = plan_refit(LLAMA, src, dst, relay="chain")
    verify_plan(chain, src, dst)
    shard = [sum(p.canonical_box.numel * 4 for p in lay.pieces()) for lay in dst[:2]]
    assert direct.stats.bytes_sent[0] == 4 * sum(shard)
    # The chain sends every canonical element out of the training rank exactly once (even the
    # norms both TP ranks need: TP rank 0 forwards them to TP rank 1) ...
    assert chain.stats.bytes_sent[0] == LLAMA.num_params * 4
    # ... and no inference rank forwards more than it holds; the last one forwards nothing.
    assert all(sent <= max(shard) for sent in chain.stats.bytes_sent[1:])
    assert chain.stats.bytes_sent[-1] == 0
    assert chain.stats.total_bytes == direct.stats.total_bytes == chain.stats.min_bytes
    with pytest.raises(PlanError, match="unknown relay mode 'tree'"):
        plan_refit(LLAMA, src, dst, relay="tree")


class _TwoNodes:
    """Training rank 0 shares a node with the inference rank (NVLink, 450 GB/s);
    training rank 1 reaches it over a NIC (50 GB/s)."""

    def link(self, src: int, dst: int) -> tuple[str, float]:
        return ("nvlink", 1 / 450e9) if src == 0 else ("nic", 1 / 50e9)

    def latency(self, link: str) -> float:
        return 5e-6 if link == "nvlink" else 10e-6


def test_topology_aware_replica_choice_prefers_the_fast_link() -> None:
    src, dst = _layouts(LLAMA, "dp=2", "tp=1")
    plain = plan_refit(LLAMA, src, dst)
    aware = plan_refit(LLAMA, src, dst, relay="none", links=_TwoNodes())

    def busy(plan) -> float:  # predicted busy seconds of the slowest sender link
        return max(plan.stats.bytes_sent[0] / 450e9, plan.stats.bytes_sent[1] / 50e9)

    # Bytes-balanced: each replica sends about half. Time-balanced: NVLink carries ~9/10.
    assert (
        abs(plain.stats.bytes_sent[0] - plain.stats.bytes_sent[1]) < 0.1 * plain.stats.total_bytes
    )
    assert aware.stats.bytes_sent[0] > 0.85 * aware.stats.total_bytes
    assert busy(aware) < 0.25 * busy(plain)
    assert aware.stats.total_bytes == aware.stats.min_bytes


def test_rank_plan_slices_hold_only_their_share() -> None:
    from nemo_refit_reshard.plan import RankPlan, load_plan_json, rank_plan

    src, dst = _layouts(MOE, "tp=2,ep=2,etp=1", "tp=2,dp=2")
    plan = plan_refit(MOE, src, dst)
    world = plan.num_sources + plan.num_destinations
    slices = [rank_plan(plan, r) for r in range(world)]
    # every message is in exactly the sender's and the receiver's slice
    for msgs in plan.rounds:
        for m in msgs:
            holders = [s.group_rank for s in slices if m in s.messages]
            assert holders == sorted({m.src, m.dst})
    again = load_plan_json(slices[3].to_json())
    assert isinstance(again, RankPlan) and again == slices[3]
    assert again.fingerprint == plan.fingerprint
    assert len(slices[3].to_json()) < len(plan.to_json()) / 2
    # a slice compiles to the same program as the full plan
    tensors = {t.name: torch.zeros(t.shape) for t in dst[1].tensors}
    full, part = RankProgram(plan, 3, tensors), RankProgram(again, 3, tensors)
    assert [len(p.copies_in) for p in full.rounds] == [len(p.copies_in) for p in part.rounds]
    with pytest.raises(PlanError, match="this plan slice is for refit rank 3, not 2"):
        RankProgram(again, 2, tensors)


def test_broadcast_baseline_in_process_is_bit_exact() -> None:
    from nemo_refit_reshard.engine.materialize import empty_like_layout, materialize, mismatches
    from nemo_refit_reshard.engine.simulate import simulate_broadcast

    src, dst = _layouts(MOE, "tp=2,ep=2,etp=1", "tp=2,dp=2")
    canonical = {t.name: torch.randn(t.shape) for t in MOE}
    sources = [materialize(lay, canonical) for lay in src]
    destinations = [empty_like_layout(lay) for lay in dst]
    simulate_broadcast(plan_broadcast(MOE, src, dst, bucket_mb=0.05), sources, destinations)
    assert [mismatches(lay, t, canonical) for lay, t in zip(dst, destinations)] == [[]] * 4


def test_domain_relay_one_copy_per_nvlink_domain_then_chains() -> None:
    """2 training ranks -> 4 replicas on 2-GPU nodes (training on node 0, destinations
    2-3 on node 1, 4-5 on node 2). Training ranks send one copy per node; each stored
    message enters a node at one of its two GPUs, which forwards it to the other one
    round later, so both GPUs' NICs bring in a share."""
    from nemo_refit_reshard.plan import Cluster, Placement, Topology, verify_plan

    src, dst = _layouts(LLAMA, "tp=2", "tp=1,dp=4")
    cluster = Cluster(gpus_per_node=2, nvlink_gbps=450, nic_gbps=50)
    links = Topology(cluster, Placement.packed(2, 4, cluster))
    plan = plan_refit(LLAMA, src, dst, bucket_mb=0.01, relay="domain", links=links)
    # a transfer stored for 2 also enters node 2 at 4; one stored for 3 enters at 5
    assert plan.replica_groups == ((2, 4), (3, 5))
    assert plan.relay_chains == ((2, 3), (4, 5))
    verify_plan(plan, src, dst)  # exact once, and nothing forwarded before it arrived
    per_replica = plan.stats.min_bytes // 4
    # training ranks send two copies (one per node), not four (besides what one of them
    # hands the other to even out their NIC time: carried, ``plan/pass4_routes/carry.py``)
    into_inference = sum(m.nbytes for r in plan.rounds for m in r if m.src < 2 <= m.dst)
    assert into_inference == 2 * per_replica
    # each node's two GPUs forward to each other what entered through them: together
    # one replica's worth, each a part of it
    sent = plan.stats.bytes_sent[2:]
    assert sent[0] + sent[1] == sent[2] + sent[3] == per_replica
    assert min(sent) > 0 and max(sent) < per_replica
    assert plan.stats.bytes_received[2:] == (per_replica,) * 4
    assert {m.dst for msgs in plan.class_rounds for m in msgs if m.dst >= 2} == {2, 3}
    assert plan.num_rounds == len(plan.class_rounds) + 1
    # each hop runs one round after its entry received, and forwards all of it
    for r, msgs in enumerate(plan.rounds):
        for m in msgs:
            if m.src >= 2:
                fed = [
                    t
                    for x in plan.rounds[r - 1]
                    if x.dst == m.src and x.src < 2  # what entered there from training
                    for t in x.transfers
                ]
                assert sorted((t.dst_tensor, t.dst_box) for t in m.transfers) == sorted(
                    (t.dst_tensor, t.dst_box) for t in fed
                )
    # a worker's slice equals its share of the expanded plan
    for rank in range(6):
        assert plan.messages_of(rank) == [
            m for msgs in plan.rounds for m in msgs if rank in (m.src, m.dst)
        ]
    again = RefitPlan.from_json(plan.to_json())
    assert again.relay_chains == plan.relay_chains and again.rounds == plan.rounds


def test_domain_relay_needs_a_topology() -> None:
    src, dst = _layouts(LLAMA, "tp=2", "tp=1,dp=2")
    with pytest.raises(PlanError, match='relay="domain" needs a topology'):
        plan_refit(LLAMA, src, dst, relay="domain")


def test_plan_stats_count_the_expanded_messages() -> None:
    from nemo_refit_reshard.plan import Cluster, Placement, Topology

    src, dst = _layouts(LLAMA, "tp=2", "tp=1,dp=4")
    cluster = Cluster(gpus_per_node=2, nvlink_gbps=450, nic_gbps=50)
    links = Topology(cluster, Placement.packed(2, 4, cluster))
    for relay in ("none", "chain", "domain"):
        plan = plan_refit(LLAMA, src, dst, bucket_mb=0.01, relay=relay, links=links)
        msgs = [m for r in plan.rounds for m in r]
        assert plan.stats.num_messages == len(msgs), relay
        assert plan.stats.num_transfers == sum(len(m.transfers) for m in msgs), relay
        assert plan.stats.num_rounds == plan.num_rounds == len(plan.rounds), relay
        assert len({(m.round, m.src, m.dst) for m in msgs}) == len(msgs)  # one per pair
