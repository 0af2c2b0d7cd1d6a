"""The block-FP8 quantizer (``engine/quantize.py``) against the reference vLLM ships and
tests its kernels with (``vllm.utils.deep_gemm.per_block_cast_to_fp8``, DeepGEMM's),
bit for bit, run in vLLM's own venv; and its arithmetic against a float64 model of e4m3
rounding written here from the format's definition."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_refit_reshard.engine.quantize import E4M3, quantize_block_fp8, quantize_into
from tests.helpers import vllm_env
from tests.helpers.requires import requires

SHAPES = [(256, 384), (200, 72), (576, 7168 // 8), (1, 130)]  # partial blocks included


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {}
    for i, shape in enumerate(SHAPES):
        x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[1])  # wide range
        out[f"w{i}"] = x.to(torch.bfloat16)
    out["zeros"] = torch.zeros(130, 130, dtype=torch.bfloat16)  # the amax floor
    return out


def _e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto e4m3fn's values, in float64, from the format: 3
    mantissa bits, exponent bias 7, subnormals below 2^-6, largest finite 448."""
    v = v.double()
    a = v.abs()
    e = torch.floor(torch.log2(a.clamp_min(2.0**-6)))  # subnormal step below 2^-6
    step = torch.pow(2.0, e - 3)
    q = torch.round(a / step) * step  # torch.round: half to even
    return torch.sign(v) * q.clamp_max(448.0)


def test_matches_the_format_definition() -> None:
    for name, x in _weights().items():
        q, s = quantize_block_fp8(x)
        m, n = x.shape
        scale = s.repeat_interleave(128, 0)[:m].repeat_interleave(128, 1)[:, :n]
        want = _e4m3_round(x.float() * (1.0 / scale))
        assert torch.equal(q.double(), want), name
        blocks = torch.nn.functional.pad(x.float().abs(), (0, -n % 128, 0, -m % 128))
        amax = blocks.view(-1, 128, blocks.shape[1] // 128, 128).amax(dim=(1, 3))
        assert torch.equal(s, amax.clamp(1e-4) / 448.0), name


def test_quantize_into_refuses_a_wrong_engine_tensor() -> None:
    x = torch.randn(256, 200, dtype=torch.bfloat16)
    w, s = torch.empty(256, 200, dtype=E4M3), torch.empty(2, 2)
    quantize_into(x, w, s, (128, 128))
    assert torch.equal(w.view(torch.uint8), quantize_block_fp8(x)[0].view(torch.uint8))
    with pytest.raises(ValueError) as err:
        quantize_into(x, w, torch.empty(2, 1), (128, 128))
    assert str(err.value) == (
        "block FP8 of (256, 200) gives weight (256, 200) and scales (2, 2); the engine "
        "holds (256, 200) and (2, 1)"
    )


@pytest.mark.slow
@requires(vllm_env.skip_reason)
def test_bit_equal_to_vllms_reference(tmp_path: Path) -> None:
    weights = _weights()
    save_file(weights, str(tmp_path / "x.safetensors"))
    probe = f"""
import torch
from safetensors.torch import load_file, save_file
from vllm.utils.deep_gemm import per_block_cast_to_fp8
fn = getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable", per_block_cast_to_fp8)
out = {{}}
for k, x in load_file({str(tmp_path / "x.safetensors")!r}).items():
    q, s = fn(x, [128, 128], use_ue8m0=False)
    out[k + ".q"], out[k + ".s"] = q.contiguous(), s.contiguous()
save_file(out, {str(tmp_path / "ref.safetensors")!r})
"""
    python = vllm_env.vllm_python()
    assert python is not None
    done = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, env=vllm_env.vllm_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ref = load_file(str(tmp_path / "ref.safetensors"))
    for k, x in weights.items():
        q, s = quantize_block_fp8(x)
        assert torch.equal(q.view(torch.uint8), ref[k + ".q"].view(torch.uint8)), k
        assert torch.equal(s, ref[k + ".s"]), json.dumps([k, list(s.shape)])
