"""Time-budgeted rounds (``plan/pass5_rounds/timed.py``): the scheduler's own estimate
is the cluster model's prediction of the plan it returns, no round breaks its budget,
and even traffic comes out at the busiest link's time."""

from __future__ import annotations

import pytest

import nemo_refit_reshard.plan.pass5_rounds.rounds as rounds_module
from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout, vllm_layout
from nemo_refit_reshard.plan import (
    Cluster,
    Placement,
    Topology,
    bandwidth_floor,
    plan_refit,
    predict_refit,
    verify_plan,
)
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.hf_models import TINY_CONFIGS

SPEC = spec_from_hf_config(
    dict(TINY_CONFIGS["llama"], num_hidden_layers=3, vocab_size=256, torch_dtype="float32")
)
MOE = spec_from_hf_config(dict(TINY_CONFIGS["qwen3_moe"], torch_dtype="float32"))


@pytest.fixture()
def recorded(monkeypatch):
    """The ``TimedRounds`` of every plan built while the test runs."""
    out = []
    real = rounds_module.timed_schedule

    def record(*args, **kwargs):
        result = real(*args, **kwargs)
        out.append(result)
        return result

    monkeypatch.setattr(rounds_module, "timed_schedule", record)
    return out


CASES = [
    # (model, training, inference, GPUs per node, latencies (NVLink, NIC) in us, relay)
    (SPEC, "pp=2", "tp=2,dp=2", 2, (0.01, 0.02), "none"),  # carried legs, replicas
    (SPEC, "tp=2,pp=2", "tp=2,dp=2", 4, (0.01, 0.02), "none"),
    (SPEC, "tp=2,dp=2", "tp=1,dp=4", 2, (5.0, 10.0), "domain"),  # runs of 2
    (SPEC, "dp=4", "tp=2,dp=3", 3, (0.01, 0.02), "domain"),  # runs over node edges
    (MOE, "ep=2,dp=2", "tp=2,dp=2", 2, (0.01, 0.02), "domain"),
    (MOE, "tp=2,ep=2,etp=1", "tp=1,dp=4", 8, (0.01, 0.02), "none"),  # one node: NVLink
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}->{c[2]}/{c[3]}/{c[5]}" for c in CASES])
@pytest.mark.parametrize("bucket_mb", [0.01, 0.1])
def test_estimate_is_the_prediction_and_rounds_keep_their_budget(recorded, case, bucket_mb):
    spec, train, infer, gpus, (nvlink_us, nic_us), relay = case
    tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
    opts = MegatronOptions(num_layers_in_first_pipeline_stage=1 if tp.pp == 2 else None)
    sources = [megatron_layout(spec, tp, r, opts) for r in range(tp.world_size)]
    destinations = [vllm_layout(spec, ip, r) for r in range(ip.world_size)]
    cluster = Cluster(gpus_per_node=gpus, nvlink_latency_us=nvlink_us, nic_latency_us=nic_us)
    placement = Placement.packed(len(sources), len(destinations), cluster)
    plan = plan_refit(
        spec, sources, destinations, bucket_mb, relay=relay, links=Topology(cluster, placement)
    )
    verify_plan(plan, sources, destinations)
    (timed,) = recorded
    predicted = predict_refit(plan, Topology(cluster, placement))
    assert predicted.seconds == pytest.approx(timed.seconds, rel=1e-9)
    assert max(predicted.round_seconds) <= timed.budget * (1 + 1e-9)
    # every round's staging stays within the bucket, per rank and direction
    for msgs in plan.rounds:
        sent: dict[int, int] = {}
        received: dict[int, int] = {}
        for m in msgs:
            sent[m.src] = sent.get(m.src, 0) + m.nbytes
            received[m.dst] = received.get(m.dst, 0) + m.nbytes
        assert max(sent.values()) <= plan.bucket_bytes
        assert max(received.values()) <= plan.bucket_bytes


def test_even_traffic_runs_at_the_busiest_links_time(recorded) -> None:
    """4 data-parallel training GPUs (each holding everything) on one node, vLLM tp=4 on
    the next: each inference GPU must take in its shard (KV heads replicated, so a bit
    more than a quarter) through its NIC, and the training NICs can share that evenly.
    With message latency 1000x below the transfer time and buckets of many rows, the
    plan takes within 2 % of the busiest NIC's bytes / bandwidth."""
    tp, ip = TrainParallel(dp=4), InferParallel(tp=4)
    sources = [megatron_layout(SPEC, tp, r) for r in range(4)]
    destinations = [vllm_layout(SPEC, ip, r) for r in range(4)]
    cluster = Cluster(gpus_per_node=4, nvlink_latency_us=0.001, nic_latency_us=0.002)
    placement = Placement.packed(4, 4, cluster)
    for bucket_mb in (0.02, 0.05, 1):
        plan = plan_refit(
            SPEC, sources, destinations, bucket_mb, relay="none", links=Topology(cluster, placement)
        )
        busiest = max(max(plan.stats.bytes_sent), max(plan.stats.bytes_received))
        assert max(plan.stats.bytes_received[4:]) == busiest  # the inference NICs bind
        bound = busiest / cluster.nic_bytes_per_s
        floor = bandwidth_floor(plan, sources, destinations, Topology(cluster, placement)).seconds
        predicted = predict_refit(plan, Topology(cluster, placement)).seconds
        assert floor < bound <= predicted <= 1.02 * bound, bucket_mb


def test_a_price_fill_stops_only_when_it_cannot_win() -> None:
    """``Limit``: spent above the best loses; equal loses unless it ranks first on ties;
    spent plus the busiest link's remaining work above the best (beyond rounding) loses."""
    from nemo_refit_reshard.plan.pass5_rounds.price_limit import Limit

    later, earlier = Limit(1.0, False, []), Limit(1.0, True, [])
    assert later.beaten_by(1.0, 0.0) and not earlier.beaten_by(1.0, 0.0)
    assert later.beaten_by(1.5, 0.0) and earlier.beaten_by(1.5, 0.0)
    assert not later.beaten_by(0.6, 0.4)  # exactly the best: may still tie, keep filling
    assert later.beaten_by(0.6, 0.41)
    assert not later.beaten_by(0.5, 0.4)


def _moe_budget_args(monkeypatch) -> tuple:
    """The arguments of the first budget choice of a small MoE plan whose latencies are
    small enough that no budget sits at the latency floor (five budgets priced)."""
    import nemo_refit_reshard.plan.pass5_rounds.timed as timed

    chosen = []
    real_choose = timed.choose_budget
    monkeypatch.setattr(
        timed, "choose_budget", lambda *a, **k: chosen.append(a[:4]) or real_choose(*a, **k)
    )
    tp, ip = TrainParallel.parse("ep=2,dp=2"), InferParallel.parse("tp=2,dp=2")
    sources = [megatron_layout(MOE, tp, r) for r in range(tp.world_size)]
    destinations = [vllm_layout(MOE, ip, r) for r in range(ip.world_size)]
    cluster = Cluster(gpus_per_node=2, nvlink_latency_us=0.0001, nic_latency_us=0.0002)
    placement = Placement.packed(len(sources), len(destinations), cluster)
    plan_refit(MOE, sources, destinations, 0.02, relay="domain", links=Topology(cluster, placement))
    monkeypatch.undo()
    return chosen[0]


class _NeverStop:
    """A ``Limit`` that lets every price fill run to its end."""

    def __init__(self, seconds: float, ties_win: bool, totals: list[float]) -> None:
        pass

    def beaten_by(self, spent: float, ahead: float) -> bool:
        return False


def test_a_price_fills_later_bound_never_exceeds_what_its_later_rounds_take(monkeypatch):
    """``LaterBound``: after every finished round of a price fill, its time so far plus
    the bound on the rounds after it stays within the fill's total; message latencies
    (a pair goes in at least ``ceil(left / cap)`` more rounds) make the bound tighter
    than the busy seconds alone."""
    import math

    import nemo_refit_reshard.plan.pass5_rounds.budget as budget
    import nemo_refit_reshard.plan.pass5_rounds.price_limit as price_limit

    args = _moe_budget_args(monkeypatch)
    bounds = []  # every fill's ``LaterBound``, with what it returned after each round
    real_init, real_finish = price_limit.LaterBound.__init__, price_limit.LaterBound.finish

    def init(self, pairs, rounds, totals, caps=None):
        # the caps the fill passes (one per capacity class) are every pair's own
        assert caps == [price_limit.round_cap(p, rounds) for p in pairs]
        real_init(self, pairs, rounds, totals, caps)
        self.rounds, self.steps, self.counted = rounds, [], []
        bounds.append(self)

    def finish(self, busy):
        bound = real_finish(self, busy)
        self.steps.append((bound, bound - max(self.ahead)))
        self.counted.append(list(self.messages))  # messages it counts after the round
        return bound

    monkeypatch.setattr(budget, "Limit", _NeverStop)
    monkeypatch.setattr(price_limit.LaterBound, "__init__", init)
    monkeypatch.setattr(price_limit.LaterBound, "finish", finish)
    budget.choose_budget(*args, stop_at=math.inf)  # every budget priced under a limit
    assert len(bounds) == 5
    message_terms = [term for b in bounds for _, term in b.steps]
    assert max(message_terms) > 0 and min(message_terms) >= 0
    for b in bounds:
        rounds = b.rounds
        total, spent, exact = rounds.seconds(), 0.0, 0
        for r, ((ahead, _), counted) in enumerate(zip(b.steps, b.counted)):
            spent += rounds.round_seconds(r)
            assert spent + ahead <= total * (1 + 1e-9)
            # the messages every key really has in the rounds after round r
            later = [sum(c[k] for c in rounds.count[r + 1 :]) for k in range(len(counted))]
            assert all(n <= m for n, m in zip(counted, later))
            exact += sum(n == m > 0 for n, m in zip(counted, later))
        assert exact  # it counts some key's messages exactly


def test_price_fills_side_by_side_choose_what_full_fills_choose_and_stop_losers_early(
    monkeypatch,
):
    """``choose_budget`` fills its budgets side by side, the lowest bound first, and
    stops a fill once its bound shows it cannot win: the budget it returns is the one
    every fill run to its end picks, with fewer rounds filled; a fill that cannot beat
    ``stop_at`` ends early and nothing is returned."""
    import nemo_refit_reshard.plan.pass5_rounds.budget as budget

    args = _moe_budget_args(monkeypatch)
    filled = []  # (budget, rounds filled, finished) of every price fill
    real_fill = budget.fill

    def fill(pairs, rounds, placed, totals=None, log=None, setup=None):
        steps, done = 0, False
        try:
            for step in real_fill(pairs, rounds, placed, totals, log, setup):
                steps += 1
                yield step
            done = True
        finally:
            filled.append((rounds.tau, steps, done))

    monkeypatch.setattr(budget, "fill", fill)
    pruned = budget.choose_budget(*args)
    pruned_fills = list(filled)
    filled.clear()
    with monkeypatch.context() as m:
        m.setattr(budget, "Limit", _NeverStop)
        full = budget.choose_budget(*args)
    assert pruned == full
    assert len(filled) == 5 and all(done for _, _, done in filled)
    stopped = [(tau, steps) for tau, steps, done in pruned_fills if not done]
    assert stopped  # some fill stopped before its end
    full_steps = {tau: steps for tau, steps, _ in filled}
    # (a fill may be stopped right after its last round, before it says it is done)
    assert all(steps <= full_steps[tau] for tau, steps in stopped)
    assert sum(s for _, s, _ in pruned_fills) < sum(full_steps.values())
    # a limit no fill can beat: every fill stops early, none is chosen
    filled.clear()
    assert budget.choose_budget(*args, stop_at=full[0] * 0.9) is None
    assert filled and not any(done for _, _, done in filled)


def test_a_fill_takes_whole_transfers_in_message_order_then_whole_rows():
    """``fill.take`` with real transfers: per call, every next transfer (in message
    order) that fits whole, then as many whole rows of the one after as fit (of a
    one-row rest, whole elements of its next dimension: ``cut_rows``); what is left of a
    cut transfer goes first next time. Checked against taking them one by one (the plain
    loop it replaces) over a run of rooms, including rooms that fit no whole transfer,
    rooms inside a cut transfer's rest, and rooms past the end. A price fill's take
    (no ``placed``: bytes only) takes the same bytes call by call."""
    from nemo_refit_reshard.layouts.base import Box
    from nemo_refit_reshard.plan.base import Transfer, cut_rows
    from nemo_refit_reshard.plan.pass5_rounds.fill import queue_transfers, take
    from nemo_refit_reshard.plan.pass5_rounds.pair_loads import Pair

    def transfer(name: str, rows: int) -> Transfer:  # float32 rows of 4: 16 bytes a row
        box = Box((0, 0), (rows, 4))
        return Transfer(0, 1, name, box, name, box, name, box, "float32")

    # message order is by destination tensor: b, c, d, e (given shuffled)
    transfers = [transfer("d", 2), transfer("b", 8), transfer("e", 5), transfer("c", 3)]
    rooms = [40.0, 100.0, 130.0, 20.0, 15.9, 64.0, 48.0, 1000.0]

    pair = Pair(0, 1, -1, transfers)
    queue_transfers(pair)
    placed: list[list[Transfer]] = [[] for _ in rooms]
    got, cut_at = [], []  # per call: bytes, and (next transfer, bytes cut off it, what is left)
    for r, room in enumerate(rooms):
        got.append(take(pair, room, placed, r))
        rest = None if pair.cut is None else pair.cut.canonical_box.sizes
        cut_at.append((pair.head, pair.head_taken, rest))

    # one by one
    queue = sorted(transfers, key=lambda t: t.dst_tensor)
    expected_placed: list[list[Transfer]] = []
    expected_got = []
    for room in rooms:
        taken, nbytes = [], 0
        while queue and nbytes + queue[0].nbytes <= room:
            nbytes += queue[0].nbytes
            taken.append(queue.pop(0))
        if queue and room > nbytes:
            cut = cut_rows(queue[0], room - nbytes)
            if cut is not None:
                taken.append(cut[0])
                queue[0] = cut[1]
                nbytes += cut[0].nbytes
        expected_placed.append(taken)
        expected_got.append(nbytes)
    assert got == expected_got == [32, 96, 128, 16, 12, 4, 0, 0]
    assert placed == expected_placed
    assert pair.left == 0
    assert [t.dst_tensor for ts in placed for t in ts] == list("bbcdeeee")

    counted = Pair(0, 1, -1, transfers)
    queue_transfers(counted)
    states = []
    for r, room in enumerate(rooms):
        states.append(take(counted, room, None, r))
        assert (counted.head, counted.head_taken, counted.rest) == cut_at[r]
    assert states == expected_got
    # b cut after 2 of its 8 rows; e after 3 of its 5, then 1 more, then 3 of the last
    # row's 4 elements
    assert [rest for *_, rest in cut_at] == [(6, 4), None, (2, 4), (1, 4), (1, 1), None, None, None]
    assert counted.left == 0


def test_a_price_fills_placements_replayed_are_the_fill_with_transfers(monkeypatch):
    """A price fill counts the bytes a fill with the real transfers takes, so the
    schedule is its placements replayed (``fill.replay``): the same rounds of transfers,
    cuts included, and the same predicted seconds, as filling the budget again with the
    transfers built."""
    from nemo_refit_reshard.plan.pass5_rounds.budget import choose_budget
    from nemo_refit_reshard.plan.pass5_rounds.fill import fill, replay
    from nemo_refit_reshard.plan.pass5_rounds.pair_loads import RoundLoads

    pairs, bucket, latency, ranks = _moe_budget_args(monkeypatch)
    chosen = choose_budget(pairs, bucket, latency, ranks)
    assert chosen is not None

    built: list = []
    with_transfers = RoundLoads(chosen.budget, bucket, latency, ranks)
    for _ in fill(pairs, with_transfers, built):
        pass
    while built and not built[-1]:
        built.pop()

    log: list = []
    counted = RoundLoads(chosen.budget, bucket, latency, ranks)
    for _ in fill(pairs, counted, None, None, log):
        pass
    index = {p: i for i, p in enumerate(pairs)}
    placements = [(r, index[p], room) for r, p, room in log]
    assert placements == chosen.placements
    assert replay(pairs, placements) == built
    assert counted.seconds() == with_transfers.seconds() == chosen.seconds
    whole = {t for p in pairs for t in p.transfers}
    assert any(t not in whole for ts in built for t in ts)  # some transfers were cut


def test_fills_over_clones_share_one_setup_and_fill_as_each_would_alone(monkeypatch):
    """``FillSetup`` holds what no budget changes, by pair index: fills of several
    budgets over clones of the pairs, sharing the one built from the originals, place
    exactly what each fill builds for itself (same log, same seconds)."""
    from nemo_refit_reshard.plan.pass5_rounds.fill import fill
    from nemo_refit_reshard.plan.pass5_rounds.fill_setup import FillSetup
    from nemo_refit_reshard.plan.pass5_rounds.pair_loads import RoundLoads

    pairs, bucket, latency, ranks = _moe_budget_args(monkeypatch)
    setup = FillSetup(pairs, latency)
    assert len(setup.capacity_firsts) < len(pairs)  # pairs do share capacity terms
    longest = max(sum(p.nbytes * c for _, _, c, _ in p.now_time) for p in pairs)
    for tau in (longest / 3, longest / 5, longest / 8):
        alone, shared = [], []
        own = RoundLoads(tau, bucket, latency, ranks)
        for _ in fill(pairs, own, None, None, alone):
            pass
        clones = [p.clone() for p in pairs]
        with_setup = RoundLoads(tau, bucket, latency, ranks)
        for _ in fill(clones, with_setup, None, None, shared, setup):
            pass
        index = {p: i for i, p in enumerate(pairs)} | {p: i for i, p in enumerate(clones)}
        assert [(r, index[p], room) for r, p, room in shared] == [
            (r, index[p], room) for r, p, room in alone
        ]
        assert with_setup.seconds() == own.seconds()
        assert shared and {p for _, p, _ in shared} <= set(clones)  # the clones' own bytes
        assert all(p.left == 0 for p in clones)


def test_a_bucket_below_one_row_is_refused_not_filled_forever():
    """Staging buckets of 100 bytes hold no 256-byte row of the embedding: no budget's
    rounds can take it, so every budget is refused (rounds that stay empty while bytes
    are left end the fill) and the planner says to raise ``bucket_mb``."""
    tp, ip = TrainParallel.parse("dp=2"), InferParallel.parse("tp=2,dp=2")
    sources = [megatron_layout(SPEC, tp, r) for r in range(tp.world_size)]
    destinations = [vllm_layout(SPEC, ip, r) for r in range(ip.world_size)]
    assert SPEC.tensor("model.embed_tokens.weight").shape == (256, 64)  # float32 rows
    cluster = Cluster(gpus_per_node=2, nvlink_latency_us=0.01, nic_latency_us=0.02)
    links = Topology(cluster, Placement.packed(len(sources), len(destinations), cluster))
    with pytest.raises(ValueError, match=r"next whole row within the bucket\); raise bucket_mb"):
        plan_refit(SPEC, sources, destinations, 100 / 2**20, relay="none", links=links)
    plan = plan_refit(SPEC, sources, destinations, 1024 / 2**20, relay="none", links=links)
    verify_plan(plan, sources, destinations)


def test_the_schedule_without_carried_legs_is_priced_only_where_it_could_win(monkeypatch):
    """With carried transfers, the budgets are priced again with those transfers sent
    directly, unless that schedule's busiest link alone (``direct_floor``) already takes
    as long as the carried schedule: skipping it then leaves the plan as it was."""
    import nemo_refit_reshard.plan.pass5_rounds.timed as timed

    spec, train, infer, gpus, (nvlink_us, nic_us), relay = CASES[0]  # carried legs
    tp, ip = TrainParallel.parse(train), InferParallel.parse(infer)
    opts = MegatronOptions(num_layers_in_first_pipeline_stage=1)
    sources = [megatron_layout(spec, tp, r, opts) for r in range(tp.world_size)]
    destinations = [vllm_layout(spec, ip, r) for r in range(ip.world_size)]
    cluster = Cluster(gpus_per_node=gpus, nvlink_latency_us=nvlink_us, nic_latency_us=nic_us)
    links = Topology(cluster, Placement.packed(len(sources), len(destinations), cluster))

    priced: list[int] = []  # pairs of every budget choice
    real_choose = timed.choose_budget
    monkeypatch.setattr(
        timed, "choose_budget", lambda *a, **k: priced.append(len(a[0])) or real_choose(*a, **k)
    )

    def plan(bucket_mb: float, floor: bool) -> tuple[str, list[int]]:
        priced.clear()
        real = timed.timed_schedule
        with monkeypatch.context() as m:
            if not floor:  # always price the direct schedule
                m.setattr(rounds_module, "timed_schedule", lambda *a: real(*a[:6], 0.0))
            fingerprint = plan_refit(
                spec, sources, destinations, bucket_mb, relay=relay, links=links
            ).fingerprint
        return fingerprint, list(priced)

    # 0.1 MB: the direct schedule's busiest link takes longer than the carried plan
    skipped, always = plan(0.1, True), plan(0.1, False)
    assert len(skipped[1]) == 1 and len(always[1]) == 2 and skipped[0] == always[0]
    # 0.01 MB: it might win, so it is priced (and loses)
    assert len(plan(0.01, True)[1]) == 2


class _AlwaysFromEarliest:
    """``first_fit.FailedBefore`` that never skips a round: every search scans from its
    part's earliest round (the plain first fit)."""

    def start(self, keys: tuple, demands: tuple, earliest: int) -> int:
        return earliest

    def record(self, keys: tuple, demands: tuple, earliest: int, found: int) -> None:
        pass


@pytest.mark.parametrize("spec", [SPEC, MOE], ids=["dense", "moe"])
def test_chain_searches_resume_where_the_last_on_the_same_keys_failed_and_plan_the_same(
    spec, monkeypatch
):
    """A chain's first-fit search (``first_fit.FailedBefore``) starts where the last
    search on the same keys with no larger demands found no room: the plan is exactly the
    plain first fit's, and the resumed searches skip rounds."""
    import nemo_refit_reshard.plan.pass5_rounds.first_fit as schedule_module

    tp, ip = TrainParallel.parse("tp=2"), InferParallel.parse("tp=1,dp=4")
    sources = [megatron_layout(spec, tp, r) for r in range(tp.world_size)]
    destinations = [vllm_layout(spec, ip, r) for r in range(ip.world_size)]
    cluster = Cluster(gpus_per_node=2)
    links = Topology(cluster, Placement.packed(len(sources), len(destinations), cluster))

    skipped = []
    real = schedule_module.FailedBefore

    class Counting(real):
        def start(self, keys: tuple, demands: tuple, earliest: int) -> int:
            r = super().start(keys, demands, earliest)
            skipped.append(r - earliest)
            return r

    monkeypatch.setattr(schedule_module, "FailedBefore", Counting)
    resumed = plan_refit(spec, sources, destinations, 0.05, relay="chain", links=links)
    monkeypatch.setattr(schedule_module, "FailedBefore", _AlwaysFromEarliest)
    plain = plan_refit(spec, sources, destinations, 0.05, relay="chain", links=links)
    assert resumed.num_rounds > 10 and sum(skipped) > 0
    assert resumed.class_rounds == plain.class_rounds
    assert resumed.fingerprint == plain.fingerprint
