"""On one GPU, the CUDA paths give the CPU paths' bytes: compiled pack/unpack programs
(staging bytes of every message and every destination tensor), block-FP8 quantization
(``engine/quantize.py``) and the delta codec (``engine/delta/codec.py``). The CPU paths
are the ones the rest of the suite proves bit-exact; these tests carry the ``gpu`` marker
(``scripts/gpu_checks.sh``, row ``pytest-gpu``) and skip without CUDA. The replay helper
also runs CPU against CPU here, so a broken helper shows without a GPU."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nemo_refit_reshard.engine.delta.codec import (
    BITMAP,
    DENSE,
    GAPS,
    POSITIONS,
    Header,
    apply_patch,
    changed_units,
    count_long_gaps,
    decode,
    encode,
    put_units,
)
from nemo_refit_reshard.engine.materialize import SyntheticWeights, materialize
from nemo_refit_reshard.engine.program import RankProgram
from nemo_refit_reshard.engine.quantize import block_scales, quantize_block_fp8
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.runner import RunConfig, build_layouts
from nemo_refit_reshard.runner.destination import destination_tensors
from tests.helpers.hf_models import TINY_CONFIGS
from tests.helpers.model_configs import FP8_MOE

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
Staged = dict[tuple[int, int, int], torch.Tensor]  # (round, sender, receiver) -> bytes


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(-1)


def replay(cfg: RunConfig, device: torch.device) -> tuple[Staged, list[dict[str, torch.Tensor]]]:
    """One refit of ``cfg`` with every rank's program compiled on ``device``, in one
    process: every message's staged bytes as packed, and every destination's tensors."""
    spec, sources, destinations = build_layouts(cfg)
    plan = plan_refit(spec, sources, destinations, bucket_mb=cfg.bucket_mb)
    weights = SyntheticWeights(spec.unquantized(), cfg.seed)
    src = [materialize(lay, weights, fill=float("nan"), device=device) for lay in sources]
    dst = [
        destination_tensors(cfg, spec, lay, d, weights, device)
        for d, lay in enumerate(destinations)
    ]
    programs = [
        RankProgram(plan, r, tensors, device)
        for r, tensors in enumerate([*src, *(d.tensors for d in dst)])
    ]
    staged: Staged = {}
    with torch.no_grad():
        for p in programs:
            p.prepare()
        for k in range(plan.num_rounds):
            sends = {}
            for r, p in enumerate(programs):
                p.rounds[k].pack()
                sends.update({(r, peer): buf for peer, buf in p.rounds[k].sends})
            for r, p in enumerate(programs):
                for peer, buf in p.rounds[k].recvs:
                    buf.copy_(sends[(peer, r)])
            staged.update({(k, r, peer): _bytes(buf) for (r, peer), buf in sends.items()})
            for p in programs:
                p.rounds[k].unpack()
        for p in programs:
            p.finish()
    for d in dst:
        assert d.mismatches() == []
    return staged, [{n: _bytes(t) for n, t in d.tensors.items()} for d in dst]


def _configs(tmp_path: Path) -> dict[str, RunConfig]:
    moe = tmp_path / "qwen3_moe.json"
    moe.write_text(json.dumps(dict(TINY_CONFIGS["qwen3_moe"], torch_dtype="float32")))
    fp8 = tmp_path / "fp8_moe.json"
    fp8.write_text(json.dumps({**FP8_MOE, "intermediate_size": 384}))
    return {
        # fp32 training -> bf16 engine: every unpack casts
        "casts": RunConfig(model=str(moe), train="tp=2,ep=2,etp=1", infer="tp=2,dp=2",
                           infer_dtype="bfloat16", bucket_mb=0.05),
        # a block-FP8 engine: senders quantize into staging, receivers quantize twins
        "fp8": RunConfig(model=str(fp8), train="tp=2", infer="engine_dp=2,ep=2",
                         bucket_mb=0.25),
    }  # fmt: skip


def _assert_same(a: tuple[Staged, list], b: tuple[Staged, list]) -> None:
    (staged_a, dst_a), (staged_b, dst_b) = a, b
    assert sorted(staged_a) == sorted(staged_b) and staged_a
    for key, raw in staged_a.items():
        assert torch.equal(raw, staged_b[key]), f"message (round, sender, receiver) {key}"
    assert [sorted(d) for d in dst_a] == [sorted(d) for d in dst_b]
    for rank, (da, db) in enumerate(zip(dst_a, dst_b)):
        for name in da:
            assert torch.equal(da[name], db[name]), (rank, name)


@pytest.mark.parametrize("case", ["casts", "fp8"])
def test_the_replay_helper_is_deterministic_on_cpu(tmp_path: Path, case: str) -> None:
    cfg = _configs(tmp_path)[case]
    _assert_same(replay(cfg, CPU), replay(cfg, CPU))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", ["casts", "fp8"])
def test_cuda_programs_pack_and_unpack_the_cpu_programs_bytes(tmp_path: Path, case: str) -> None:
    cfg = _configs(tmp_path)[case]
    _assert_same(replay(cfg, CPU), replay(cfg, torch.device("cuda")))


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 260, generator=g)  # partial blocks in both dimensions
    w[:128, :128] = 0  # an all-zero block: the amax floor
    w[128:256, :128] *= 1e-6  # e4m3 subnormals after scaling
    w[0, 200] = 3e4  # one huge value: the rest of its block rounds to zero
    return {"float32": w, "bfloat16": w.to(torch.bfloat16), "experts": w[:256, :256]}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["float32", "bfloat16", "experts"])
def test_block_fp8_quantization_on_cuda_equals_cpu(name: str) -> None:
    x = _weights()[name]
    q_cpu, s_cpu = quantize_block_fp8(x)
    q_gpu, s_gpu = quantize_block_fp8(x.cuda())
    assert torch.equal(_bytes(q_gpu), _bytes(q_cpu))
    assert torch.equal(_bytes(s_gpu), _bytes(s_cpu))
    assert torch.equal(_bytes(block_scales(x.cuda())), _bytes(s_cpu))


def _messages() -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """``(baseline, current, unit)``: every density, long gaps, 1-, 2- and 4-byte units."""
    g = torch.Generator().manual_seed(2)
    base = torch.randint(0, 256, (4 * 3000,), dtype=torch.uint8, generator=g)
    out = {}
    for unit in (1, 2, 4):
        changes: dict[str, Callable[[torch.Tensor], object]] = {
            "none": lambda u: None,
            "all": lambda u: u.add_(1),
            "sparse": lambda u: u[::37, 0].bitwise_xor_(1),
            "far apart": lambda u: u[[0, 400, 401, 2999], -1].bitwise_xor_(128),
        }
        for what, change in changes.items():
            cur = base.clone()
            change(cur.view(-1, unit))
            out[f"{what}, unit {unit}"] = (base, cur, unit)
    return out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("form", [DENSE, POSITIONS, BITMAP, GAPS])
@pytest.mark.parametrize("message", sorted(_messages()))
def test_delta_codec_on_cuda_equals_cpu(form: int, message: str) -> None:
    """encode, decode, put_units and apply_patch give the same bytes on CUDA as on CPU,
    a CPU message patched from CUDA indices and values too (a host baseline)."""
    base, cur, unit = _messages()[message]
    cuda = torch.device("cuda")
    index = changed_units(cur, base, unit)
    index_gpu = changed_units(cur.to(cuda), base.to(cuda), unit)
    assert torch.equal(index_gpu.cpu(), index)
    count, long_gaps = index.numel(), count_long_gaps(index)
    assert count_long_gaps(index_gpu) == long_gaps
    payload = encode(cur, index, unit, form, torch.empty(5 * cur.numel(), dtype=torch.uint8))
    payload = payload.clone()
    out_gpu = torch.empty(5 * cur.numel(), dtype=torch.uint8, device=cuda)
    payload_gpu = encode(cur.to(cuda), index_gpu, unit, form, out_gpu)
    assert torch.equal(payload_gpu.cpu(), payload)
    header = Header(form, 3, count, payload.numel())
    if form != DENSE:
        idx, values = decode(payload, header, cur.numel(), unit)
        idx_gpu, values_gpu = decode(payload.to(cuda), header, cur.numel(), unit)
        assert torch.equal(idx_gpu.cpu(), idx) and torch.equal(values_gpu.cpu(), values)
        on_gpu = base.to(cuda)
        put_units(on_gpu, idx_gpu, values_gpu, unit)
        on_host = base.clone()
        put_units(on_host, idx_gpu, values_gpu, unit)  # GPU indices into a host copy
        assert torch.equal(on_gpu.cpu(), cur) and torch.equal(on_host, cur)
    patched = base.to(cuda)
    apply_patch(patched, payload.to(cuda), header, unit)
    assert torch.equal(patched.cpu(), cur)


@pytest.mark.gpu
@needs_cuda
def test_changed_units_of_an_unaligned_cuda_view_equal_cpu() -> None:
    """A message starting at an odd byte (its units not aligned for an int view)."""
    base, cur, _ = _messages()["sparse, unit 2"]
    a, b = base[1:-1], cur[1:-1]
    want = changed_units(a, b, 2)
    got = changed_units(a.cuda(), b.cuda(), 2)
    assert torch.equal(got.cpu(), want) and want.numel() > 0
