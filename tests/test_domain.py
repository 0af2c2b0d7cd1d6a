"""``relay="domain"`` refinements: entry weights for runs of unequal width, and rings
across nodes where the training NICs would bind (``plan/pass2_fanout.py``,
``plan/pass4_routes/domain.py``)."""

from __future__ import annotations

import random
from fractions import Fraction

from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import Cluster, Placement, Topology, plan_refit, predict_refit
from nemo_refit_reshard.plan.pass4_routes.domain import _largest_first, entry_weights
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.hf_models import TINY_CONFIGS
from tests.helpers.plan_checks import assert_delivers_exactly

SPEC = spec_from_hf_config(dict(TINY_CONFIGS["llama"], torch_dtype="float32"))


def _member_shares(widths: tuple[int, ...]) -> list[list[Fraction]]:
    """Per run, each member's share of a group's entries under ``entry_weights``."""
    weights = [Fraction(w).limit_denominator(10**6) for w in entry_weights(widths)]
    shares = [[Fraction(0)] * w for w in widths]
    for j, x in enumerate(weights):
        for k, w in enumerate(widths):
            shares[k][j % w] += x
    return shares


def test_entry_weights_spread_every_run_evenly() -> None:
    # equal runs: every position the same
    assert _member_shares((8, 8)) == [[Fraction(1, 8)] * 8] * 2
    # 9 and 7 members (DeepSeek-V3's TP8 x DP16 over 72 + 56 GPUs): each of the 7 takes
    # 1/7 (its NIC is what binds), the 9 take at most that
    wide, narrow = _member_shares((9, 7))
    assert all(abs(x - Fraction(1, 7)) < Fraction(1, 500) for x in narrow)
    assert max(wide) <= Fraction(1, 7) + Fraction(1, 500) and sum(wide) == 1
    # a single-member run takes everything whatever the rest
    assert _member_shares((3, 1))[1] == [1]


def test_training_egress_binding_joins_lone_replicas_into_a_ring() -> None:
    """One training GPU, four replicas each alone on its own node: sending four copies
    would take 4x the time one inference NIC needs. The four become one ring across
    nodes: one copy leaves the training GPU, each replica forwards what entered it."""
    cluster = Cluster(gpus_per_node=1, nvlink_latency_us=0.01, nic_latency_us=0.02)
    placement = Placement.packed(1, 4, cluster)
    links = Topology(cluster, placement)
    sources = [megatron_layout(SPEC, TrainParallel(), 0)]
    destinations = [vllm_layout(SPEC, InferParallel(dp=4), r) for r in range(4)]
    direct = plan_refit(SPEC, sources, destinations, 0.05, relay="none", links=links)
    plan = plan_refit(SPEC, sources, destinations, 0.05, relay="domain", links=links)
    model = plan.stats.min_bytes // 4
    assert plan.relay_chains == ((1, 2, 3, 4),)
    assert plan.stats.bytes_sent[0] == model == direct.stats.bytes_sent[0] // 4
    assert plan.stats.bytes_received[1:] == (model,) * 4
    assert sum(plan.stats.bytes_sent[1:]) == 3 * model  # three hops around the ring
    assert_delivers_exactly(plan, SPEC, sources, destinations)
    assert (
        predict_refit(plan, Topology(cluster, placement)).seconds
        < 0.5 * predict_refit(direct, Topology(cluster, placement)).seconds
    )


def test_entries_take_transfers_largest_first_as_the_tuple_order_does() -> None:
    """``domain_entries`` orders transfers by ``(-size, receiver, sender, position)``
    through one integer per transfer: the same order as the tuples, ties included."""
    rng = random.Random(7)
    sizes = [rng.choice([0, 1, 64, 4096, 2**33]) for _ in range(2000)]
    dsts = [rng.randrange(300, 320) for _ in sizes]
    srcs = [rng.randrange(0, 300) for _ in sizes]
    want = [i for *_, i in sorted(zip([-x for x in sizes], dsts, srcs, range(len(sizes))))]
    assert _largest_first(sizes, dsts, srcs) == want
    assert _largest_first([], [], []) == []
