"""The GRPO run's checks and plumbing without processes: refit checksums, canonical
reassembly, the broadcast plan's JSON, the test-only broken plan, config validation and
the example's ``--plot`` flag."""

from __future__ import annotations

import pytest
import torch

from nemo_refit_reshard.engine.checksum import (
    box_checksum,
    combine,
    compare,
    receiver_checksums,
    sender_checksums,
)
from nemo_refit_reshard.engine.materialize import (
    SyntheticWeights,
    canonical_from_ranks,
    materialize,
)
from nemo_refit_reshard.grpo_cpu.config import GrpoRunConfig
from nemo_refit_reshard.grpo_cpu.plans import (
    broadcast_plan_from_json,
    broadcast_plan_to_json,
    broadcast_without_canonical,
    build_layouts,
    without_canonical,
)
from nemo_refit_reshard.grpo_cpu.report import pop_plot_flag
from nemo_refit_reshard.grpo_cpu.task import policy_config
from nemo_refit_reshard.layouts.base import Box
from nemo_refit_reshard.plan import RankPlan, plan_broadcast, plan_refit, rank_plan
from nemo_refit_reshard.spec.parallel import InferParallel, TrainParallel

TRAIN, INFER = TrainParallel.parse("tp=2,pp=2"), InferParallel.parse("tp=2,dp=2")
DROPPED = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def world():
    """The toy policy, fp32 training layouts -> bf16 vLLM layouts (a casting refit), its
    plan, and every rank's tensors as a correct refit would leave them."""
    spec, sources, destinations = build_layouts(policy_config(), TRAIN, INFER, "bfloat16")
    plan = plan_refit(spec, sources, destinations, bucket_mb=0.01)  # several rounds
    weights = SyntheticWeights(spec, seed=5, dtype=torch.float32)
    src = [materialize(lay, weights) for lay in sources]
    dst = [materialize(lay, weights) for lay in destinations]
    shapes = {t.name: t.shape for t in spec}
    return spec, sources, destinations, plan, weights, src, dst, shapes


def _sums(plan, sources, destinations, src, dst, shapes):
    s = len(sources)
    sent = combine(
        sender_checksums(RankPlan.from_json(rank_plan(plan, r).to_json()).messages, r, t, shapes)
        for r, t in enumerate(src)
    )
    received = combine(
        receiver_checksums(lay, s + lay.rank, t, shapes) for lay, t in zip(destinations, dst)
    )
    return sent, received


def test_box_checksum_sees_one_element_a_swap_and_zeros() -> None:
    x = torch.randn(4, 6)
    box = Box((2, 0), (4, 6))
    base = box_checksum(x, "w", (8, 6), box)
    y = x.clone()
    y[1, 3] = torch.nextafter(y[1, 3], torch.tensor(10.0))  # one ulp
    assert box_checksum(y, "w", (8, 6), box) != base
    z = x.clone()
    z[0, 0], z[0, 1] = x[0, 1], x[0, 0]  # same values, swapped places
    assert box_checksum(z, "w", (8, 6), box) != base
    assert box_checksum(x, "v", (8, 6), box) != base  # another canonical tensor
    assert box_checksum(torch.zeros(4, 6), "w", (8, 6), box) != 0  # never-written counts
    # order independent: two halves sum to the whole
    top = box_checksum(x[:2], "w", (8, 6), Box((2, 0), (2, 6)))
    bottom = box_checksum(x[2:], "w", (8, 6), Box((4, 0), (2, 6)))
    assert (top + bottom) % 2**64 == base


def test_sender_and_receiver_checksums_agree_on_a_real_plan(world) -> None:
    spec, sources, destinations, plan, _, src, dst, shapes = world
    assert plan.num_rounds > 1
    sent, received = _sums(plan, sources, destinations, src, dst, shapes)
    assert compare(sent, received) == []
    # every destination tensor with a canonical element (vLLM tp rank 1's vocabulary
    # shard is all padding: 23 ids, padded to 64)
    assert len(received) == sum(1 for lay in destinations for t in lay.tensors if t.pieces)

    # one bf16 ulp in one destination tensor of inference rank 3
    bad = [dict(t) for t in dst]
    name = "model.layers.1.self_attn.qkv_proj.weight"
    bad[3][name] = bad[3][name].clone()
    bad[3][name].view(torch.int16)[5, 7] += 1
    _, received = _sums(plan, sources, destinations, src, bad, shapes)
    assert [(d, n) for d, n, _, _ in compare(sent, received)] == [(len(sources) + 3, name)]


def test_checksums_catch_a_plan_that_forgets_a_tensor(world) -> None:
    _, sources, destinations, plan, _, src, dst, shapes = world
    broken = without_canonical(plan, DROPPED)
    assert broken.fingerprint != plan.fingerprint
    sent, received = _sums(broken, sources, destinations, src, dst, shapes)
    flagged = {n for _, n, _, _ in compare(sent, received)}
    assert flagged == {"model.layers.0.mlp.down_proj.weight"}  # vLLM keeps the HF name
    with pytest.raises(ValueError, match="moves no 'nope'"):
        without_canonical(plan, "nope")


def test_canonical_from_ranks_round_trip_and_disagreement(world) -> None:
    spec, sources, destinations, _, weights, src, dst, shapes = world
    for layouts, tensors in ((sources, src), (destinations, dst)):
        rebuilt = canonical_from_ranks(shapes, layouts, tensors)
        for name, value in rebuilt.items():
            want = weights[name].to(tensors[0][next(iter(tensors[0]))].dtype).float()
            assert torch.equal(value, want), name
    # inference replicas 0 and 2 disagree on one element
    bad = [dict(t) for t in dst]
    w = "model.norm.weight"
    bad[2][w] = bad[2][w].clone()
    bad[2][w][0] += 1
    with pytest.raises(ValueError, match="rank 2 holds model.norm.weight"):
        canonical_from_ranks(shapes, destinations, bad)
    with pytest.raises(ValueError, match="held by no rank"):
        canonical_from_ranks(shapes, sources[:2], src[:2])  # pipeline stage 1 missing


def test_broadcast_plan_json_round_trip(world) -> None:
    spec, sources, destinations, *_ = world
    bplan = plan_broadcast(spec, sources, destinations, bucket_mb=0.01)
    assert broadcast_plan_from_json(broadcast_plan_to_json(bplan)) == bplan
    dropped = broadcast_without_canonical(bplan, DROPPED)
    assert dropped.total_bytes < bplan.total_bytes
    assert all(st.canonical != DROPPED for steps in dropped.rounds for st in steps)


def test_config_errors_are_clear() -> None:
    with pytest.raises(
        ValueError, match="unknown refit.backend 'nccl'; choose one of: reshard, broadcast"
    ):
        GrpoRunConfig.from_dict({"refit": {"backend": "nccl"}})
    with pytest.raises(ValueError, match="training parallelism tp=0 must be >= 1"):
        GrpoRunConfig.from_dict({"train": {"tp": 0}})
    with pytest.raises(ValueError, match="is not an integer"):
        GrpoRunConfig.from_dict({"infer": {"tp": "two"}})
    with pytest.raises(ValueError, match=r"unknown config key\(s\) grpo.lrr"):
        GrpoRunConfig.from_dict({"grpo": {"lrr": 1.0}})
    with pytest.raises(ValueError, match="max_new_tokens=3 but the task scores exactly"):
        GrpoRunConfig.from_dict({"grpo": {"max_new_tokens": 3}})
    with pytest.raises(ValueError, match="prompts_per_step=6 must split evenly over infer.dp"):
        GrpoRunConfig.from_dict({"grpo": {"prompts_per_step": 6}, "infer": {"dp": 4}})
    with pytest.raises(ValueError, match="cannot resize"):
        policy_config(vocab_size=30)
    cfg = GrpoRunConfig.from_dict(
        {"model": {"hidden_size": 128, "num_layers": 3}, "train": {"tp": 2, "pp": 3}}
    )
    assert cfg.policy["hidden_size"] == 128 and cfg.policy["num_hidden_layers"] == 3
    assert cfg.train == TrainParallel(tp=2, pp=3) and cfg.refit.backends == ("broadcast", "reshard")


def test_yaml_config_loads() -> None:
    from pathlib import Path

    from omegaconf import OmegaConf

    path = Path(__file__).parent.parent / "configs" / "grpo_cpu.yaml"
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    raw.pop("defaults")
    cfg = GrpoRunConfig.from_dict(raw)  # type: ignore[arg-type]
    assert cfg.refit.backend == "reshard" and cfg.num_steps == 20


def test_plot_flag_is_removed_before_hydra() -> None:
    argv = ["grpo_cpu.py", "--plot", "refit.backend=broadcast"]
    assert pop_plot_flag(argv) == "grpo_cpu.png" and argv == [
        "grpo_cpu.py",
        "refit.backend=broadcast",
    ]
    argv = ["grpo_cpu.py", "train.tp=2", "--plot", "out/r.png"]
    assert pop_plot_flag(argv) == "out/r.png" and argv == ["grpo_cpu.py", "train.tp=2"]
    argv = ["grpo_cpu.py", "--plot=x.png"]
    assert pop_plot_flag(argv) == "x.png" and argv == ["grpo_cpu.py"]
    assert pop_plot_flag(["grpo_cpu.py"]) is None
