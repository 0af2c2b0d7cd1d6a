"""Cluster model, predicted refit time, bandwidth floor and baseline: hand-computed figures."""

from __future__ import annotations

import json
import sys

import pytest

from nemo_refit_reshard.cli import main
from nemo_refit_reshard.layouts import Box, megatron_layout, vllm_layout
from nemo_refit_reshard.plan import (
    BroadcastPlan,
    BroadcastStep,
    Cluster,
    Message,
    Placement,
    PlanStats,
    RefitPlan,
    Topology,
    Transfer,
    bandwidth_floor,
    plan_broadcast,
    plan_refit,
    predict_broadcast,
    predict_refit,
    traffic_matrix,
)
from nemo_refit_reshard.plan.analysis.baseline import broadcast_chain
from nemo_refit_reshard.plan.analysis.predict import GpuBytes
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec
from tests.helpers.hf_models import TINY_CONFIGS

LLAMA = load_model_spec(TINY_CONFIGS["llama"])
FULL = 74_560 * 2  # tiny llama in bf16: 6400 embed + 2 x 30848 per layer + 64 norm + 6400 head
NIC, NVL = 50e9, 450e9  # default Cluster, bytes/s
NIC_LAT, NVL_LAT = 10e-6, 5e-6
MB = 10**6


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-9)


def _plan(num_sources: int, num_destinations: int, rounds: list[list[tuple]]) -> RefitPlan:
    """A plan of messages ``(src, dst, nbytes)``: one 1-byte-per-element transfer each."""

    def message(r: int, src: int, dst: int, nbytes: int) -> Message:
        box = Box((0,), (nbytes,))
        t = Transfer(src, dst, "w", box, "w", box, "w", box, "float8_e4m3fn")
        return Message(r, src, dst, (t,))

    msgs = tuple(tuple(message(r, *m) for m in ms) for r, ms in enumerate(rounds))
    world = num_sources + num_destinations
    stats = PlanStats((0,) * world, (0,) * world, 0, 0, 0, 0, 0, len(msgs))
    return RefitPlan("toy", num_sources, num_destinations, 0, (), (), msgs, stats)


def _layouts(train: str, infer: str) -> tuple[list, list]:
    tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
    return (
        [megatron_layout(LLAMA, tp, r) for r in range(tp.world_size)],
        [vllm_layout(LLAMA, ip, r) for r in range(ip.world_size)],
    )


# -- topology -----------------------------------------------------------------------------
def test_cluster_parse_and_errors() -> None:
    c = Cluster.parse("gpus_per_node=4, nic_gbps=25")
    assert c == Cluster(gpus_per_node=4, nic_gbps=25.0)
    assert c.nic_bytes_per_s == 25e9 and c.nvlink_latency_s == approx(5e-6)
    assert Cluster.parse(str(c)) == c
    with pytest.raises(ValueError, match="unknown cluster key 'gpus'; allowed: gpus_per_node,"):
        Cluster.parse("gpus=8")
    with pytest.raises(ValueError, match="nic_gbps=0.0 must be > 0"):
        Cluster.parse("nic_gbps=0")
    with pytest.raises(ValueError, match="gpus_per_node='2.5' is not an integer"):
        Cluster.parse("gpus_per_node=2.5")
    with pytest.raises(ValueError, match="not key=value"):
        Cluster.parse("nic_gbps")
    with pytest.raises(ValueError, match="must be a positive number"):
        Cluster(nvlink_gbps=-1)


def test_placement_packed_and_explicit() -> None:
    c = Cluster(gpus_per_node=4)
    p = Placement.packed(6, 5, c)  # 6 training ranks on 2 nodes, inference from node 2
    assert p.nodes == (0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 3)
    assert p.training_nodes == (0, 1) and p.inference_nodes == (2, 3)
    assert p.ranks_on(1) == [4, 5] and p.node_sizes() == {0: 4, 1: 2, 2: 4, 3: 1}
    assert Placement.explicit((0, 1, 1), 1, 2, c).nodes == (0, 1, 1)
    with pytest.raises(ValueError, match="names 2 node"):
        Placement.explicit((0, 1), 1, 2, c)
    with pytest.raises(ValueError, match="node -1 of rank 1"):
        Placement.explicit((0, -1, 1), 1, 2, c)
    with pytest.raises(ValueError, match="puts 5 ranks on node 0"):
        Placement.explicit((0,) * 5, 2, 3, c)
    topo = Topology(c, p)
    assert topo.link(0, 3) == ("nvlink", 1 / 450e9) and topo.link(0, 6) == ("nic", 1 / 50e9)


# -- predict_refit ----------------------------------------------------------------------
def test_one_message_across_nodes_is_bytes_over_nic_plus_latency() -> None:
    c = Cluster()
    plan = _plan(1, 1, [[(0, 1, 100 * MB)]])
    pred = predict_refit(plan, Topology(c, Placement.packed(1, 1, c)))  # nodes (0, 1)
    assert pred.seconds == approx(2e-3 + NIC_LAT)
    assert (pred.slowest_round, pred.bottleneck_rank, pred.bottleneck_link) == (0, 0, "nic")
    assert pred.gpu_bytes == (GpuBytes(sent_nic=100 * MB), GpuBytes(received_nic=100 * MB))


def test_messages_out_of_one_gpu_share_its_nic() -> None:
    c = Cluster()
    plan = _plan(1, 2, [[(0, 1, 100 * MB), (0, 2, 100 * MB)]])
    pred = predict_refit(plan, Topology(c, Placement.packed(1, 2, c)))
    assert pred.seconds == approx(4e-3 + 2 * NIC_LAT)
    assert pred.bottleneck_rank == 0
    # Two senders into one receiver: its NIC ingress binds.
    plan = _plan(2, 1, [[(0, 2, 100 * MB), (1, 2, 100 * MB)]])
    pred = predict_refit(plan, Topology(c, Placement.packed(2, 1, c)))
    assert pred.seconds == approx(4e-3 + 2 * NIC_LAT)
    assert (pred.bottleneck_rank, pred.bottleneck_link) == (2, "nic")


def test_intra_node_message_uses_nvlink_concurrently_with_nic() -> None:
    c = Cluster()
    same_node = Placement.explicit((0, 0), 1, 1, c)
    pred = predict_refit(_plan(1, 1, [[(0, 1, 100 * MB)]]), Topology(c, same_node))
    assert pred.seconds == approx(100 * MB / NVL + NVL_LAT)
    assert pred.bottleneck_link == "nvlink"
    # 90 MB over NVLink (205 us) and 10 MB over the NIC (210 us) at once: the NIC binds.
    placement = Placement.explicit((0, 0, 1), 1, 2, c)
    plan = _plan(1, 2, [[(0, 1, 90 * MB), (0, 2, 10 * MB)]])
    pred = predict_refit(plan, Topology(c, placement))
    assert pred.seconds == approx(max(90 * MB / NVL + NVL_LAT, 10 * MB / NIC + NIC_LAT))
    assert (pred.bottleneck_rank, pred.bottleneck_link) == (0, "nic")
    assert pred.gpu_bytes[0] == GpuBytes(sent_nvlink=90 * MB, sent_nic=10 * MB)
    assert traffic_matrix(plan, Topology(c, placement)) == {(0, 0): 90 * MB, (0, 1): 10 * MB}


def test_rounds_add_up() -> None:
    c = Cluster()
    plan = _plan(1, 1, [[(0, 1, 50 * MB)], [(0, 1, 100 * MB)]])
    pred = predict_refit(plan, Topology(c, Placement.packed(1, 1, c)))
    assert pred.round_seconds == (approx(1e-3 + NIC_LAT), approx(2e-3 + NIC_LAT))
    assert pred.seconds == approx(3e-3 + 2 * NIC_LAT)
    assert pred.slowest_round == 1
    with pytest.raises(ValueError, match="placement is for 1 training"):
        predict_refit(plan, Topology(c, Placement.packed(1, 2, c)))


@pytest.mark.parametrize("gpus_per_node,margin", [(8, 0.3), (1, 0.35)])
def test_relay_chain_beats_direct_when_training_egress_binds(
    gpus_per_node: int, margin: float
) -> None:
    # One training GPU on node 0, four inference replicas on other nodes: all four on
    # node 1 (forwarding over NVLink), or one per node (forwarding over NICs).
    c = Cluster(gpus_per_node=gpus_per_node, nvlink_latency_us=1e-6, nic_latency_us=1e-6)
    src, dst = _layouts("tp=1", "tp=1,dp=4")
    placement = Placement.packed(1, 4, c)
    direct = plan_refit(LLAMA, src, dst, bucket_mb=0.01)
    chain = plan_refit(LLAMA, src, dst, bucket_mb=0.01, relay="chain")
    t_direct = predict_refit(direct, Topology(c, placement)).seconds
    t_chain = predict_refit(chain, Topology(c, placement)).seconds
    floor = bandwidth_floor(direct, src, dst, Topology(c, placement))
    assert floor.seconds == approx(FULL / NIC)  # one copy out of the training NIC
    assert t_direct >= 4 * FULL / NIC  # the direct plan pushes four copies through it
    # The chain forwards while it receives (separate send and receive budgets per round),
    # so it ends close to the floor: 1.01x over NVLink, 1.25x with one replica per node
    # (three extra hops at the end of the pipeline).
    assert floor.seconds <= t_chain < margin * t_direct
    assert t_chain < 1.3 * floor.seconds


# -- bandwidth_floor ----------------------------------------------------------------------
def _terms(train: str, infer: str, cluster: Cluster, nodes: tuple[int, ...] | None = None):
    src, dst = _layouts(train, infer)
    placement = (
        Placement.explicit(nodes, len(src), len(dst), cluster)
        if nodes
        else Placement.packed(len(src), len(dst), cluster)
    )
    plan = plan_refit(LLAMA, src, dst)
    floor = bandwidth_floor(plan, src, dst, Topology(cluster, placement))
    assert predict_refit(plan, Topology(cluster, placement)).seconds >= floor.seconds
    return floor, {t.key: (t.seconds, t.nbytes, t.where) for t in floor.terms}


def test_floor_inference_node_ingress_binds() -> None:
    # 4 DP training GPUs on node 0; one inference GPU alone on node 1 needs everything.
    floor, t = _terms("dp=4", "tp=1", Cluster(gpus_per_node=4))
    assert floor.binding.key == "a" and floor.seconds == approx(FULL / NIC)
    assert t["a"] == (approx(FULL / NIC), FULL, "node 1")
    assert t["b"] == (approx(FULL / (NIC + NVL)), FULL, "rank 4")
    assert t["c"] == (approx(FULL / (4 * NIC)), FULL, "node 0")
    assert t["d"] == (approx(FULL / (4 * NIC)), FULL, "training pool")


def test_floor_inference_gpu_ingress_binds() -> None:
    # Two replicas on one node share its 2 NICs; each GPU has only 50 + 10 GB/s in.
    floor, t = _terms("dp=4", "dp=2", Cluster(gpus_per_node=4, nvlink_gbps=10))
    assert floor.binding.key == "b" and floor.seconds == approx(FULL / 60e9)
    assert t["a"] == (approx(FULL / (2 * NIC)), FULL, "node 1")
    assert t["b"] == (approx(FULL / 60e9), FULL, "rank 4")


def test_floor_training_node_egress_binds() -> None:
    # Megatron tp=2 pads the 100-row vocabulary to 128 rows per rank: rank 0 holds all of
    # embed and lm_head (2 x 6400) plus half of each layer (2 x 15360); norms (5 x 64) are
    # on both. Alone on node 0, it must push its 43,520 unique elements through one NIC.
    floor, t = _terms("tp=2", "tp=2", Cluster(gpus_per_node=2), nodes=(0, 1, 2, 2))
    unique0 = (2 * 6400 + 2 * 15360) * 2
    assert floor.binding.key == "c" and floor.seconds == approx(unique0 / NIC)
    assert t["c"] == (approx(unique0 / NIC), unique0, "node 0")
    assert t["a"] == (approx(FULL / (2 * NIC)), FULL, "node 2")
    assert t["d"] == (approx(FULL / (2 * NIC)), FULL, "training pool")
    # vLLM tp=2 rank 0: embed rows 0:64 and lm_head rows 0:64 (2 x 4096), half of each
    # layer (2 x 15360), every norm (320).
    assert t["b"] == (approx((2 * 4096 + 2 * 15360 + 320) * 2 / (NIC + NVL)), 78_464, "rank 2")


def test_floor_training_pool_egress_binds() -> None:
    # Two DP replicas on two nodes (nothing unique to a node) feed a tp=4 node.
    floor, t = _terms("dp=2", "tp=4", Cluster(gpus_per_node=4), nodes=(0, 1, 2, 2, 2, 2))
    assert floor.binding.key == "d" and floor.seconds == approx(FULL / (2 * NIC))
    assert t["c"] == (0.0, 0, "-")
    assert t["a"] == (approx(FULL / (4 * NIC)), FULL, "node 2")


def test_floor_counts_what_a_node_already_holds() -> None:
    # Training rank 0 and inference rank 1 share node 0: nothing needs to enter node 0.
    floor, t = _terms("tp=1", "dp=2", Cluster(gpus_per_node=2), nodes=(0, 0, 1))
    assert t["a"] == (approx(FULL / NIC), FULL, "node 1")
    assert t["c"] == (approx(FULL / (2 * NIC)), FULL, "node 0")
    assert t["d"] == (approx(FULL / (2 * NIC)), FULL, "training pool")


@pytest.mark.parametrize(
    "train,infer,relay",
    [("tp=2,pp=2", "tp=2,dp=2", "none"), ("dp=2", "tp=2,dp=2", "chain"), ("pp=2", "tp=4", "none")],
)
def test_prediction_never_beats_the_floor(train: str, infer: str, relay: str) -> None:
    c = Cluster(gpus_per_node=2, nic_latency_us=1e-6, nvlink_latency_us=1e-6)
    src, dst = _layouts(train, infer)
    placement = Placement.packed(len(src), len(dst), c)
    plan = plan_refit(LLAMA, src, dst, bucket_mb=0.02, relay=relay)
    floor = bandwidth_floor(plan, src, dst, Topology(c, placement))
    assert 0 < floor.seconds <= predict_refit(plan, Topology(c, placement)).seconds


# -- predict_broadcast ------------------------------------------------------------------
def test_broadcast_gather_then_pipelined_chain() -> None:
    c = Cluster(gpus_per_node=2)
    placement = Placement.packed(2, 3, c)  # training 0,1 node 0; inference 2,3 node 1; 4 node 2
    n = 50 * MB  # bf16 elements: 100 MB
    half = n // 2
    lo, hi = Box((0,), (half,)), Box((half,), (half,))
    big = BroadcastStep(
        "w", (n,), "bfloat16", 0, ((0, "w", lo, lo), (1, "w", lo, hi)), ((0, ()), (1, ()), (2, ()))
    )
    small = BroadcastStep("v", (1000,), "bfloat16", 1, ((1, "v", lo, lo),), ((2, ()),))
    bplan = BroadcastPlan(2, 3, ((big,), (small,)))
    assert broadcast_chain(0, [4, 3, 2], placement) == [(0, 2), (2, 3), (3, 4)]
    pred = predict_broadcast(bplan, Topology(c, placement))
    gather = 100 * MB / 2 / NVL + NVL_LAT  # rank 1's half over NVLink
    bcast = 100 * MB / NIC + NIC_LAT + NVL_LAT + NIC_LAT  # 0 -nic- 2 -nvl- 3 -nic- 4
    bcast += 2000 / NIC + NIC_LAT  # v: rank 1 -> rank 4
    assert pred.gather_seconds == approx(gather)
    assert pred.broadcast_seconds == approx(bcast)
    assert pred.seconds == approx(gather + bcast) and pred.num_tensors == 2


def test_broadcast_chain_starts_on_the_roots_node() -> None:
    p = Placement.explicit((1, 0, 2, 1, 0), 1, 4, Cluster(gpus_per_node=2))
    assert broadcast_chain(0, [1, 2, 3, 4], p) == [(0, 3), (3, 1), (1, 4), (4, 2)]


def test_broadcast_on_tiny_llama_is_per_tensor_ring() -> None:
    c = Cluster()
    src, dst = _layouts("tp=1", "tp=1")
    placement = Placement.packed(1, 1, c)
    pred = predict_broadcast(plan_broadcast(LLAMA, src, dst), Topology(c, placement))
    assert pred.num_tensors == len(LLAMA) == 21
    assert pred.seconds == approx(FULL / NIC + 21 * NIC_LAT)


# -- CLI ------------------------------------------------------------------------------
@pytest.fixture()
def llama_config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIGS["llama"]))
    return str(path)


def _expected(config: str, cluster: Cluster, relay: str = "none"):
    spec = load_model_spec(config)
    tp, ip = TrainParallel(), InferParallel(tp=2, dp=2)
    src = [megatron_layout(spec, tp, 0)]
    dst = [vllm_layout(spec, ip, r) for r in range(4)]
    placement = Placement.packed(1, 4, cluster)
    # simulate plans topology-aware: replica choice and relay chains see the cluster
    plan = plan_refit(spec, src, dst, relay=relay, links=Topology(cluster, placement))
    return (
        predict_refit(plan, Topology(cluster, placement)),
        bandwidth_floor(plan, src, dst, Topology(cluster, placement)),
        predict_broadcast(plan_broadcast(spec, src, dst), Topology(cluster, placement)),
    )


def test_cli_simulate_json_and_text(llama_config, capsys) -> None:
    args = ["simulate", "--model", llama_config, "--train", "tp=1", "--infer", "tp=2,dp=2"]
    args += ["--cluster", "gpus_per_node=4,nic_gbps=25", "--relay", "chain"]
    pred, floor, base = _expected(llama_config, Cluster(gpus_per_node=4, nic_gbps=25), "chain")
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["predicted_s"] == pred.seconds
    assert report["predicted"]["round_seconds"] == list(pred.round_seconds)
    assert report["floor_s"] == floor.seconds and report["floor_term"] == floor.binding.key
    assert report["ratio_to_floor"] == pred.seconds / floor.seconds
    assert report["baseline_s"] == base.seconds
    assert report["speedup"] == base.seconds / pred.seconds
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("simulate ") and "relay chain" in lines[0]
    rows = {line[:29].strip(): line[29:].strip() for line in lines[1:]}
    assert rows["predicted refit"].startswith(f"{pred.seconds * 1e3:.3f} ms (")
    b = floor.binding
    assert (
        rows["bandwidth floor"] == f"{floor.seconds * 1e3:.3f} ms (({b.key}) {b.what}, {b.where})"
    )
    assert rows["predicted / floor"] == f"{pred.seconds / floor.seconds:.2f}x"
    assert rows["gather-broadcast baseline"] == f"{base.seconds * 1e3:.3f} ms"
    assert rows["speedup over baseline"] == f"{base.seconds / pred.seconds:.2f}x"


def test_cli_simulate_plot(llama_config, tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "sim.png"
    args = ["simulate", "--model", llama_config, "--train", "tp=1", "--plot", str(out)]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "matplotlib", None)  # as if not installed
        assert main(args) == 2
        assert capsys.readouterr().err.strip() == (
            "nemo-refit-reshard: error: --plot needs matplotlib, which is not installed: "
            "pip install -e '.[plot]' (or pip install matplotlib)"
        )
    pytest.importorskip("matplotlib")
    assert main(args) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_cli_simulate_rejects_bad_cluster(llama_config, capsys) -> None:
    assert main(["simulate", "--model", llama_config, "--cluster", "nic=1"]) == 2
    assert "unknown cluster key 'nic'" in capsys.readouterr().err


def test_cli_simulate_relay_auto_picks_the_faster_plan(llama_config, capsys) -> None:
    base = [
        "simulate",
        "--model",
        llama_config,
        "--train",
        "tp=1",
        "--infer",
        "tp=1,dp=4",
        "--cluster",
        "gpus_per_node=8,nvlink_latency_us=1e-6,nic_latency_us=1e-6",  # bandwidth-bound
        "--json",
        "--bucket-mb",
        "0.01",
    ]
    seconds = {}
    for relay in ("none", "chain", "domain"):
        assert main([*base, "--relay", relay]) == 0
        seconds[relay] = json.loads(capsys.readouterr().out)["predicted_s"]
    assert main([*base, "--relay", "auto"]) == 0
    report = json.loads(capsys.readouterr().out)
    best = min(seconds, key=seconds.get)
    assert report["relay"] == f"auto: {best}" and report["predicted_s"] == seconds[best]
    assert report["relay_choice"].startswith(f"{best}: predicted {seconds[best] * 1e3:.6g} ms; ")
    # one training GPU feeding four replicas on one node: forwarding wins
    assert best in ("chain", "domain") and seconds[best] < seconds["none"] / 3
    assert main(["plan", "--model", llama_config, "--relay", "auto"]) == 2
    assert "--relay auto needs a cluster model" in capsys.readouterr().err


def test_timeline_has_no_barrier_between_rounds() -> None:
    """Two independent pairs whose big messages fall in different rounds: the round model
    pays both (4 ms), the timeline only the longer chain of each pair (2 ms + 0.02 ms)."""
    from nemo_refit_reshard.plan import predict_timeline

    c = Cluster(gpus_per_node=1)  # every rank on its own node: all NIC
    plan = _plan(2, 2, [[(0, 2, 100 * MB), (1, 3, MB)], [(1, 3, 100 * MB), (0, 2, MB)]])
    placement = Placement.packed(2, 2, c)
    assert predict_refit(plan, Topology(c, placement)).seconds == approx(2 * (2e-3 + NIC_LAT))
    assert predict_timeline(plan, Topology(c, placement)) == approx(2e-3 + 0.02e-3 + 2 * NIC_LAT)
    # A dependency through a shared rank keeps the rounds in sequence.
    chained = _plan(1, 2, [[(0, 1, 100 * MB)], [(1, 2, 100 * MB)]])
    placement = Placement.packed(1, 2, c)
    assert predict_timeline(chained, Topology(c, placement)) == approx(2 * (2e-3 + NIC_LAT))


def test_cli_simulate_explicit_placement(llama_config, capsys) -> None:
    """Colocating the training rank with the inference ranks moves traffic onto NVLink."""
    base = [
        "simulate",
        "--model",
        llama_config,
        "--train",
        "tp=1",
        "--infer",
        "tp=2",
        "--cluster",
        "gpus_per_node=4",
        "--json",
    ]
    assert main(base) == 0
    separate = json.loads(capsys.readouterr().out)
    assert main([*base, "--placement", "0,0,0"]) == 0
    together = json.loads(capsys.readouterr().out)
    assert (separate["training_nodes"], separate["inference_nodes"]) == (1, 1)
    # NVLink has 9x the bandwidth and half the latency of the NIC
    assert together["predicted_s"] < separate["predicted_s"] / 2
    assert main([*base, "--placement", "0,0"]) == 2
    assert "placement names 2 node(s) but the refit group has" in capsys.readouterr().err
    assert main([*base, "--placement", "a,b,c"]) == 2
    assert "use 'separate' or a comma list of node ids" in capsys.readouterr().err


def test_cli_simulate_domain_relay(llama_config, capsys) -> None:
    args = ["simulate", "--model", llama_config, "--train", "tp=1", "--infer", "tp=2,dp=2"]
    args += ["--cluster", "gpus_per_node=4,nic_gbps=25", "--relay", "domain", "--json"]
    cluster = Cluster(gpus_per_node=4, nic_gbps=25)
    pred, floor, _ = _expected(llama_config, cluster, "domain")
    direct, _, _ = _expected(llama_config, cluster, "none")
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["predicted_s"] == pred.seconds and report["relay"] == "domain"
    # both replicas of a TP shard sit on the inference node: the training rank's NIC
    # carries one copy instead of two, the replicas pass the other over NVLink
    assert 2 * pred.gpu_bytes[0].sent_nic == direct.gpu_bytes[0].sent_nic
    assert sum(g.sent_nvlink for g in pred.gpu_bytes[1:]) == pred.gpu_bytes[0].sent_nic
    bad = ["plan", "--model", llama_config, "--train", "tp=1", "--relay", "domain"]
    assert main(bad) == 2
    assert "--relay domain needs a cluster model" in capsys.readouterr().err


def test_cli_simulate_chooses_uneven_pipeline_stages_and_says_so(tmp_path, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY_CONFIGS["llama"], num_hidden_layers=4)))
    args = ["simulate", "--model", str(path), "--train", "pp=3", "--infer", "tp=1"]
    assert main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        "note: 4 layers do not split over pp=3: simulating Megatron's "
        "num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1 "
        "(choose with --first-stage-layers / --last-stage-layers)"
    )
    # plan and demo keep Megatron's rule: an explicit error, not a guess
    assert main(["plan", "--model", str(path), "--train", "pp=3", "--infer", "tp=1"]) == 2
    assert "not divisible by pp=3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model, train, infer, gpus_per_node",
    [
        ("small-qwen3-moe", "pp=2,dp=2,ep=2", "tp=2,dp=2", 2),  # replicas on both sides
        ("small-qwen3-moe", "tp=2,ep=2,dp=2", "tp=1,dp=4", 4),
        ("small-qwen3", "tp=2,pp=2", "tp=2,dp=2", 8),  # one node each
    ],
)
def test_baseline_priced_from_layouts_equals_its_plan(
    model: str, train: str, infer: str, gpus_per_node: int
) -> None:
    """``simulate`` prices the gather-broadcast baseline from the layouts, never building
    its plan (11 million transfers at 256 GPUs): the same figures, bit for bit."""
    from nemo_refit_reshard.plan import predict_broadcast_layouts
    from nemo_refit_reshard.runner import RunConfig, build_layouts

    spec, src, dst = build_layouts(RunConfig(model=model, train=train, infer=infer))
    cluster = Cluster(gpus_per_node=gpus_per_node)
    links = Topology(cluster, Placement.packed(len(src), len(dst), cluster))
    want = predict_broadcast(plan_broadcast(spec, src, dst, bucket_mb=1), links)
    assert want.num_tensors == len(spec)
    assert want.broadcast_seconds > 0
    assert (want.gather_seconds > 0) == ("tp=2" in train)  # TP shards gather to a root
    assert predict_broadcast_layouts(spec, src, dst, links) == want
