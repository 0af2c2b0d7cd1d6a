"""``plan --json --delta``'s memory (``plan/analysis/delta_memory.py``) against what each
rank's ``DeltaProgram`` allocates, compiled on fake CUDA (``tests/helpers/fake_cuda.py``)
so that device and host memory are told apart as on a GPU: the baselines on the device
or in host memory, the scratch on the device, every rank, byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_refit_reshard.cli import main
from nemo_refit_reshard.engine.delta import DeltaProgram
from nemo_refit_reshard.engine.delta_options import DeltaOptions
from nemo_refit_reshard.engine.materialize import empty_like_layout
from nemo_refit_reshard.engine.program import RankProgram
from nemo_refit_reshard.layouts import refit_layouts
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.plan.analysis.delta_memory import DeltaMemory, delta_memory
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.fake_cuda import fake_cuda
from tests.helpers.model_configs import MODELS

CUDA = torch.device("cuda", 0)


def _allocated(plan, layouts, baseline: str) -> list[DeltaMemory]:
    """Every rank's DeltaProgram on fake CUDA, its allocations by place."""
    options = DeltaOptions(baseline=baseline, cpu_kernel="numpy")
    with fake_cuda():
        programs = [
            DeltaProgram(
                RankProgram(plan, r, empty_like_layout(lay, 0.0, CUDA), CUDA), plan, options
            )
            for r, lay in enumerate(layouts)
        ]
        for p in programs:
            p.learn_fixed([q.fixed_in for q in programs])
        out = []
        for p in programs:
            kept = list(p.baselines.values())
            out.append(
                DeltaMemory(
                    baselines=sum(b.numel() for b in kept if b.device.type == "cuda"),
                    host_baselines=sum(b.numel() for b in kept if b.device.type == "cpu"),
                    scratch=sum(
                        b.numel() for b in (p._encoded, p._received) if b.device.type == "cuda"
                    ),
                )
            )
            p._gathering.shutdown()
    return out


@pytest.mark.parametrize("baseline", ["device", "host"])
@pytest.mark.parametrize(
    "infer, relay", [("tp=2,dp=2", "none"), ("tp=2,dp=4", "chain")], ids=["direct", "chain"]
)
def test_reported_delta_memory_is_what_every_rank_allocates(
    infer: str, relay: str, baseline: str
) -> None:
    spec = spec_from_hf_config(MODELS["qwen3"])
    src, dst = refit_layouts(spec, TrainParallel.parse("tp=2"), InferParallel.parse(infer))
    plan = plan_refit(spec, src, dst, 0.05, relay=relay)
    reported = delta_memory(plan, baseline)
    assert reported == _allocated(plan, [*src, *dst], baseline)
    s = plan.num_sources
    assert all(m.baselines == 0 for m in reported[s:])  # inference ranks: host memory
    assert (relay == "chain") == any(m.host_baselines for m in reported[s:])
    assert all(m.scratch > 0 for m in reported)


def test_plan_json_counts_delta_bytes_in_the_peak(tmp_path: Path, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MODELS["qwen3"]))
    args = ["plan", "--model", str(path), "--train", "tp=2", "--infer", "tp=2,dp=2", "--json"]
    assert main(args) == 0
    dense = json.loads(capsys.readouterr().out)["memory"]
    reports = {}
    for place in ("device", "host"):
        assert main([*args, "--delta", "--delta-baseline", place]) == 0
        reports[place] = json.loads(capsys.readouterr().out)["memory"]
    spec = spec_from_hf_config(MODELS["qwen3"])
    src, dst = refit_layouts(spec, TrainParallel.parse("tp=2"), InferParallel.parse("tp=2,dp=2"))
    plan = plan_refit(spec, src, dst)
    for place, memory in reports.items():
        ranks = delta_memory(plan, place)
        assert memory["delta_baseline"] == place
        assert memory["peak_extra_bytes"] == [
            p + m.device_bytes for p, m in zip(dense["peak_extra_bytes"], ranks)
        ]
        assert [r["delta"] for r in memory["ranks"]] == [m.to_json() for m in ranks]
    assert reports["device"]["max_peak_extra_bytes"] > reports["host"]["max_peak_extra_bytes"]
    assert reports["host"]["max_delta_host_bytes"] == max(m.host_baselines for m in ranks)
