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
from nemo_refit_reshard.engine.delta.options import DeltaOptions
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


@pytest.mark.parametrize("free_gib, place", [(64, "cuda"), (0.0001, "cpu")])
def test_auto_keeps_baselines_on_the_gpu_only_where_they_fit(
    monkeypatch, free_gib: float, place: str
) -> None:
    """``baseline="auto"`` (the default): a training rank's baselines on its GPU while
    they take at most half its free memory, else in pinned host memory — the reported
    host figure then; forwarding inference ranks in host memory either way."""
    spec = spec_from_hf_config(MODELS["qwen3"])
    src, dst = refit_layouts(spec, TrainParallel.parse("tp=2"), InferParallel.parse("tp=2"))
    plan = plan_refit(spec, src, dst, 0.05)
    free = int(free_gib * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    options = DeltaOptions(cpu_kernel="numpy")
    assert options.baseline == "auto"
    with fake_cuda():
        program = DeltaProgram(
            RankProgram(plan, 0, empty_like_layout(src[0], 0.0, CUDA), CUDA), plan, options
        )
        program.learn_fixed([[]] * plan.num_sources + [[]] * plan.num_destinations)
        program._gathering.shutdown()
    assert program.baselines and {b.device.type for b in program.baselines.values()} == {place}
    assert program.baseline_place == ("device" if place == "cuda" else "host")
    want = delta_memory(plan, program.baseline_place)[0]
    assert program.baseline_bytes == want.baselines + want.host_baselines


@pytest.mark.parametrize("baseline", ["device", "host"])
def test_colocated_hosts_report_what_they_allocate(baseline: str) -> None:
    """A colocated plan (4 training ranks, 2 of them hosting a vLLM rank): each host's
    ``ColocatedDelta`` — its own baselines and scratch, its guest's receiving scratch,
    the copies it holds of its guest's messages — is what ``plan --delta`` reports."""
    from nemo_refit_reshard.engine.colocated import ColocatedHost
    from nemo_refit_reshard.engine.materialize import empty_like_layout as empty
    from nemo_refit_reshard.plan import Colocation

    spec = spec_from_hf_config(MODELS["qwen3"])
    src, dst = refit_layouts(spec, TrainParallel.parse("tp=2,dp=2"), InferParallel.parse("tp=2"))
    plan = plan_refit(spec, src, dst, 0.05, colocation=Colocation.same_index(4, 2))
    reported = delta_memory(plan, baseline)
    options = DeltaOptions(baseline=baseline, cpu_kernel="numpy")
    s = plan.num_sources
    assert reported[s:] == [DeltaMemory(0, 0, 0)] * 2
    totals: list[tuple[int, int]] = []
    for rank in range(s):
        guest = plan if rank in plan.colocated_hosts else None
        host = ColocatedHost(plan, guest, rank, empty(src[rank], 0.0), "cpu", options)
        try:
            d = host.delta
            assert d is not None
            kept = sum(b.numel() for b in d.own.baselines.values())
            programs = [d.own] + ([d.guest] if d.guest is not None else [])
            scratch = sum(p._encoded.numel() + p._received.numel() for p in programs)
            held = sum(b.numel() for b in d.guest.held.values()) if d.guest else 0
            want = reported[rank]
            assert (want.baselines + want.host_baselines, want.scratch, want.held) == (
                kept,
                scratch,
                held,
            )
            assert want.host_baselines == (kept if baseline == "host" else 0)
            totals.append((kept, held))
        finally:
            for p in programs:
                p._gathering.shutdown()
            host.close()
    # rank 2 sends host 1's guest its half of the model; host 1 holds a copy of it
    assert totals == [(0, 0), (0, 4608), (4608, 0), (0, 0)]
