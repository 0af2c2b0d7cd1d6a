"""Delta refit's base check (``engine/delta/check.py``): weights changed outside the
refit are found before the step and their messages go dense, so every step still
arrives bit-exact; without the check (``DeltaOptions(check=False)``) the same changes
become permanent corruption (asserted too: the tests show what they guard against)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_refit_reshard.engine.delta.check import baseline_fingerprint, unit_sums
from nemo_refit_reshard.engine.delta.options import DeltaOptions
from tests.helpers.delta_threads import DeltaGroup
from tests.helpers.model_configs import MODELS


def _group(
    tmp_path: Path, check: bool, relay: str = "none", infer: str = "tp=2,dp=2", kernel="auto"
):
    options = DeltaOptions(check=check, cpu_kernel=kernel)
    return DeltaGroup(MODELS["qwen3"], tmp_path, "tp=2", infer, relay=relay, options=options)


def _received_dense(group: DeltaGroup, rank: int) -> int:
    return group.delta(rank).last.received.get("dense", 0)


def _clobber(tensor: torch.Tensor) -> None:
    """What vLLM's sleep(level=2) leaves, or a reload of other weights: other bytes."""
    tensor.copy_(torch.randn(tensor.shape).to(tensor.dtype))


@pytest.mark.parametrize("kernel", ["auto", "numpy"])
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_weights_changed_outside_the_refit_go_dense(
    tmp_path: Path, check: bool, kernel: str
) -> None:
    """With numba (``auto``) a sender fingerprints its baselines after the step; with
    numpy's path, each round's staging right after its encode (no second read)."""
    group = _group(tmp_path, check, kernel=kernel)
    s = group.num_sources
    try:
        group.refit()  # dense: every baseline filled
        group.train_step()
        group.refit()  # deltas
        assert group.mismatches() == [[]] * 4
        assert _received_dense(group, s + 1) == 0
        # inference rank 1's attention output weights replaced outside the refit
        tensors = group.inference[1].tensors
        name = next(n for n in sorted(tensors) if n.endswith("layers.0.self_attn.o_proj.weight"))
        _clobber(tensors[name])
        group.train_step()
        group.refit()
        if check:
            assert group.mismatches() == [[]] * 4
            assert _received_dense(group, s + 1) >= 1  # the message(s) holding it
            assert sum(group.delta(r).last.stale for r in range(s)) == _received_dense(group, s + 1)
            assert _received_dense(group, s + 3) == 0  # the untouched replica: deltas still
            group.train_step()
            group.refit()  # and the next step is deltas again, bit-exact
            assert group.mismatches() == [[]] * 4
            assert _received_dense(group, s + 1) == 0
        else:
            wrong = group.mismatches()
            assert wrong[1] != [] and wrong[0] == wrong[2] == wrong[3] == []
    finally:
        group.close()


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_a_prime_after_the_optimizer_step_is_caught(tmp_path: Path, check: bool) -> None:
    """``prime(v)`` declares the live tensors hold version ``v``; called after the
    trainer's optimizer step, the training ranks' baselines hold newer weights than the
    inference ranks: each delta would be taken against bytes the receiver never got."""
    group = _group(tmp_path, check)
    s = group.num_sources
    try:
        group.refit()  # version 0
        group.train_step()  # the trainer moves on before the new group primes
        for refitter in group.refitters:
            assert refitter.prime(0)
        group.train_step()
        group.refit()
        if check:
            assert group.mismatches() == [[]] * 4
            assert all(_received_dense(group, d) >= 1 for d in range(s, group.world))
        else:
            assert all(m != [] for m in group.mismatches())
    finally:
        group.close()


def test_a_chain_forwarder_is_checked_as_a_receiver_and_a_sender(tmp_path: Path) -> None:
    """A relay chain: an inference rank receives and forwards; a clobbered forwarder's
    message from its sender goes dense, and so does its forwarded one (its host
    baselines are of what it received, the next receiver holds those)."""
    group = _group(tmp_path, True, relay="chain", infer="tp=2,dp=4")
    try:
        group.refit()
        group.train_step()
        group.refit()
        for tensors in [group.inference[d].tensors for d in range(len(group.inference))]:
            _clobber(next(iter(sorted(tensors.items())))[1])
        group.train_step()
        group.refit()
        assert group.mismatches() == [[]] * 8
        assert sum(group.delta(r).last.stale for r in range(group.world)) > 0
    finally:
        group.close()


def test_fingerprints_are_sums_and_sums_of_squares_of_the_units() -> None:
    raw = torch.tensor([1, 0, 255, 255, 2, 0, 0, 128], dtype=torch.uint8)  # int16: 1, -1, 2, -32768
    assert unit_sums(raw, 2).tolist() == [1 - 1 + 2 - 32768, 1 + 1 + 4 + 32768**2]
    assert unit_sums(raw.view(torch.int16).view(2, 2)[:, :1], 2).tolist() == [3, 5]  # strided
    assert baseline_fingerprint(raw, 2, [(2, 4)]).tolist() == [1 + 2 - 32768, 1 + 4 + 32768**2]
    plus_minus = torch.tensor([2, 0, 0, 0], dtype=torch.uint8)  # a +1 and a -1 from 1, 1
    assert (
        unit_sums(plus_minus, 2)[0]
        == unit_sums(torch.tensor([1, 0, 1, 0], dtype=torch.uint8), 2)[0]
    )
    assert (
        unit_sums(plus_minus, 2)[1]
        != unit_sums(torch.tensor([1, 0, 1, 0], dtype=torch.uint8), 2)[1]
    )


def test_each_receiver_sends_sixteen_bytes_a_message(tmp_path: Path) -> None:
    group = _group(tmp_path, True)
    try:
        group.refit()
        group.train_step()
        group.refit()
        s = group.num_sources
        for r in range(group.world):
            incoming = sum(len(rnd.incoming) for rnd in group.delta(r).rounds)
            assert group.delta(r).last.check_bytes == 16 * incoming
        assert all(group.delta(r).last.check_bytes == 0 for r in range(s))  # no incoming
    finally:
        group.close()


def test_the_default_checks_gpu_ranks_not_cpu_ones(tmp_path: Path) -> None:
    """``check=None``: on for a GPU rank (its reads at HBM speed), off for a CPU rank
    (a full read each step costs more than its delta step: docs/benchmarks.md); a group
    runs the check only when every rank asks (engine/refit.py's gather)."""
    from nemo_refit_reshard.engine.delta import DeltaProgram
    from nemo_refit_reshard.engine.materialize import empty_like_layout
    from nemo_refit_reshard.engine.program import RankProgram
    from tests.helpers.fake_cuda import fake_cuda

    group = DeltaGroup(
        MODELS["qwen3"], tmp_path, "tp=2", "tp=2", options=DeltaOptions(cpu_kernel="numpy")
    )
    try:
        assert [group.delta(r).check for r in range(group.world)] == [False] * group.world
        group.refit()
        group.train_step()
        group.refit()
        assert all(group.delta(r).last.check_bytes == 0 for r in range(group.world))
        cuda = torch.device("cuda", 0)
        with fake_cuda():
            tensors = empty_like_layout(group.sources[0], 0.0, cuda)
            program = DeltaProgram(RankProgram(group.plan, 0, tensors, cuda), group.plan)
            program._gathering.shutdown()
        assert program.check is True
    finally:
        group.close()


def test_staged_fingerprints_equal_the_baselines(tmp_path: Path) -> None:
    """numpy's path takes a sender's fingerprints from each round's staging right after
    its encode: the same values the baselines give (what the receivers are held to)."""
    from nemo_refit_reshard.engine.delta.check import baseline_fingerprints

    group = _group(tmp_path, True, kernel="numpy")
    try:
        for _ in range(3):
            group.refit()
            group.train_step()
        for r in range(group.num_sources):
            program = group.delta(r)
            assert program.sender is None and program.base_fingerprints
            want = baseline_fingerprints(program)
            assert program.base_fingerprints.keys() == want.keys()
            assert all(torch.equal(program.base_fingerprints[k], want[k]) for k in want)
    finally:
        group.close()
