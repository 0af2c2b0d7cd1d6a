"""Bounded memory: what a refit holds beyond the live weights, reported by the plan and
measured on the compiled programs (``plan/result/memory.py``, ``engine/fp8_rounds.py``).

A block-FP8 sender used to keep a derived e4m3 copy and scales of every whole-block
piece it sends (~0.5x its bytes) and a receiver a trained-dtype shadow of every e4m3
tensor it receives unquantized, for the program's whole life. Now a sender stages only
(it quantizes each run into its round's send staging) and a receiver's shadows share one
scratch buffer in slots that live from their first to their last round.

What is measured: every CPU tensor storage a program holds after it is compiled that is
not a live weight (found through the garbage collector, so nothing the program keeps
can hide), bytes exact."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from functools import partial
from math import prod
from pathlib import Path

import pytest
import torch

from nemo_refit_reshard.cli import main
from nemo_refit_reshard.engine.colocated import ColocatedHost
from nemo_refit_reshard.engine.program import TORCH_DTYPES, RankProgram
from nemo_refit_reshard.plan import Colocation, RefitPlan, plan_refit
from nemo_refit_reshard.runner import RunConfig, build_layouts
from tests.helpers.model_configs import FP8_MOE

# The dense layer's MLP crosses in BF16 (tp=2 cuts a block).
MOE = {**FP8_MOE, "intermediate_size": 384}
BUCKET_MB = 0.125  # several rounds, so shadows' slots come and go


@pytest.fixture()
def fp8_model(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MOE))
    return str(path)


def _plan(cfg: RunConfig, colocated: bool = False) -> RefitPlan:
    spec, sources, destinations = build_layouts(cfg)
    colocation = Colocation.same_index(len(sources), len(destinations)) if colocated else None
    return plan_refit(spec, sources, destinations, cfg.bucket_mb, colocation=colocation)


def _live(plan: RefitPlan, rank: int) -> dict[str, torch.Tensor]:
    return {
        name: torch.zeros(shape, dtype=TORCH_DTYPES[dtype])
        for name, (shape, dtype) in plan.expected_tensors(rank).items()
    }


def held_bytes(build: Callable[[], object], exclude: list[torch.Tensor]) -> tuple[object, int]:
    """``build()`` and the bytes of the CPU storages it holds afterwards, other than
    those of ``exclude`` (the live weights): every tensor the garbage collector sees that
    did not exist before, each storage counted once."""
    gc.collect()
    before = {id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor)}
    built = build()
    gc.collect()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and id(o) not in before and o.device.type == "cpu":
            st = o.untyped_storage()
            if st.data_ptr() not in skip and st.nbytes():
                storages[st.data_ptr()] = st.nbytes()
    return built, sum(storages.values())


def _first(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    return buffer[:nbytes]


def _separate_plans(fp8_model: str) -> dict[str, RefitPlan]:
    dense = RunConfig(model="small-qwen3", train="tp=2,pp=2", infer="tp=2,dp=2", bucket_mb=0.5)
    fp8 = RunConfig(model=fp8_model, train="tp=2", infer="engine_dp=2,ep=2", bucket_mb=BUCKET_MB)
    return {"dense": _plan(dense), "fp8": _plan(fp8)}


@pytest.mark.slow
def test_fp8_ranks_hold_no_quantized_copies_and_no_whole_shadows(fp8_model: str) -> None:
    """Beyond their staging, the FP8 refit's training ranks hold nothing after compiling
    (no quantized copy of what they send: it would not even fit the staging bound), and
    its inference ranks 2/3 of their shadows' bytes (block rows wait in scratch only until
    whole). Before: each training rank held derived e4m3 + scale tensors, each inference
    rank whole shadows."""
    plan = _separate_plans(fp8_model)["fp8"]
    assert plan.fp8_block is not None and plan.num_rounds > 2
    for rank in range(plan.num_sources + plan.num_destinations):
        live = _live(plan, rank)
        steps = plan.quantize_steps_of(rank)
        program, held = held_bytes(partial(RankProgram, plan, rank, live), list(live.values()))
        staging = program.staging_bytes  # type: ignore[attr-defined]
        messages = len(plan.messages_of(rank))
        assert staging <= 2 * plan.bucket_bytes + 16 * messages
        if rank < plan.num_sources:
            copies = sum(prod(q.shape) for q in steps)  # e4m3 bytes a derived copy holds
            assert copies > 2 * plan.bucket_bytes
            assert held - staging == 0, (rank, held, staging)
        else:
            shadows = sum(prod(q.shape) * 2 for q in steps)  # BF16
            assert (held - staging) * 3 == shadows * 2, (rank, held, staging, shadows)
        del program


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "fp8"])
@pytest.mark.parametrize("overlap", [False, True])
def test_reported_extra_bytes_are_what_each_rank_allocates(
    fp8_model: str, mode: str, overlap: bool
) -> None:
    """``rank_memory`` (what ``plan --json`` reports) equals, byte for byte, what every
    rank's compiled program holds beyond its live weights: staging, relay halves, and a
    FP8 receiver's shadow scratch."""
    from nemo_refit_reshard.plan.result.memory import rank_memory

    plan = _separate_plans(fp8_model)[mode]
    scratch = 0
    for rank in range(plan.num_sources + plan.num_destinations):
        live = _live(plan, rank)
        build = partial(RankProgram, plan, rank, live, overlap=overlap)
        program, held = held_bytes(build, list(live.values()))
        reported = rank_memory(plan, rank, overlap)
        assert held == reported.peak_extra_bytes, (mode, rank)
        assert program.staging_bytes == reported.staging + reported.relay  # type: ignore[attr-defined]
        scratch = max(scratch, reported.fp8_scratch)
        del program
    assert (scratch > 0) == (mode == "fp8")


def test_shadow_slots_never_overlap_while_live(fp8_model: str) -> None:
    """A receiver's shadows (the dense MLP's gate_up and down, in BF16) take slots of
    whole block rows from their first to their last round; no two slots live in a
    common round share a byte, and here the scratch is 2/3 of the shadows' bytes: the
    block rows of gate_up that one training rank sends whole are quantized in the round
    they arrive, while those its tp=2 cut at row 192 splits (and every block row of
    down_proj, cut at column 192) wait for both halves."""
    from nemo_refit_reshard.plan.result.memory import shadow_slots

    plan = _separate_plans(fp8_model)["fp8"]
    for d in range(plan.num_destinations):
        rank = plan.num_sources + d
        steps = plan.quantize_steps_of(rank)
        slots, size = shadow_slots(plan.messages_of(rank), steps, rank, plan.fp8_block)
        shadows = sum(prod(q.shape) * 2 for q in steps)
        assert {s.step.weight for s in slots} == {q.weight for q in steps}
        assert size * 3 == shadows * 2
        for a in slots:
            for b in slots:
                together = a.first <= b.last_use and b.first <= a.last_use
                apart = a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
                assert a is b or not together or apart


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "fp8"])
def test_colocated_extra_bytes_are_what_each_side_allocates(fp8_model: str, mode: str) -> None:
    """Colocated refit: a training rank holds its own send staging (less what it packs
    straight into its own guest's) and its guest's receive staging (shared memory,
    counted once, there); the vLLM worker only its FP8 shadow scratch (its receive staging
    is the host's). Dense: one round, so a host's send staging holds only the other
    guest's message."""
    from nemo_refit_reshard.plan.result.memory import rank_memory, staging_sizes

    if mode == "fp8":
        cfg = RunConfig(fp8_model, "tp=2", "engine_dp=2,ep=2", bucket_mb=BUCKET_MB)
    else:
        cfg = RunConfig("small-qwen3", "tp=2", "dp=2", bucket_mb=512)
    plan = _plan(cfg, colocated=True)
    s = plan.num_sources
    for rank in range(s):
        live = _live(plan, rank)
        share = plan if rank in plan.colocated_hosts else None
        host, held = held_bytes(
            partial(ColocatedHost, plan, share, rank, live), list(live.values())
        )
        try:
            assert held == rank_memory(plan, rank).peak_extra_bytes == host.staging_bytes  # type: ignore[attr-defined]
        finally:
            if host.staging is not None:  # type: ignore[attr-defined]
                host.staging.close()  # type: ignore[attr-defined]
        del host
    for d in range(plan.num_destinations):
        rank = s + d
        live = _live(plan, rank)
        recv = staging_sizes(plan.messages_of(rank), rank, plan.num_rounds).recv
        opened = torch.empty(recv, dtype=torch.uint8)  # the host's staging, opened
        guest = partial(RankProgram, plan, rank, live, make_recv_buffer=partial(_first, opened))
        program, held = held_bytes(guest, [*live.values(), opened])
        reported = rank_memory(plan, rank)
        assert held == reported.peak_extra_bytes == reported.fp8_scratch
        assert (held > 0) == (mode == "fp8")
        del program


def test_plan_json_reports_extra_bytes_per_rank(
    fp8_model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plan --json``: ``memory`` per refit-group rank for the plan built, and with
    ``--colocated`` the colocated plan's too; the plan and its fingerprint as before."""
    args = ["plan", "--model", fp8_model, "--train", "tp=2", "--infer", "engine_dp=2,ep=2"]
    args += ["--bucket-mb", str(BUCKET_MB), "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--colocated"]) == 0
    both = json.loads(capsys.readouterr().out)
    cfg = RunConfig(model=fp8_model, train="tp=2", infer="engine_dp=2,ep=2", bucket_mb=BUCKET_MB)
    from nemo_refit_reshard.plan.result.memory import memory_report

    separate = _plan(cfg)
    assert plain["fingerprint"] == both["fingerprint"] == separate.fingerprint
    assert plain["memory"] == both["memory"] == memory_report(separate)
    assert "colocated" not in plain
    colocated = _plan(cfg, colocated=True)
    assert both["colocated"] == {
        "fingerprint": colocated.fingerprint,
        "memory": memory_report(colocated),
    }
    memory = plain["memory"]
    ranks = separate.num_sources + separate.num_destinations
    assert len(memory["peak_extra_bytes"]) == ranks == len(memory["ranks"])
    assert memory["max_peak_extra_bytes"] == max(memory["peak_extra_bytes"])
    assert memory["staging_bound"] == 2 * separate.bucket_bytes


@pytest.mark.slow
def test_fp8_refit_is_bit_exact_with_per_round_quantization(fp8_model: str) -> None:
    """The FP8 refit (e4m3 quantized per run by the training ranks, shadows quantized out of
    scratch slots) on gloo with a small bucket: every inference rank's e4m3 weights and
    scales equal the canonical weights' quantization, bit for bit."""
    from nemo_refit_reshard.runner import run_local

    cfg = RunConfig(
        model=fp8_model, train="tp=2", infer="engine_dp=2,ep=2", bucket_mb=BUCKET_MB,
        steps=2, timeout_s=300, backends=("reshard",),
    )  # fmt: skip
    result = run_local(cfg)
    assert result.errors() == {}
    assert result.plan.num_rounds > 2
    for r in result.ranks[result.plan.num_sources :]:
        assert r["backends"]["reshard"]["mismatches"] == [], r["rank"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("bucket_mb", [BUCKET_MB, 0.03])
def test_per_round_quantization_in_one_process(
    fp8_model: str, device: str, bucket_mb: float
) -> None:
    """Every rank's compiled program in one process (``simulate_plan``), twice: each
    inference rank's e4m3 weights and scales, NaN before, equal the whole canonical
    weights' quantization bit for bit — e4m3 runs quantized into the staging by the
    training ranks, BF16 shadows' bands by the inference ranks. A 0.03 MiB bucket cuts
    e4m3 pieces inside a block row: the sender quantizes the whole block rows a run
    touches and stages its part (quantizing the run alone would give other scales). On
    CUDA the staging, scratch and quantization run on the GPU."""
    from nemo_refit_reshard.engine.materialize import SyntheticWeights, materialize
    from nemo_refit_reshard.engine.simulate import simulate_plan
    from nemo_refit_reshard.runner.destination import destination_tensors

    cfg = RunConfig(fp8_model, "tp=2", "engine_dp=2,ep=2", bucket_mb=bucket_mb)
    spec, sources, destinations = build_layouts(cfg)
    plan = plan_refit(spec, sources, destinations, cfg.bucket_mb)
    cut = {
        t.src_box.offsets[0] % 128 != 0
        for msgs in plan.rounds
        for msg in msgs
        for t in msg.transfers
        if "@" in t.src_tensor and t.dtype == "float8_e4m3fn"
    }
    assert cut == ({False, True} if bucket_mb < BUCKET_MB else {False})
    trained = SyntheticWeights(spec.unquantized(), seed=3)
    dev = torch.device(device)
    live = [materialize(lay, trained, device=dev) for lay in sources]
    dests = [
        destination_tensors(cfg, spec, lay, d, trained, dev) for d, lay in enumerate(destinations)
    ]
    assert any(plan.quantize_steps_of(plan.num_sources + d) for d in range(len(dests)))
    for _ in range(2):
        for d in dests:
            d.poison()
        simulate_plan(plan, live, [d.live for d in dests])
        for d in dests:
            assert d.mismatches() == []
