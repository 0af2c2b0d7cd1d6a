"""The engine's GPU branches on a machine with no GPU: tensors on fake ``"cuda"``
(``tests/helpers/fake_cuda.py``), where any op that mixes a CPU and a CUDA tensor raises
as it would on a GPU. Each test runs a path a GPU rank runs — compile, pack and unpack,
block-FP8 quantize, the host-staged exchange, the delta codec up to its first
data-dependent op — and would fail on the first GPU step if the path mixed devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from nemo_refit_reshard.engine.materialize import empty_like_layout
from nemo_refit_reshard.engine.program import TORCH_DTYPES, RankProgram
from nemo_refit_reshard.engine.simulate import simulate_plan
from nemo_refit_reshard.layouts import VllmOptions, megatron_layout, vllm_layout
from nemo_refit_reshard.plan import PlanError, plan_refit
from nemo_refit_reshard.runner import RunConfig, build_layouts
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.fake_cuda import fake_cuda
from tests.helpers.hf_models import TINY_CONFIGS
from tests.helpers.model_configs import FP8_MOE

CUDA = torch.device("cuda", 0)


def _moe_plan(bucket_mb: float = 0.05):
    """Qwen3-MoE, fp32 training ranks (tp=2, ep=2) into bf16 vLLM ranks (tp=2, dp=2):
    casts on the wire, several rounds."""
    spec = spec_from_hf_config(dict(TINY_CONFIGS["qwen3_moe"], torch_dtype="float32"))
    tpar, ipar = TrainParallel(tp=2, ep=2, etp=1), InferParallel(tp=2, dp=2)
    src = [megatron_layout(spec, tpar, r) for r in range(tpar.world_size)]
    dst = [
        vllm_layout(spec, ipar, r, VllmOptions(params_dtype="bfloat16"))
        for r in range(ipar.world_size)
    ]
    return plan_refit(spec, src, dst, bucket_mb=bucket_mb), src, dst


def _on(layouts, device):
    return [empty_like_layout(lay, fill=0.0, device=device) for lay in layouts]


def test_simulate_compiles_each_rank_on_its_tensors_device() -> None:
    """``simulate_plan`` on CUDA tensors (the gpu-marked test of test_gpu.py does this on a
    GPU): every program compiles on CUDA, its staging on CUDA, and the rounds run. Before
    the fix every rank was compiled for the CPU: "on cuda:0, the transport needs cpu"."""
    plan, src, dst = _moe_plan()
    assert plan.num_rounds > 1
    with fake_cuda():
        sources, destinations = _on(src, CUDA), _on(dst, CUDA)
        simulate_plan(plan, sources, destinations)
        program = RankProgram(plan, plan.num_sources, destinations[0], device=CUDA)
        assert {b.device for b in [*program.send_buffers, *program.recv_buffers]} == {CUDA}
        assert all(isinstance(t, FakeTensor) for t in destinations[0].values())


def test_a_cpu_tensor_among_cuda_ones_is_refused_by_name() -> None:
    plan, src, _ = _moe_plan()
    with fake_cuda():
        sources = _on(src, CUDA)
        name = sorted(plan.expected_tensors(0))[0]
        sources[0][name] = sources[0][name].cpu()
        with pytest.raises(PlanError) as err:
            RankProgram(plan, 0, sources[0], device=CUDA)
    assert f"{name}: on cpu, the transport needs cuda" in str(err.value)


def test_block_fp8_refit_quantizes_on_cuda(tmp_path: Path) -> None:
    """A block-FP8 engine: training ranks quantize whole blocks into their CUDA staging,
    inference ranks quantize their shadows after the unpack — all on CUDA."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FP8_MOE))
    cfg = RunConfig(model=str(path), train="tp=2,ep=2,dp=2", infer="tp=2,engine_dp=2,ep=4")
    spec, src, dst = build_layouts(cfg)
    plan = plan_refit(spec, src, dst)
    assert plan.fp8_block is not None
    fp8 = TORCH_DTYPES["float8_e4m3fn"]
    with fake_cuda():
        sources, destinations = _on(src, CUDA), _on(dst, CUDA)
        simulate_plan(plan, sources, destinations)
    assert any(t.dtype == fp8 for d in destinations for t in d.values())
