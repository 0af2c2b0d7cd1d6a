"""Delta refit over real gloo groups (every rank a thread), with Adam steps between refits:
bit-exact every step, exact wire bytes, the dense fall-backs, and a corrupted baseline
caught by the exact checksums."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_refit_reshard.engine.checksum import combine, receiver_checksums, sender_checksums
from nemo_refit_reshard.engine.delta import FAILED, DeltaOptions
from nemo_refit_reshard.engine.delta import kernels as delta_kernels
from nemo_refit_reshard.engine.delta.codec import (
    HEADER_BYTES,
    choose_form,
    count_long_gaps,
    payload_bytes,
)
from nemo_refit_reshard.engine.program import TORCH_DTYPES
from nemo_refit_reshard.plan.analysis.delta import baseline_memory
from tests.helpers.delta_threads import DeltaGroup
from tests.helpers.hf_models import hf_config
from tests.helpers.model_configs import BLOCK_FP8, FP8_DIMS, MODELS

STEPS = 5


@pytest.fixture(params=["numba", "numpy"])
def kernel(request: pytest.FixtureRequest) -> str:
    """Every test on both CPU paths (``DeltaOptions.cpu_kernel``): same bytes, same ends."""
    if request.param == "numba" and not delta_kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    return request.param


def _expected_wire(group: DeltaGroup, before: dict[str, torch.Tensor]) -> int:
    """What the training ranks must send: per message of the plan, a header plus the
    smallest form given which of its units changed since ``before`` — found from the
    canonical weights (a message packs its transfers back to back, each row-major), not
    from the engine."""
    total = 0
    for r in range(group.num_sources):
        for m in group.plan.messages_of(r):
            if m.src != r:
                continue
            unit = min(TORCH_DTYPES[t.dtype].itemsize for t in m.transfers)
            positions, at = [], 0
            for t in m.transfers:
                dtype = TORCH_DTYPES[t.dtype]
                old = before[t.canonical][t.canonical_box.slices()].to(dtype)
                new = group.trained[t.canonical][t.canonical_box.slices()].to(dtype)
                ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
                diff = old.contiguous().view(ints) != new.contiguous().view(ints)
                assert dtype.itemsize == unit, "one dtype per message in these models"
                positions.append(torch.nonzero(diff.reshape(-1)).squeeze(1) + at)
                at += diff.numel()
            index = torch.cat(positions)
            k, long_gaps = index.numel(), count_long_gaps(index)
            form = choose_form(m.nbytes, unit, k, long_gaps)
            total += HEADER_BYTES + payload_bytes(form, m.nbytes, unit, k, long_gaps)
    return total


def _snapshot(group: DeltaGroup) -> dict[str, torch.Tensor]:
    return {name: group.trained[name].clone() for name in group.trained}


@pytest.mark.parametrize(
    "model, train, infer, bucket_mb",
    [
        ("qwen3", "tp=2", "tp=2,dp=2", 512),
        ("qwen3", "tp=2", "tp=2,dp=2", 0.01),  # dozens of rounds over one staging
        ("qwen3_moe", "tp=1,ep=2,dp=2", "tp=2", 512),
    ],
    ids=["dense", "dense-many-rounds", "moe"],
)
def test_five_adam_steps_arrive_bit_exact_in_exactly_the_predicted_bytes(
    tmp_path: Path, model: str, train: str, infer: str, bucket_mb: float, kernel: str
) -> None:
    options = DeltaOptions(cpu_kernel=kernel)
    group = DeltaGroup(MODELS[model], tmp_path, train, infer, bucket_mb=bucket_mb, options=options)
    assert (group.plan.num_rounds > 10) == (bucket_mb < 1)
    # the baselines the engine keeps are the ones `plan --delta` reports (computed apart)
    kept = [group.delta(r).baseline_bytes for r in range(group.world)]
    assert kept == baseline_memory(group.plan)
    forms: set[str] = set()
    try:
        group.refit()  # version 0: dense, every baseline filled
        assert group.mismatches() == [[]] * len(group.destinations)
        for _ in range(STEPS):
            before = _snapshot(group)
            group.train_step()
            group.refit()
            assert group.mismatches() == [[]] * len(group.destinations)
            sent, dense = group.wire_bytes()
            assert sent == _expected_wire(group, before)
            assert sent < dense
            stats = group.delta(0).last
            assert 0 < stats.changed < stats.units
            assert "dense" not in stats.forms
            forms.update(f for r in range(group.num_sources) for f in group.delta(r).last.forms)
        assert "gaps" in forms  # the changes of a few Adam steps lie close together
    finally:
        group.close()


def test_an_fp8_engine_compares_e4m3_and_scale_bytes_as_they_are(
    tmp_path: Path, kernel: str
) -> None:
    """Training ranks holding whole 128x128 blocks send e4m3 + scales: deltas of bytes."""
    group = DeltaGroup(
        MODELS["qwen3_fp8"],
        tmp_path,
        "tp=2",
        "tp=2",
        lr=1e-3,
        options=DeltaOptions(cpu_kernel=kernel),
    )
    try:
        group.refit()
        for _ in range(STEPS):
            group.train_step()
            group.refit()
            assert group.mismatches() == [[]] * len(group.destinations)
            forms = group.delta(0).last.forms
            assert sum(forms.values()) > forms.get("dense", 0)
    finally:
        group.close()


def test_bf16_shadows_take_dense_and_stay_exact(tmp_path: Path, kernel: str) -> None:
    """An FP8 engine whose blocks straddle training shards (384 MLP rows over tp=2: 192
    each) receives BF16 shadows it quantizes on arrival: it cannot re-pack those from
    its e4m3 weights, so their bytes travel every step; the rest go as deltas."""
    config = hf_config("qwen3", **dict(FP8_DIMS, intermediate_size=384))
    config["quantization_config"] = BLOCK_FP8
    group = DeltaGroup(
        config, tmp_path, "tp=2", "tp=1", lr=1e-5, options=DeltaOptions(cpu_kernel=kernel)
    )
    try:
        receiver = group.delta(group.num_sources)
        assert receiver.fixed_in  # (sender, round, byte ranges) it cannot re-pack
        fixed = sum(b - a for _, _, ranges in receiver.fixed_in for a, b in ranges)
        group.refit()
        for _ in range(3):
            dense = sum(r.span.numel() for rnd in receiver.rounds for r in rnd.incoming)
            group.train_step()
            group.refit()
            assert group.mismatches() == [[]]
            assert "dense" not in receiver.last.received
            sent, _ = group.wire_bytes()
            assert fixed < sent < dense
    finally:
        group.close()


def test_inference_ranks_forwarding_along_a_chain_send_deltas_from_host_baselines(
    tmp_path: Path, kernel: str
) -> None:
    """A relay chain makes inference ranks senders: they keep their baselines in host
    memory (no second copy of the model on an inference GPU) and forward deltas too."""
    group = DeltaGroup(
        MODELS["qwen3"],
        tmp_path,
        "tp=2",
        "tp=2,dp=4",
        relay="chain",
        options=DeltaOptions(cpu_kernel=kernel),
    )
    try:
        forwarders = [
            r
            for r in range(group.num_sources, group.world)
            if any(rnd.outgoing for rnd in group.delta(r).rounds)
        ]
        assert forwarders, "the plan has no chain"
        kept = [group.delta(r).baseline_bytes for r in range(group.world)]
        assert kept == baseline_memory(group.plan)
        group.refit()
        for _ in range(3):
            group.train_step()
            group.refit()
            assert group.mismatches() == [[]] * 8
            for r in forwarders:
                program = group.delta(r)
                assert program.baseline_bytes > 0
                assert all(b.device.type == "cpu" for b in program.baselines.values())
                assert "dense" not in program.last.forms
            assert "dense" not in group.delta(0).last.forms
    finally:
        group.close()


def test_a_receiver_that_lost_its_weights_gets_everything_and_ends_exact(
    tmp_path: Path, kernel: str
) -> None:
    group = DeltaGroup(
        MODELS["qwen3"], tmp_path, "tp=2", "tp=2,dp=2", options=DeltaOptions(cpu_kernel=kernel)
    )
    try:
        group.refit()
        group.train_step()
        group.refit()
        # rank 0 of the second engine slept and woke without its weights
        woken = group.num_sources + 2
        group.refitters[woken].forget_version()
        for t in group.tensors[woken].values():
            t.fill_(float("nan"))
        group.train_step()
        group.refit()
        assert group.mismatches() == [[]] * 4
        assert set(group.delta(woken).last.received) == {"dense"}
        assert "dense" not in group.delta(group.num_sources).last.received
        group.train_step()
        group.refit()  # back in step: deltas again
        assert "dense" not in group.delta(woken).last.received
        assert group.mismatches() == [[]] * 4
    finally:
        group.close()


def test_a_failed_rank_makes_the_next_step_dense_for_everyone(tmp_path: Path, kernel: str) -> None:
    group = DeltaGroup(
        MODELS["qwen3"], tmp_path, "tp=2", "tp=2,dp=2", options=DeltaOptions(cpu_kernel=kernel)
    )
    try:
        group.refit()
        group.delta(1).version = FAILED  # training rank 1's last step failed
        group.train_step()
        group.refit()
        assert group.mismatches() == [[]] * 4
        for r in range(group.world):
            last = group.delta(r).last
            assert set(last.forms) | set(last.received) == {"dense"}
        group.train_step()
        group.refit()
        assert "dense" not in group.delta(0).last.forms
    finally:
        group.close()


def test_every_anchor_version_is_dense(tmp_path: Path, kernel: str) -> None:
    group = DeltaGroup(
        MODELS["qwen3"], tmp_path, "tp=2", "tp=2", options=DeltaOptions(2, cpu_kernel=kernel)
    )
    try:
        group.refit()  # version 0
        forms = []
        for _ in range(4):
            group.train_step()
            group.refit()
            forms.append(set(group.delta(0).last.forms))
            assert group.mismatches() == [[]] * 2
        assert [f == {"dense"} for f in forms] == [False, True, False, True]
    finally:
        group.close()


def test_a_corrupted_sender_baseline_is_caught_by_the_checksums(
    tmp_path: Path, kernel: str
) -> None:
    """Training rank 0's baselines are made to hold this step's bytes already: it sends
    nothing of what changed, and the receivers' checksums disagree with the senders'."""
    group = DeltaGroup(
        MODELS["qwen3"], tmp_path, "tp=2", "tp=2", options=DeltaOptions(cpu_kernel=kernel)
    )
    try:
        group.refit()
        group.train_step()
        sender = group.delta(0)
        for phase, rnd in zip(sender.program.rounds, sender.rounds):
            phase.pack()
            for out in rnd.outgoing:
                sender.baselines[out.key].copy_(out.span)
        group.refit()
        shapes = {t.name: t.shape for t in group.spec}
        sent = combine(
            sender_checksums(group.plan.messages_of(r), r, group.tensors[r], shapes)
            for r in range(group.num_sources)
        )
        got = combine(
            receiver_checksums(
                layout, group.num_sources + d, group.tensors[group.num_sources + d], shapes
            )
            for d, layout in enumerate(group.destinations)
        )
        wrong = sorted(key for key in sent if sent[key] != got.get(key))
        assert wrong, "the corrupted baseline went unnoticed"
        assert all(rank >= group.num_sources for rank, _ in wrong)
        assert group.mismatches() != [[], []]
    finally:
        group.close()


def test_the_kernel_compares_direct_messages_where_they_live_and_never_packs_them(
    tmp_path: Path,
) -> None:
    """Compiled path: a training rank's messages are rows of its live tensors, so a delta
    step reads them there and leaves the send staging untouched (a sentinel survives),
    its DENSE replicas sent from the baseline; the engines end bit-exact."""
    if not delta_kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    options = DeltaOptions(cpu_kernel="numba")
    group = DeltaGroup(MODELS["qwen3"], tmp_path, "tp=2", "tp=2,dp=2", options=options)
    try:
        group.refit()
        senders = [group.delta(r) for r in range(group.num_sources)]
        for sender in senders:
            assert sender.sender is not None
            keys = {o.key for rnd in sender.rounds for o in rnd.outgoing}
            assert {key for direct in sender.sender.direct for key in direct} == keys
        # engine 1's first rank lost its weights: its message from each sender goes
        # DENSE, from the baseline the kernel just brought up to date
        woken = group.num_sources + 2
        group.refitters[woken].forget_version()
        for t in group.tensors[woken].values():
            t.fill_(float("nan"))
        group.train_step()
        for sender in senders:
            for buf in sender.program.send_buffers:
                buf.fill_(0xAB)
        group.refit()
        assert group.mismatches() == [[]] * 4
        assert set(group.delta(woken).last.received) == {"dense"}
        for sender in senders:
            # one message to each of the 4 engines' ranks: the woken one's whole
            assert sender.last.forms.get("dense") == 1 and sum(sender.last.forms.values()) == 4
            assert all(bool((buf == 0xAB).all()) for buf in sender.program.send_buffers)
    finally:
        group.close()


def test_the_batched_round_a_gpu_runs_gives_the_same_bytes_and_ends_exact(
    tmp_path: Path, kernel: str
) -> None:
    """CPU ranks apply each message as it arrives (``engine/delta/stream.py``); a GPU
    round waits for every header, then every payload (CuPy NCCL). The batched round, run
    here on every rank: the same bytes on the wire, every step bit-exact."""
    options = DeltaOptions(cpu_kernel=kernel)
    group = DeltaGroup(MODELS["qwen3_moe"], tmp_path, "tp=1,ep=2,dp=2", "tp=2", options=options)
    try:
        for r in range(group.world):
            assert group.delta(r).stream
            group.delta(r).stream = False
        group.refit()
        for _ in range(3):
            before = _snapshot(group)
            group.train_step()
            group.refit()
            assert group.mismatches() == [[]] * len(group.destinations)
            assert group.wire_bytes()[0] == _expected_wire(group, before)
    finally:
        group.close()


@pytest.mark.parametrize("relay, infer", [("none", "tp=2,dp=2"), ("chain", "tp=2,dp=4")])
def test_many_rounds_with_the_first_replica_woken_empty_end_exact(
    tmp_path: Path, kernel: str, relay: str, infer: str
) -> None:
    """Dozens of rounds over one staging; the first engine's first rank (the first
    receiver of its senders' shared messages) lost its weights: in every round it gets
    its messages whole — from the baseline where the compiled kernel read the message
    where it lives and never packed it — while its replicas get deltas; with a relay
    chain, forwarders' messages carry fixed ranges beside plain replicas."""
    options = DeltaOptions(cpu_kernel=kernel)
    group = DeltaGroup(
        MODELS["qwen3"], tmp_path, "tp=2", infer, relay=relay, options=options, bucket_mb=0.01
    )
    try:
        assert group.plan.num_rounds > 10
        group.refit()
        group.train_step()
        group.refit()
        woken = group.num_sources
        group.refitters[woken].forget_version()
        for t in group.tensors[woken].values():
            t.fill_(float("nan"))
        for _ in range(2):
            group.train_step()
            group.refit()
            assert group.mismatches() == [[]] * len(group.destinations)
        assert "dense" not in group.delta(woken).last.received  # back in step
    finally:
        group.close()


def test_a_failed_gather_after_the_compare_ahead_leaves_the_rank_failed(tmp_path: Path) -> None:
    """The compiled sender compares round 0 (moving its baselines) while the versions are
    gathered: if the gather fails, the rank is FAILED — its next step dense, never a
    delta against baselines the receivers do not hold."""
    if not delta_kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    options = DeltaOptions(cpu_kernel="numba")
    group = DeltaGroup(MODELS["qwen3"], tmp_path, "tp=2", "tp=2", options=options)
    try:
        group.refit()
        group.train_step()
        sender = group.delta(0)
        before = {key: b.clone() for key, b in sender.baselines.items()}

        def broken_gather() -> list[int]:
            raise RuntimeError("peer gone")

        with pytest.raises(RuntimeError, match="peer gone"):
            sender.gather_versions(broken_gather)
        assert sender.version == FAILED
        assert any(not torch.equal(before[k], b) for k, b in sender.baselines.items())
    finally:
        group.close()
