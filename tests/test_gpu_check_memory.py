"""``gpu-check`` on an 80 GB card: what it holds, which size it picks, and a table that
survives a check that raises. CUDA is stood in for where the check asks the device (its
name, its memory, its free bytes); the memory claim is arithmetic over programs compiled
on the meta device by the same function the check sizes its buffers by."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from nemo_refit_reshard.cli import gpu_check
from nemo_refit_reshard.cli.gpu_check import FULL, RankCase, Row, case_memory
from nemo_refit_reshard.cli.gpu_check_memory import (
    CONTEXT_RESERVE_BYTES,
    GB,
    GIB,
    RankMemory,
    nccl_bytes,
    reference_bytes,
)

CARD_80GB = 80 * GB  # an H100 80GB's memory, rounded down (torch reports 85.0e9 bytes)


@pytest.mark.slow
def test_the_full_check_fits_an_80gb_card() -> None:
    """DeepSeek-V3 ``pp=16,dp=16,ep=16 -> tp=32,dp=8``: inference rank 0 holds 40.9 GiB of
    tensors; with the reference copy capped at 1 GiB each side its checks peak near
    49 GiB, the CUDA context included. Sized as before (a reference copy of every byte
    moved) they would need about 129 GiB."""
    training, inference = case_memory(FULL)
    assert (training.label, inference.label) == ("training rank 16", "inference rank 0")
    assert round(inference.tensors / GIB, 1) == 40.9
    assert inference.moved == inference.tensors  # rank 0 receives every byte it holds
    assert inference.reference == training.reference == GIB
    for mem in (training, inference):
        assert mem.peak <= CARD_80GB, (mem.label, mem.peak / GB)
    assert nccl_bytes(gpu_check.NCCL_SIZES_MIB[False]) + CONTEXT_RESERVE_BYTES <= CARD_80GB
    before_the_fix = replace(inference, reference=inference.moved)
    assert before_the_fix.peak > CARD_80GB
    assert round(before_the_fix.peak / GIB) == 129


def test_the_reference_copy_is_capped_at_one_gib() -> None:
    assert reference_bytes(0) == 1 << 20
    assert reference_bytes(300 << 20) == 300 << 20
    assert reference_bytes(43_936_587_776) == GIB


def test_quick_is_chosen_under_100gb_and_said_so(capsys) -> None:
    assert gpu_check.choose_quick(None, "NVIDIA H100 80GB HBM3", 85_031_714_816) is True
    assert capsys.readouterr().out.splitlines() == [
        "gpu-check: --quick chosen: NVIDIA H100 80GB HBM3 has 85 GB, under 100 GB "
        "(--full: DeepSeek-V3 scale)"
    ]
    assert gpu_check.choose_quick(None, "NVIDIA H200", 150_754_820_096) is False
    assert gpu_check.choose_quick(False, "NVIDIA H100 80GB HBM3", 85_031_714_816) is False
    assert gpu_check.choose_quick(True, "NVIDIA H200", 150_754_820_096) is True
    assert capsys.readouterr().out == ""


def test_quick_and_full_flags() -> None:
    from nemo_refit_reshard.cli.parser import make_parser

    parse = make_parser().parse_args
    assert parse(["gpu-check"]).quick is None
    assert parse(["gpu-check", "--quick"]).quick is True
    assert parse(["gpu-check", "--full"]).quick is False
    with pytest.raises(SystemExit):
        parse(["gpu-check", "--quick", "--full"])


def _fake_h100(monkeypatch) -> None:
    """torch.cuda answering as one H100 80GB would, as far as ``run`` asks it."""
    from nemo_refit_reshard.engine import cupy_nccl

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cupy_nccl, "cupy_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=85 * GB)
    )
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_a_check_that_raises_is_a_failed_row_and_the_table_still_comes(monkeypatch, capsys) -> None:
    """NCCL raising (a multi-line error with a ``|`` in it) loses neither the program
    checks nor the table; the 80 GB card ran the small model."""
    _fake_h100(monkeypatch)
    seen = {}

    def nccl(device, sizes, repeats):
        seen["sizes"] = sizes
        raise RuntimeError("NCCL error: unhandled system error | ncclSystemError\ndetails")

    def programs(device, model, *args):
        seen["model"] = model
        return [Row("pack, training rank 1", "900 GB/s vs copy 1,000 GB/s", "0.90")]

    monkeypatch.setattr(gpu_check, "nccl_loopback_rows", nccl)
    monkeypatch.setattr(gpu_check, "run_program_checks", programs)
    assert gpu_check.run(repeats=1) == 1
    assert seen == {"sizes": [1, 16], "model": "small-qwen3"}
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "gpu-check: --quick chosen: NVIDIA H100 80GB HBM3 has 85 GB, under 100 GB "
        "(--full: DeepSeek-V3 scale)"
    )
    assert out[1].startswith("gpu-check on NVIDIA H100 80GB HBM3 (quick), ")
    assert out[2:] == [
        "| check | figure | ratio | ok |",
        "|---|---|---|---|",
        "| NCCL self send/recv: raised | RuntimeError: NCCL error: unhandled system error "
        "/ ncclSystemError | - | NO |",
        "| pack, training rank 1 | 900 GB/s vs copy 1,000 GB/s | 0.90 | yes |",
    ]


def test_one_ranks_failure_leaves_the_other_ranks_rows(monkeypatch) -> None:
    cases = [RankCase("training rank 1", None, 1, None, True),  # type: ignore[arg-type]
             RankCase("inference rank 0", None, 4, None, False)]  # type: ignore[arg-type]  # fmt: skip
    monkeypatch.setattr(gpu_check, "case_ranks", lambda case: cases)

    def rank_checks(r, device, repeats):
        if r.is_source:
            raise MemoryError("training rank 1's checks need 9.7 GiB, 3.0 GiB free")
        return [Row(f"unpack, {r.label}", "1 GB/s", "1.00")]

    monkeypatch.setattr(gpu_check, "_rank_checks", rank_checks)
    rows = gpu_check.run_program_checks(
        torch.device("cpu"), "small-qwen3", gpu_check.QUICK.train, gpu_check.QUICK.infer,
        1, 0, gpu_check.QUICK.options,
    )  # fmt: skip
    assert rows == [
        Row(
            "training rank 1: raised",
            "MemoryError: training rank 1's checks need 9.7 GiB, 3.0 GiB free",
            "-",
            False,
        ),
        Row("unpack, inference rank 0", "1 GB/s", "1.00"),
    ]


def test_checks_the_device_cannot_hold_are_refused_before_allocating(monkeypatch) -> None:
    mem = RankMemory("inference rank 0", 43_936_587_776, 845, 1_588_199_424, 1_058_803_712,
                     GIB, 402_653_184, 43_936_587_776)  # fmt: skip
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (30 * GIB, 79 * GIB))
    with pytest.raises(MemoryError) as err:
        gpu_check._fits(mem, torch.device("cuda", 0))
    assert str(err.value) == (
        "inference rank 0's checks need 47.4 GiB, 30.0 GiB free of 79.0 GiB: run --quick"
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (76 * GIB, 79 * GIB))
    gpu_check._fits(mem, torch.device("cuda", 0))  # fits: no error
