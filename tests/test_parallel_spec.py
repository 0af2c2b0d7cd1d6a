"""Parallelism grammar and rules, and the Megatron grid against Megatron's own code."""

from __future__ import annotations

import itertools

import pytest

from nemo_refit_reshard.layouts import megatron_layer_chunks, megatron_position, vllm_pp_indices
from nemo_refit_reshard.spec import InferParallel, TrainParallel


def test_parse_defaults_and_derived_sizes() -> None:
    p = TrainParallel.parse("tp=2,pp=2,dp=4,ep=4,etp=1")
    assert (p.tp, p.pp, p.vpp, p.cp, p.dp, p.ep, p.etp) == (2, 2, 1, 1, 4, 4, 1)
    assert p.world_size == 16 and p.edp == 2
    assert TrainParallel.parse("tp=4").etp == 4  # etp defaults to tp
    q = InferParallel.parse("tp=2,engine_dp=2,ep=4,dp=3")
    assert (q.engine_world_size, q.world_size, q.moe_size, q.expert_parallel) == (4, 12, 4, True)
    assert str(InferParallel.parse("")) == "tp=1,pp=1,dp=1,engine_dp=1,ep=1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tp=1,ep=16", "ep=16 needs dp to be a multiple of 16 (e.g. dp=16)"),
        ("tp=2,ep=4,dp=2", r"etp·ep = 2·4 = 8 does not divide tp·cp·dp = 2·1·2 = 4"),
        ("tp=2,dp=3,ep=2,etp=1,cp=1", "ep=2 needs dp to be a multiple of 1"),
        ("vpp=2", "vpp>1 needs pp>1"),
        ("tp=0", "tp=0 must be >= 1"),
        ("tp=two", "tp='two' is not an integer"),
        ("tp=2,tp=2", "'tp' given twice"),
        ("xp=2", "unknown training parallelism key 'xp'; allowed: tp, pp, vpp, cp, dp, ep, etp"),
        ("tp", "item 'tp' is not key=value"),
    ],
)
def test_train_rules(text: str, message: str) -> None:
    if text == "tp=2,dp=3,ep=2,etp=1,cp=1":
        assert TrainParallel.parse(text).edp == 3  # 2·3 = 6 is a multiple of 1·2: valid
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainParallel.parse(text)


def test_infer_rules() -> None:
    with pytest.raises(ValueError, match=r"ep=3 is not possible in vLLM.*use ep=4 or ep=1"):
        InferParallel.parse("tp=2,engine_dp=2,ep=3")
    with pytest.raises(ValueError, match="unknown inference parallelism key 'etp'"):
        InferParallel.parse("tp=2,etp=1")


# -- Megatron's own rank generator and layer split are the truth here ----------------------

GRIDS = [
    TrainParallel(tp=2, pp=2, dp=2),
    TrainParallel(tp=2, cp=2, dp=2, pp=2),
    TrainParallel(tp=2, pp=2, dp=2, ep=4, etp=1),
    TrainParallel(tp=1, pp=2, dp=4, ep=2),
    TrainParallel(tp=4, dp=2, ep=2, etp=2),
    TrainParallel(tp=2, cp=2, dp=2, ep=8, etp=1),
]


def _megatron_groups(p: TrainParallel) -> dict[str, list[list[int]]]:
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-dp-pp"  # initialize_model_parallel's default in megatron-core 0.16
    dense = RankGenerator(tp=p.tp, ep=1, dp=p.dp, pp=p.pp, cp=p.cp, order=order)
    expert = RankGenerator(tp=p.expert_tp, ep=p.ep, dp=p.edp, pp=p.pp, cp=1, order=order)
    return {
        "tp": dense.get_ranks("tp"),
        "cp": dense.get_ranks("cp"),
        "dp": dense.get_ranks("dp"),
        "pp": dense.get_ranks("pp"),
        "etp": expert.get_ranks("tp"),
        "ep": expert.get_ranks("ep"),
        "edp": expert.get_ranks("dp"),
    }


@pytest.mark.parametrize("par", GRIDS, ids=str)
def test_positions_match_megatron_rank_generator(par: TrainParallel) -> None:
    """Rank r's coordinate on axis X is its index in Megatron's X group that contains r."""
    groups = _megatron_groups(par)
    for rank in range(par.world_size):
        pos = megatron_position(par, rank).as_dict()
        for axis, axis_groups in groups.items():
            (group,) = [g for g in axis_groups if rank in g]
            assert group.index(rank) == pos[axis], (rank, axis)


def _megatron_split(num_layers, pp, vpp, first, last):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        pipeline_dtype=None if pp == 1 else __import__("torch").float32,
    )
    out = []
    for rank in range(pp):
        chunks = []
        for c in range(vpp):
            vp = c if vpp > 1 else None
            chunks.append(
                (
                    get_transformer_layer_offset(cfg, vp_stage=vp, pp_rank=rank),
                    get_num_layers_to_build(cfg, vp_stage=vp, pp_rank=rank),
                )
            )
        out.append(chunks)
    return out


@pytest.mark.parametrize(
    ("num_layers", "pp", "vpp", "first", "last"),
    [
        (8, 2, 1, None, None),
        (8, 2, 2, None, None),
        (12, 3, 2, None, None),
        (8, 2, 4, None, None),
        (7, 3, 1, 1, None),
        (7, 3, 1, None, 3),
        (10, 4, 1, 1, 3),
        (61, 16, 1, 3, 2),
        (14, 4, 2, 2, 4),
        (14, 4, 2, None, 2),
    ],
)
def test_layer_split_matches_megatron(num_layers, pp, vpp, first, last) -> None:
    par = TrainParallel(pp=pp, vpp=vpp)
    want = _megatron_split(num_layers, pp, vpp, first, last)
    got = [megatron_layer_chunks(num_layers, par, r, first, last) for r in range(pp)]
    assert got == want
    covered = sorted(i for stage in got for start, n in stage for i in range(start, start + n))
    assert covered == list(range(num_layers))


def test_layer_split_errors() -> None:
    with pytest.raises(ValueError, match="num_layers=61 is not divisible by pp=16"):
        megatron_layer_chunks(61, TrainParallel(pp=16), 0)
    with pytest.raises(ValueError, match="must divide evenly over the 2 middle stages"):
        megatron_layer_chunks(10, TrainParallel(pp=4), 0, 1, 2)
    with pytest.raises(ValueError, match="not divisible by vpp=4"):
        megatron_layer_chunks(12, TrainParallel(pp=2, vpp=4), 0)


@pytest.mark.parametrize(
    ("layers", "pp", "want"),
    # vLLM get_pp_indices: L//P each, the remainder to stages P-2, P-3, ...
    [
        (10, 4, [2, 3, 3, 2]),
        (11, 4, [3, 3, 3, 2]),
        (8, 4, [2, 2, 2, 2]),
        (3, 2, [2, 1]),
        (61, 8, [7, 7, 8, 8, 8, 8, 8, 7]),
        (5, 1, [5]),
    ],
)
def test_vllm_pp_indices(layers: int, pp: int, want: list[int]) -> None:
    sizes = [
        vllm_pp_indices(layers, r, pp)[1] - vllm_pp_indices(layers, r, pp)[0] for r in range(pp)
    ]
    assert sizes == want
    starts = [vllm_pp_indices(layers, r, pp)[0] for r in range(pp)]
    assert starts == list(itertools.accumulate([0] + want[:-1]))


def test_vllm_pp_partition_override() -> None:
    assert vllm_pp_indices(10, 1, 3, (2, 5, 3)) == (2, 7)
    with pytest.raises(ValueError, match="must have pp=3 entries summing to num_layers=10"):
        vllm_pp_indices(10, 1, 3, (2, 5, 4))
