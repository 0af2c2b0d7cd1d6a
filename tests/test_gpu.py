"""GPU paths. Skipped cleanly without CUDA; the gloo tests cover the same plans on CPU."""

from __future__ import annotations

import json
import re

import pytest
import torch

from nemo_refit_reshard.engine.cupy_nccl import cupy_available
from nemo_refit_reshard.engine.materialize import empty_like_layout, materialize, mismatches
from nemo_refit_reshard.engine.simulate import simulate_plan
from nemo_refit_reshard.spec import InferParallel, TrainParallel
from tests.helpers.hf_models import TINY_CONFIGS
from tests.helpers.plan_checks import casting_moe_plan

# GPU-only tests carry the marker themselves; the gpu-check CPU twins run everywhere.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_compiled_programs_on_cuda_tensors() -> None:
    """Pack/unpack with CUDA staging and fp32 -> bf16 casts, all ranks in one process."""
    plan, spec, src, dst = casting_moe_plan()
    canonical = {t.name: torch.randn(t.shape) for t in spec}
    cuda = torch.device("cuda")
    sources = [materialize(lay, canonical, device=cuda) for lay in src]
    destinations = [empty_like_layout(lay, device=cuda) for lay in dst]
    simulate_plan(plan, sources, destinations)
    for lay, tensors in zip(dst, destinations):
        assert mismatches(lay, tensors, canonical) == []


@pytest.mark.gpu
@pytest.mark.skipif(
    not cupy_available() or torch.cuda.device_count() < 2,
    reason="needs CuPy and 2+ GPUs (NCCL refuses two ranks on one GPU)",
)
def test_cupy_nccl_refit_bit_exact(tmp_path) -> None:
    from nemo_refit_reshard.runner import RunConfig, run_local

    path = tmp_path / "llama.json"
    path.write_text(json.dumps(TINY_CONFIGS["llama"]))
    cfg = RunConfig(
        model=str(path), train="tp=1", infer="tp=1", steps=2, timeout_s=60, transport="cupy-nccl"
    )
    result = run_local(cfg, join_timeout_s=240)
    assert result.errors() == {}
    for rank in result.ranks[1:]:
        for entry in rank["backends"].values():
            assert entry["mismatches"] == []


def test_gpu_check_without_cuda_says_what_it_needs(monkeypatch, capsys) -> None:
    """One line, exit 1 (runs everywhere: CUDA is hidden here)."""
    from nemo_refit_reshard.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["gpu-check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(
        "gpu-check needs a CUDA GPU and CuPy (pip install -e '.[gpu]'); "
        "found torch.cuda.is_available()=False"
    )


@pytest.mark.slow
def test_gpu_check_program_checks_on_cpu() -> None:
    """The CPU twin of gpu-check's program checks: both programs compile and replay
    serially and overlapped through the loopback; the inference rank's tensors are
    bit-equal either way; no storage moved."""
    from nemo_refit_reshard.cli.gpu_check import run_program_checks
    from nemo_refit_reshard.layouts import MegatronOptions

    rows = run_program_checks(
        torch.device("cpu"), "small-qwen3", TrainParallel(tp=2, pp=2), InferParallel(tp=4, dp=2),
        1, 0, MegatronOptions(), repeats=1, bucket_mb=0.5,
    )  # fmt: skip
    assert "rounds, " in rows[0].figure and " 1 rounds" not in rows[0].figure
    # every copy grouped: a launch per message at most (CPU pairs are all dense here)
    assert re.search(r"\d+ copy launches for \d+ copies\)$", rows[0].figure)
    assert [r.check for r in rows] == [
        "pack, training rank 1",
        "replay training rank 1: serial / overlapped",
        "storage pointers unchanged, training rank 1",
        "unpack, inference rank 0",
        "replay inference rank 0: serial / overlapped",
        "bit-exact, inference rank 0: overlapped == serial",
        "storage pointers unchanged, inference rank 0",
    ]
    assert all(r.ok for r in rows), rows


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not cupy_available(), reason="needs CuPy")
def test_gpu_check_quick_passes() -> None:
    from nemo_refit_reshard.cli.gpu_check import run

    assert run(repeats=2, quick=True) == 0
