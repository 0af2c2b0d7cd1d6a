"""Colocated refit: the placement, the plan and the CPU twin of the same-GPU engine.

The local bytes are checked against an independent count (boxes intersected here, from
the layouts), the replay bit for bit against the canonical weights in every inference
process, which opens its host's staging through OS shared memory.
"""

from __future__ import annotations

import json
import math

import pytest

from nemo_refit_reshard.cli import main
from nemo_refit_reshard.plan import Colocation, PlanError, RefitPlan, plan_refit, rank_plan
from nemo_refit_reshard.plan.base import DTYPE_BYTES
from nemo_refit_reshard.plan.cluster import Cluster, Placement, Topology
from nemo_refit_reshard.runner import RunConfig, build_layouts, run_colocated
from nemo_refit_reshard.runner.colocated import BACKEND

MOE = RunConfig(model="small-qwen3-moe", train="tp=2,ep=2,dp=2", infer="tp=2,dp=2")
# Fewer inference ranks than training ranks: training ranks 2 and 3 host nobody.
DENSE = RunConfig(model="small-qwen3", train="tp=2,pp=2", infer="tp=2")


def test_placement_refusals_name_the_gpu() -> None:
    with pytest.raises(PlanError) as err:
        Colocation.from_devices(["n0:g0", "n0:g0"], ["n0:g0"])
    assert str(err.value) == (
        "colocated refit: GPU n0:g0 hosts training ranks 0 and 1; each GPU must host one "
        "training rank (fix the placement)"
    )
    with pytest.raises(PlanError) as err:
        Colocation.from_devices(["n0:g0", "n0:g1"], ["n0:g1", "n0:g2"])
    assert str(err.value) == (
        "colocated refit: inference rank 1 on GPU n0:g2 has no training rank on its GPU; "
        "place one there or run the separate-pools refit"
    )
    with pytest.raises(PlanError) as err:
        Colocation.from_devices(["n0:g0", "n0:g1"], ["n0:g1", "n0:g1"])
    assert "GPU n0:g1 hosts inference ranks 0 and 1" in str(err.value)
    assert Colocation.from_devices(["a", "b", "c"], ["c", "a"]).hosts == (2, 0)


def test_plan_refuses_relays_topology_and_bad_hosts() -> None:
    spec, sources, destinations = build_layouts(MOE)
    same = Colocation.same_index(len(sources), len(destinations))
    with pytest.raises(PlanError, match="relay='chain' with a colocated refit"):
        plan_refit(spec, sources, destinations, relay="chain", colocation=same)
    cluster = Cluster(gpus_per_node=8)
    topology = Topology(cluster, Placement.packed(len(sources), len(destinations), cluster))
    with pytest.raises(PlanError, match="plan it without the cluster"):
        plan_refit(spec, sources, destinations, links=topology, colocation=same)
    with pytest.raises(PlanError, match="put two inference ranks on one training rank's GPU"):
        plan_refit(spec, sources, destinations, colocation=Colocation((0, 0, 1, 2)))
    with pytest.raises(PlanError, match=r"host rank\(s\) \[7\] outside the 4 training ranks"):
        plan_refit(spec, sources, destinations, colocation=Colocation((0, 1, 2, 7)))


def _intersection(a, b) -> int:
    return math.prod(
        max(0, min(ao + an, bo + bn) - max(ao, bo))
        for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


@pytest.mark.parametrize("cfg", [MOE, DENSE], ids=["moe", "dense_fewer_workers"])
def test_host_sends_all_it_holds_locally(cfg: RunConfig) -> None:
    """Device-local bytes = every byte a destination needs that its host holds (counted
    here from the layouts); the rest crosses the interconnect; nothing beyond the minimum."""
    spec, sources, destinations = build_layouts(cfg)
    colocation = Colocation.same_index(len(sources), len(destinations))
    plan = plan_refit(spec, sources, destinations, bucket_mb=1, colocation=colocation)
    want_local = 0
    for d, layout in enumerate(destinations):
        held = list(sources[colocation.hosts[d]].pieces())
        for t in layout.tensors:
            for p in t.pieces:
                for q in held:
                    if q.canonical == p.canonical:
                        want_local += (
                            _intersection(p.canonical_box, q.canonical_box) * (DTYPE_BYTES[t.dtype])
                        )
    split = plan.colocated_bytes()
    assert split.local == want_local > 0
    assert split.local + split.network == plan.stats.total_bytes == plan.stats.min_bytes
    assert plan.replica_groups == ()  # replicas on different GPUs share no message


def test_colocated_plan_json_keeps_hosts_and_separate_plans_do_not_mention_them() -> None:
    spec, sources, destinations = build_layouts(MOE)
    plan = plan_refit(spec, sources, destinations, colocation=Colocation((3, 2, 1, 0)))
    again = RefitPlan.from_json(plan.to_json())
    assert again.colocated_hosts == (3, 2, 1, 0) and again.fingerprint == plan.fingerprint
    assert rank_plan(plan, 5).colocated_hosts == (3, 2, 1, 0)
    separate = plan_refit(spec, sources, destinations)
    assert "colocated_hosts" not in json.loads(separate.to_json())
    with pytest.raises(PlanError, match="not a colocated plan"):
        separate.colocated_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [MOE, DENSE], ids=["moe", "dense_fewer_workers"])
def test_cpu_twin_bit_exact(cfg: RunConfig) -> None:
    """Every inference process, its tensors NaN before each step, holds exactly the
    canonical weights after it; hosts' staging stays within the bucket."""
    from dataclasses import replace

    result = run_colocated(replace(cfg, steps=2, bucket_mb=1, timeout_s=300))
    assert result.errors() == {}
    s = result.plan.num_sources
    checked = [r for r in result.ranks if r["rank"] >= s]
    assert len(checked) == result.plan.num_destinations
    for r in checked:
        assert r["backends"][BACKEND]["mismatches"] == [], r["rank"]
    for r in result.ranks[:s]:
        assert len(r["backends"][BACKEND]["timings"]) == 2
        # own send buffer + guest staging, each at most one bucket (1 MiB) plus alignment
        assert r["backends"][BACKEND]["staging_bytes"] <= 2 * 2**20 + 4096


def test_demo_colocated_refuses_gpu_transports(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--colocated", "--transport", "cupy-nccl"]) == 2
    assert capsys.readouterr().err == (
        "nemo-refit-reshard: error: --colocated runs over gloo (with --device cuda on GPUs, "
        "the staging shared by CUDA IPC): the local runner puts several ranks on one GPU, "
        "which NCCL refuses\n"
    )


@pytest.mark.slow
def test_a_rank_dead_at_start_up_fails_the_run_within_the_transport_timeout() -> None:
    """Training rank 0 dies before it listens: its guest would wait for its address and
    the other training rank for the rendezvous (each up to the 900 s join deadline).
    The driver sees the failure and gives them the transport timeout (+5 s) to report,
    then stops them, naming why."""
    import time
    from dataclasses import replace

    cfg = replace(DENSE, steps=1, timeout_s=5, kill_rank=0, kill_step=-1)
    t0 = time.monotonic()
    result = run_colocated(cfg, join_timeout_s=900)
    assert time.monotonic() - t0 < 120  # not the 900 s deadline
    assert result.errors() == {
        0: "process died without a report (exit code 3)",
        **{
            r: "process died without a report (still running 10 s after rank 0 failed)"
            for r in range(1, 6)  # 4 training ranks, 2 inference ranks
        },
    }
