"""Planner properties on random models and random parallelism pairs.

Each case builds a plan, proves exact-once delivery structurally
(``verify_plan``), then replays it in one process on random canonical weights
and compares every destination element, bit for bit after the dtype cast.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from nemo_refit_reshard.layouts import (
    MegatronOptions,
    VllmOptions,
    dtensor_layout,
    fsdp2_tp_placements,
    megatron_layout,
    vllm_layout,
)
from nemo_refit_reshard.plan import RefitPlan, is_relay, plan_refit
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.plan_checks import assert_delivers_exactly
from tests.helpers.strategies import hf_configs, property_settings

SETTINGS = property_settings(60)


class _Parity:
    """A made-up two-node topology: ranks of equal parity share NVLink."""

    def link(self, src: int, dst: int) -> tuple[str, float]:
        return ("nvlink", 1 / 450e9) if src % 2 == dst % 2 else ("nic", 1 / 50e9)

    def latency(self, link: str) -> float:
        return 5e-6 if link == "nvlink" else 10e-6


def _check(
    spec,
    sources,
    destinations,
    bucket_mb: float,
    seed: int,
    relay: str = "none",
    links=None,
) -> RefitPlan:
    plan = plan_refit(spec, sources, destinations, bucket_mb=bucket_mb, relay=relay, links=links)
    assert_delivers_exactly(plan, spec, sources, destinations, seed)
    # The JSON round trip gives the same plan.
    again = RefitPlan.from_json(plan.to_json())
    assert again.fingerprint == plan.fingerprint and again.rounds == plan.rounds
    return plan


@pytest.mark.slow
@SETTINGS
@given(
    cfg=hf_configs(),
    train=st.fixed_dictionaries(
        {
            "tp": st.sampled_from([1, 2, 4]),
            "pp": st.sampled_from([1, 2, 3]),
            "dp": st.sampled_from([1, 2]),
            "ep": st.sampled_from([1, 2]),
            "etp": st.sampled_from([None, 1]),
        }
    ),
    infer=st.fixed_dictionaries(
        {
            "tp": st.sampled_from([1, 2, 4]),
            "pp": st.sampled_from([1, 2]),
            "dp": st.sampled_from([1, 2]),
            "engine_dp": st.sampled_from([1, 2]),
        }
    ),
    expert_parallel=st.booleans(),
    bucket_kb=st.sampled_from([1, 4, 512 * 1024]),
    src_fp32=st.booleans(),
    seed=st.integers(0, 2**16),
    relay=st.sampled_from(["none", "chain", "domain"]),
    topology=st.booleans(),
)
def test_megatron_to_vllm(
    cfg, train, infer, expert_parallel, bucket_kb, src_fp32, seed, relay, topology
) -> None:
    spec = spec_from_hf_config(dict(cfg, torch_dtype="float32"))
    try:
        tpar = TrainParallel(**train)
        ipar = InferParallel(**infer, ep=infer["tp"] * infer["engine_dp"] if expert_parallel else 1)
        mopts = MegatronOptions(params_dtype="float32" if src_fp32 else "bfloat16")
        sources = [megatron_layout(spec, tpar, r, mopts) for r in range(tpar.world_size)]
        vopts = VllmOptions(params_dtype="bfloat16")
        destinations = [vllm_layout(spec, ipar, r, vopts) for r in range(ipar.world_size)]
    except ValueError:
        assume(False)
        return
    links = _Parity() if topology or relay == "domain" else None
    plan = _check(spec, sources, destinations, bucket_kb / 1024, seed, relay, links)
    # Bytes moved = bytes needed, plus what training ranks hand a neighbour to carry
    # (leg 1 into a relay buffer; leg 2 delivers it and counts among the needed ones).
    carried = sum(
        t.nbytes
        for msgs in plan.rounds
        for m in msgs
        for t in m.transfers
        if is_relay(t.dst_tensor)
    )
    assert plan.stats.total_bytes == plan.stats.min_bytes + carried
    if links is None:
        assert carried == 0
    for rank in range(plan.num_sources + plan.num_destinations):  # slices = expanded plan
        assert plan.messages_of(rank) == [
            m for msgs in plan.rounds for m in msgs if rank in (m.src, m.dst)
        ]
    if relay == "chain":  # no rank sends the same box twice
        sent = [
            (t.src, t.src_tensor, t.src_box)
            for msgs in plan.rounds
            for m in msgs
            for t in m.transfers
        ]
        assert len(sent) == len(set(sent))


@SETTINGS
@given(
    cfg=hf_configs(),
    dp=st.integers(1, 3),
    tp=st.sampled_from([2, 3]),
    itp=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_dtensor_to_vllm(cfg, dp, tp, itp, seed) -> None:
    spec = spec_from_hf_config(dict(cfg, torch_dtype="float32"))
    sources = [dtensor_layout(spec, (dp, tp), r, fsdp2_tp_placements(tp)) for r in range(dp * tp)]
    try:
        ipar = InferParallel(tp=itp)
        destinations = [vllm_layout(spec, ipar, r) for r in range(ipar.world_size)]
    except ValueError:
        assume(False)
        return
    _check(spec, sources, destinations, 0.5, seed)
