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
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)

from nemo_refit_reshard.engine.delta.check import baseline_fingerprint, unit_sums
from nemo_refit_reshard.engine.delta.codec import (
    BITMAP,
    DENSE,
    GAPS,
    HEADER_BYTES,
    POSITIONS,
    Header,
    changed_units,
    decode,
    encode,
    put_units,
    take_units,
    with_ranges,
)
from nemo_refit_reshard.engine.delta.rounds import compile_rounds, place
from nemo_refit_reshard.engine.host_staged import HostStagedTransport
from nemo_refit_reshard.engine.materialize import empty_like_layout
from nemo_refit_reshard.engine.program import TORCH_DTYPES, RankProgram
from nemo_refit_reshard.engine.simulate import simulate_plan
from nemo_refit_reshard.plan import PlanError, plan_refit
from nemo_refit_reshard.runner import RunConfig, build_layouts
from tests.helpers.fake_cuda import fake_cuda
from tests.helpers.model_configs import FP8_MOE
from tests.helpers.plan_checks import casting_moe_plan

CUDA = torch.device("cuda", 0)


def _moe_plan():
    plan, _, src, dst = casting_moe_plan()
    return plan, src, dst


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


def test_delta_place_takes_the_runs_starts_on_the_index_device() -> None:
    """A GPU receiver's decoded index is on the GPU: ``place`` cuts it by its runs'
    starts with ``searchsorted`` on that device, and gets as far as the cut positions
    (a data-dependent ``tolist``, where the fake mode stops). Before the fix the starts
    were a CPU tensor: ``FakeTensorDeviceMismatchError`` on every first delta message."""
    plan, src, dst = _moe_plan()
    me = plan.num_sources
    with fake_cuda():
        program = RankProgram(plan, me, _on(dst, CUDA)[0], device=CUDA)
        rounds, _ = compile_rounds(program, plan)
        incoming = next(i for rnd in rounds for i in rnd.incoming if i.runs)
        index = torch.zeros(1, dtype=torch.int64, device=CUDA)
        values = torch.zeros(incoming.unit, dtype=torch.uint8, device=CUDA)
        with pytest.raises(DataDependentOutputException):
            place(incoming, index, values)


def test_put_units_patches_a_host_message_with_cuda_changes() -> None:
    """``baseline="host"`` and chain forwarders keep baselines in host memory while the
    changed units are found on the GPU: ``put_units`` writes them where the message
    lives. Before the fix it took numpy's path and called ``.numpy()`` on CUDA tensors."""
    with fake_cuda():
        baseline = torch.zeros(64, dtype=torch.uint8)
        index = torch.arange(4, dtype=torch.int64, device=CUDA)
        values = torch.ones(8, dtype=torch.uint8, device=CUDA)
        put_units(baseline, index, values, 2)
        assert baseline.device.type == "cpu"


def test_host_staged_waits_for_the_buffers_own_gpu() -> None:
    """Buffers on GPU 1, the exchange issued from a thread whose current GPU is 0 (a
    thread pool's): the copies into the host mirrors are waited for on GPU 1's stream.
    Before the fix it synchronised ``torch.cuda.current_stream()``: GPU 0's."""
    inner = _Loop()
    gpu1 = torch.device("cuda", 1)
    with fake_cuda():
        staged = HostStagedTransport(inner)
        send = torch.zeros(1 << 16, dtype=torch.uint8, device=gpu1)
        recv = torch.zeros(1 << 16, dtype=torch.uint8, device=gpu1)
        staged.exchange([(1, send[:32])], [(1, recv[32:])])
        assert torch.cuda.current_stream(gpu1).synchronized == 1
        assert torch.cuda.current_stream(CUDA).synchronized == 0
        assert [b.device.type for b in inner.seen] == ["cpu", "cpu"]
        assert staged.staged_bytes == 2 << 16  # one mirror per storage, not per span


class _Loop:
    """An inner (host) transport that records the buffers it is handed."""

    rank, world_size, timeout_s = 0, 2, 5.0

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def start_exchange(self, sends, recvs, round_index=0):
        self.seen += [b for _, b in [*sends, *recvs]]
        return self

    def wait(self) -> None:
        pass


def _runs_on_cuda(fn) -> str:
    """``fn()`` under fake CUDA: ``"done"``, or ``"data-dependent"`` where it stopped at
    its first data-dependent op (a count, a nonzero): never a device mix."""
    try:
        fn()
    except (DataDependentOutputException, DynamicOutputShapeException):
        return "data-dependent"
    return "done"


@pytest.mark.parametrize("form", [DENSE, POSITIONS, BITMAP, GAPS])
def test_the_delta_codec_runs_its_gpu_branches_without_mixing_devices(form: int) -> None:
    """Every codec function's GPU branch (``engine/delta/codec.py``) and the base check's
    sums (``engine/delta/check.py``), on a message on CUDA — its baseline on the GPU or
    in host memory (``baseline="host"``) — up to each one's first data-dependent op."""
    with fake_cuda():
        current = torch.zeros(4096, dtype=torch.uint8, device=CUDA)
        on_gpu = torch.zeros(4096, dtype=torch.uint8, device=CUDA)
        on_host = torch.zeros(4096, dtype=torch.uint8)
        index = torch.arange(0, 2048, 7, dtype=torch.int64, device=CUDA)
        out = torch.empty(8192, dtype=torch.uint8, device=CUDA)
        header = Header(form, 3, index.numel(), 0)
        raw = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=CUDA)
        outcomes = {
            "changed vs device baseline": _runs_on_cuda(lambda: changed_units(current, on_gpu, 2)),
            "changed vs host baseline": _runs_on_cuda(lambda: changed_units(current, on_host, 2)),
            "with_ranges": _runs_on_cuda(lambda: with_ranges(index, [(0, 64)], 2)),
            "take_units": _runs_on_cuda(lambda: take_units(current, index, 2)),
            "encode": _runs_on_cuda(lambda: encode(current, index, 2, form, out)),
            "decode": _runs_on_cuda(lambda: decode(out[:1024], header, 4096, 2)),
            "put_units on host": _runs_on_cuda(
                lambda: put_units(on_host, index, take_units(current, index, 2), 2)
            ),
            "header": _runs_on_cuda(lambda: header.write(raw)),
            "unit_sums": _runs_on_cuda(lambda: unit_sums(current.view(64, 64)[:, :32], 2)),
            "baseline_fingerprint": _runs_on_cuda(
                lambda: baseline_fingerprint(on_gpu, 2, [(0, 128)])
            ),
        }
    assert set(outcomes.values()) <= {"done", "data-dependent"}
    for name in ("take_units", "put_units on host", "header", "unit_sums"):
        assert outcomes[name] == "done", name


class _NoWire:
    """A transport that moves nothing (fake tensors hold no bytes) and records rounds."""

    rank, world_size, timeout_s = 0, 2, 5.0

    def __init__(self) -> None:
        self.rounds: list[int] = []

    def exchange(self, sends, recvs, round_index=0) -> None:
        self.rounds.append(round_index)


def test_a_gpu_sender_with_host_baselines_compares_fingerprints_on_its_device() -> None:
    """A GPU rank keeping its baselines in host memory (a chain forwarder always,
    ``baseline="host"``, ``"auto"`` past the GPU's room): their fingerprints are on the
    CPU, the received ones on the GPU. The compare moves them over and gets as far as
    its one sync; before, ``got != want`` mixed devices on the first checked step. The
    exchange has a round index of its own, past the plan's."""
    from types import SimpleNamespace

    from nemo_refit_reshard.engine.delta.check import baseline_fingerprints, exchange_fingerprints
    from nemo_refit_reshard.engine.delta.rounds import Outgoing, Round

    host = torch.zeros(256, dtype=torch.uint8)  # a baseline in host memory
    on_cpu = SimpleNamespace(
        rounds=[Round([Outgoing(1, host, 2, 0)], [])], baselines={0: host}, fixed_out={}
    )
    prints = baseline_fingerprints(on_cpu)  # (taken where the baseline lives)
    assert prints[(0, 0)].device.type == "cpu"
    wire = _NoWire()
    with fake_cuda():
        span = torch.zeros(256, dtype=torch.uint8, device=CUDA)
        rank = SimpleNamespace(
            device=CUDA,
            rounds=[Round([Outgoing(1, span, 2, 0)], []), Round([], [])],
            baselines={0: host},
            fixed_out={},
            base_fingerprints=prints,
        )
        with pytest.raises(DataDependentOutputException):
            exchange_fingerprints(rank, wire, [0, 0], 0)
    assert wire.rounds == [2]


def test_fingerprint_sums_of_a_long_message_go_in_bounded_chunks(monkeypatch) -> None:
    """A baseline is one flat message: its int64 temporaries come in chunks, not whole
    (a 512 MiB message made 2 GiB + 2 GiB on the GPU)."""
    import nemo_refit_reshard.engine.delta.check as check

    monkeypatch.setattr(check, "_CHUNK", 1000)
    sizes: list[int] = []
    real = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if out.dtype == torch.int64:
            sizes.append(out.numel())
        return out

    with fake_cuda():
        monkeypatch.setattr(torch.Tensor, "to", to)
        check.unit_sums(torch.zeros(8192, dtype=torch.uint8, device=CUDA), 2)
    assert sizes and max(sizes) <= 1000 and sum(sizes) == 4096
