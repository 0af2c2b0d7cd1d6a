"""Property tests: for random models and parallelism, every layout tiles exactly.

* every element of every local tensor is covered by exactly one piece or padding box;
* the ranks of one side together hold every canonical element the framework stores;
* ranks a provider calls replicas hold identical pieces, and no others do.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from nemo_refit_reshard.layouts import (
    MegatronOptions,
    RankLayout,
    canonical_coverage,
    check_rank_layout,
    dtensor_layout,
    fsdp2_placements,
    fsdp2_tp_placements,
    megatron_layout,
    vllm_layout,
)
from nemo_refit_reshard.spec import InferParallel, ModelSpec, TrainParallel, spec_from_hf_config
from tests.helpers.strategies import hf_configs, property_settings

SETTINGS = property_settings(150)


def _layouts(make, world: int) -> list[RankLayout] | None:
    try:
        return [make(r) for r in range(world)]
    except ValueError:
        return None  # an impossible combination: the providers' rules are tested elsewhere


def _stored_by(spec: ModelSpec, framework: str) -> dict[str, int]:
    """Canonical tensors (and element counts) a whole world of ``framework`` must hold."""
    a = spec.arch
    out = {t.name: t.numel for t in spec}
    for k in range(a.num_mtp_layers):
        prefix = f"model.layers.{a.num_layers + k}."
        for name in list(out):
            if not name.startswith(prefix):
                continue
            if framework == "vllm":
                del out[name]  # vLLM's main model skips MTP layers
            elif framework == "megatron" and name.endswith(
                ("embed_tokens.weight", "shared_head.head.weight")
            ):
                del out[name]  # Megatron's MTP shares the main embedding and output layer
    if framework == "vllm" and a.moe is not None and a.moe.topk_method != "noaux_tc":
        # vLLM builds the correction bias only when config.json names noaux_tc.
        out = {k: v for k, v in out.items() if not k.endswith(".e_score_correction_bias")}
    return out


def _check_world(layouts: list[RankLayout], spec: ModelSpec) -> None:
    for layout in layouts:
        check_rank_layout(layout, spec)
    assert canonical_coverage(layouts, spec) == _stored_by(spec, layouts[0].framework)
    pieces = {lay.rank: {t.name: t.pieces for t in lay.tensors} for lay in layouts}
    for lay in layouts:
        for other in layouts:
            same = pieces[lay.rank] == pieces[other.rank]
            assert same == (other.rank in lay.replicas), (lay.rank, other.rank)


@pytest.mark.slow
@SETTINGS
@given(
    cfg=hf_configs(),
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2, 3]),
    vpp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    cp=st.sampled_from([1, 2]),
    ep=st.sampled_from([1, 2, 4]),
    etp=st.sampled_from([None, 1, 2]),
    layer_spec=st.sampled_from(["local", "te"]),
    grouped=st.booleans(),
    divisible_by=st.sampled_from([1, 8, 128]),
)
def test_megatron_layouts_tile(
    cfg, tp, pp, vpp, dp, cp, ep, etp, layer_spec, grouped, divisible_by
) -> None:
    spec = spec_from_hf_config(cfg)
    try:
        par = TrainParallel(tp=tp, pp=pp, vpp=vpp if pp > 1 else 1, dp=dp, cp=cp, ep=ep, etp=etp)
    except ValueError:
        assume(False)
        return
    opts = MegatronOptions(
        layer_spec=layer_spec, moe_grouped_gemm=grouped, make_vocab_size_divisible_by=divisible_by
    )
    layouts = _layouts(lambda r: megatron_layout(spec, par, r, opts), par.world_size)
    assume(layouts is not None)
    assert layouts is not None
    _check_world(layouts, spec)


@SETTINGS
@given(
    cfg=hf_configs(),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2, 3]),
    dp=st.sampled_from([1, 2]),
    engine_dp=st.sampled_from([1, 2]),
    expert_parallel=st.booleans(),
)
def test_vllm_layouts_tile(cfg, tp, pp, dp, engine_dp, expert_parallel) -> None:
    spec = spec_from_hf_config(cfg)
    par = InferParallel(
        tp=tp,
        pp=pp,
        dp=dp,
        engine_dp=engine_dp,
        ep=tp * engine_dp if expert_parallel else 1,
    )
    layouts = _layouts(lambda r: vllm_layout(spec, par, r), par.world_size)
    assume(layouts is not None)
    assert layouts is not None
    _check_world(layouts, spec)


@SETTINGS
@given(cfg=hf_configs(), dp=st.integers(1, 5), tp=st.sampled_from([1, 2, 3]))
def test_dtensor_layouts_tile(cfg, dp, tp) -> None:
    spec = spec_from_hf_config(cfg)
    if tp == 1:
        mesh, fn = (dp,), fsdp2_placements((dp,))
    else:
        mesh, fn = (dp, tp), fsdp2_tp_placements(tp)
    world = dp * tp
    _check_world([dtensor_layout(spec, mesh, r, fn) for r in range(world)], spec)
