"""The delta refit's predicted sizes, baselines and ``simulate --delta-density``
(``plan/analysis/delta.py``): hand-computed figures."""

from __future__ import annotations

import json

import pytest

from nemo_refit_reshard.cli import main
from nemo_refit_reshard.layouts import Box
from nemo_refit_reshard.plan import (
    Cluster,
    Message,
    Placement,
    PlanStats,
    RefitPlan,
    Topology,
    Transfer,
)
from nemo_refit_reshard.plan.analysis.delta import (
    baseline_memory,
    changed_units,
    long_gaps,
    payload_bytes,
    position_width,
    predict_delta,
    wire_bytes,
    wire_messages,
)
from nemo_refit_reshard.plan.base import relay_tensor


# -- the size of one message --------------------------------------------------------------
def test_nothing_changed_sends_the_header_only() -> None:
    assert payload_bytes(1000, 2, 0) == 0
    assert wire_bytes(1000, 2, 0) == 32
    assert wire_bytes(4, 4, 0) == 32


def test_everything_changed_sends_dense() -> None:
    # N = 500 (w = 2): positions 500 * 4 = 2000, bitmap 63 + 1000 = 1063, dense 1000
    assert payload_bytes(1000, 2, 500) == 1000
    assert wire_bytes(1000, 2, 500) == 1032


def test_one_byte_units() -> None:
    # N = 100, w = 1, bitmap 13 bytes: positions 2k, bitmap 13 + k, gaps 2k, dense 100
    assert payload_bytes(100, 1, 10) == 20  # positions (bitmap 23)
    assert payload_bytes(100, 1, 13) == 26  # positions (bitmap 26: a tie, same bytes)
    assert payload_bytes(100, 1, 40) == 53  # bitmap (positions 80)
    assert payload_bytes(100, 1, 90) == 100  # dense (bitmap 103)
    assert wire_bytes(100, 1, 40) == 85


def test_position_width_thresholds() -> None:
    assert [position_width(n) for n in (1, 256, 257, 65536, 65537)] == [1, 1, 2, 2, 4]
    # N = 256 (w = 1) and N = 257 (w = 2), BF16 units, k = 3: gaps 3 (2 + 1) + 4 e, e =
    # round(3 (1 - 3/N)^255) = round(0.15) = 0, ties positions at N = 256, beats them after
    assert payload_bytes(512, 2, 3) == 3 * (1 + 2)
    assert payload_bytes(514, 2, 3) == 3 * (2 + 1)
    # N = 65536 (w = 2) and 65537 (w = 4), k = 100; bitmap 8192 / 8193 + 200; gaps 300 +
    # 4 e, e = round(100 (1 - 100/N)^255) = round(67.7) = 68: 572
    assert long_gaps(65536, 100) == 68
    assert payload_bytes(2 * 65536, 2, 100) == 100 * (2 + 2)
    assert payload_bytes(2 * 65537, 2, 100) == 300 + 4 * 68
    # k = 3000 of N = 65537 (4.6 %): e = 0, gaps 9000 beat bitmap 8193 + 6000 = 14193
    assert long_gaps(65537, 3000) == 0
    assert payload_bytes(2 * 65537, 2, 3000) == 9000


def test_changed_units_rounds_the_density_and_adds_fixed_units() -> None:
    assert changed_units(100, 0, 0.03) == 3
    assert changed_units(100, 0, 0.0) == 0
    assert changed_units(100, 10, 0.5) == 55
    assert changed_units(7, 7, 0.0) == 7


# -- a hand-made plan: replicas, a relay buffer ------------------------------------------
def _transfer(src: int, dst: int, name: str, start: int, numel: int, dtype: str) -> Transfer:
    box = Box((start,), (numel,))
    return Transfer(src, dst, name, box, name, box, name, box, dtype)


def _plan() -> RefitPlan:
    """Sources 0, 1; destinations 2, 3 (replicas, 3 stored as 2) and 4.

    round 0: 0 -> {2, 3}: 100 bf16 (200 B); 1 -> {2, 3}: 30 bf16 (60 B) and 1 -> 4 the
             same 30 bf16 (the same source box: the same content, one baseline)
    round 1: 0 -> {2, 3}: 50 fp32 (200 B), plus 8 bf16 (16 B) into 2's relay buffer
    """
    r0 = (
        Message(0, 0, 2, (_transfer(0, 2, "a", 0, 100, "bfloat16"),)),
        Message(0, 1, 2, (_transfer(1, 2, "b", 0, 30, "bfloat16"),)),
        Message(0, 1, 4, (_transfer(1, 4, "b", 0, 30, "bfloat16"),)),
    )
    relay = _transfer(0, 2, "c", 0, 8, "bfloat16")._replace(dst_tensor=relay_tensor(2, "c"))
    r1 = (Message(1, 0, 2, (_transfer(0, 2, "d", 0, 50, "float32"), relay)),)
    stats = PlanStats((0,) * 5, (0,) * 5, 0, 0, 0, 0, 0, 2)
    return RefitPlan("toy", 2, 3, 0, (), (), (r0, r1), stats, replica_groups=((2, 3),))


def _topology(plan: RefitPlan) -> Topology:
    cluster = Cluster(gpus_per_node=8)
    return Topology(cluster, Placement.packed(plan.num_sources, plan.num_destinations, cluster))


def test_wire_messages_expand_replicas_like_the_traffic() -> None:
    plan = _plan()
    got = [sorted((w.src, w.dst, w.nbytes) for w in msgs) for msgs in wire_messages(plan)]
    assert got == [sorted(msgs) for msgs in plan.traffic()]
    r1 = {w.dst: w for w in wire_messages(plan)[1]}
    assert (r1[2].nbytes, r1[2].unit, r1[2].fixed) == (216, 2, 16)  # its relay bytes fixed
    assert (r1[3].nbytes, r1[3].unit, r1[3].fixed) == (200, 4, 0)  # the replica's share


def test_baseline_memory_shares_replica_messages() -> None:
    # rank 0: round 0's 200 B once for both replicas; round 1's two different contents
    # (216 B with the relay bytes to 2, 200 B to 3); rank 1: 60 B once for 2, 3 and 4
    assert baseline_memory(_plan()) == [200 + 216 + 200, 60, 0, 0, 0]


def test_density_zero_sends_headers_only() -> None:
    plan = _plan()
    d = predict_delta(plan, _topology(plan), 0.0)
    assert d.messages == 7
    # every message a header; the relay-buffer bytes (16 B, 8 units) travel every step:
    # k = 8 of N = 108 units: positions 8 * (1 + 2) = 24 beats the bitmap (14 + 16)
    assert d.delta_bytes == 7 * 32 + 24
    assert d.baseline_bytes == (616, 60, 0, 0, 0)
    assert d.dense_bytes == 200 * 2 + 60 * 3 + 216 + 200
    # all NIC (the pools on nodes 0 and 1), 50 GB/s, 10 us a message. Headers: round 0
    # rank 1's three, round 1 rank 0's two; payloads: round 1's 24 B only
    assert d.wire_seconds == pytest.approx(6e-5 + (96 + 64 + 24) / 50e9, rel=1e-12)
    # HBM bytes, busiest sender + busiest receiver per round (a sender reads staging and
    # baseline, writes the payload and its k changed units back; a receiver reads the
    # payload, scatters k units and patches + unpacks its fixed bytes): round 0
    # 2 * 200 + 0; round 1 rank 0 (2 * 216 + 8 * 2 + 24) + 2 * 200, rank 2 24 + 8 * 2 + 2 * 16
    memory = 400 + 0 + (432 + 16 + 24 + 400) + (24 + 16 + 32)
    assert d.memory_seconds == pytest.approx(memory / 3350e9, rel=1e-12)
    # tiny messages: the header exchange's latency makes the delta slower than dense
    assert d.delta_seconds == d.wire_seconds + d.memory_seconds > d.dense_seconds


def test_density_must_be_a_fraction() -> None:
    plan = _plan()
    with pytest.raises(ValueError, match="fraction"):
        predict_delta(plan, _topology(plan), 1.5)


# -- simulate --delta-density ---------------------------------------------------------------
SIMULATE = ["simulate", "--train", "tp=2", "--infer", "tp=1,dp=2", "--relay", "none"]


def test_cli_density_zero_predicts_32_bytes_per_message(capsys) -> None:
    assert main([*SIMULATE, "--json", "--delta-density", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    delta = report["delta"]
    assert delta["messages"] > 0
    assert delta["delta_bytes"] == 32 * delta["messages"]
    assert delta["delta_busiest_rank_bytes"] < delta["dense_busiest_rank_bytes"]
    assert delta["baseline_bytes_max"] > 0 and delta["dense_s"] == report["predicted_s"]
    assert main([*SIMULATE, "--delta-density", "0"]) == 0
    text = capsys.readouterr().out
    assert "delta refit at density 0" in text and "delta / dense" in text


def test_cli_without_density_reports_no_delta(capsys) -> None:
    assert main([*SIMULATE, "--json"]) == 0
    assert "delta" not in json.loads(capsys.readouterr().out)
    assert main(SIMULATE) == 0
    assert "delta refit" not in capsys.readouterr().out


def test_forwarders_send_deltas_from_baselines_of_their_own() -> None:
    """Along a relay chain inference ranks forward: their messages are deltas too, each
    keyed by its receiver, with baselines of their own (host memory, as the engine)."""
    from nemo_refit_reshard.layouts import refit_layouts
    from nemo_refit_reshard.plan import plan_refit
    from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
    from tests.helpers.model_configs import MODELS

    spec = spec_from_hf_config(MODELS["qwen3"])
    sources, destinations = refit_layouts(
        spec, TrainParallel.parse("tp=2"), InferParallel.parse("tp=2,dp=4")
    )
    plan = plan_refit(spec, sources, destinations, relay="chain")
    forwarded = [w for msgs in wire_messages(plan) for w in msgs if w.src >= plan.num_sources]
    assert forwarded and all(w.key == ("forwarded to", w.dst) for w in forwarded)
    memory = baseline_memory(plan)
    for src in {w.src for w in forwarded}:
        mine = [w for w in forwarded if w.src == src]
        assert memory[src] == sum(w.nbytes for w in mine)
    d = predict_delta(plan, _topology(plan), 0.0)
    assert d.delta_bytes == 32 * d.messages  # nothing changed: headers only, forwards too


def test_plan_delta_reports_the_baselines_per_rank(capsys) -> None:
    assert main(["plan", "--delta", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    held = summary["delta_baseline_bytes"]
    assert len(held) == summary["sources"] + summary["destinations"]
    # small-qwen3, tp=2,pp=2 -> tp=2,dp=2: each training rank sends its quarter of the
    # model once (both inference replicas' messages are identical: one baseline)
    assert held[: summary["sources"]] == [17301504, 17184256, 17301504, 17186304]
    assert held[summary["sources"] :] == [0, 0, 0, 0]
    assert main(["plan", "--delta"]) == 0
    assert "delta refit: baselines           up to 16.5 MiB per training rank" in (
        capsys.readouterr().out
    )
