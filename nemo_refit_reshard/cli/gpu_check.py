"""``nemo-refit-reshard gpu-check``: the GPU paths on one GPU, in one command.

Without CUDA (or CuPy) it says in one line what it needs and exits 1. With them, in
well under 5 minutes on one H200, and every figure a ratio measured in the same run:

1. ``CupyNcclTransport``, one rank sending to itself, 1 MiB to 1 GiB: bandwidth against
   a device-to-device copy of the same bytes.
2. Pack and unpack throughput of real compiled programs — DeepSeek-V3 trained with
   ``pp=16,dp=16,ep=16`` refit into vLLM ``tp=32,dp=8``: training rank 16's share and
   inference rank 0's, tensors on the GPU — against the device copy peak.
3. Overlapped vs serial replay of both programs through a loopback transport (the wire
   is a copy on its own stream, ``engine/loopback.py``).
4. Bit-exact: the inference rank's tensors after the overlapped replay equal those
   after the serial one; CUDA-graph safety: no tensor's storage moved.

A table at the end; exit 0 when every check passes. ``run_program_checks`` also runs
on CPU (tests, with a small model) — the CPU twin of check 2-4.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..engine.loopback import LoopbackTransport
from ..engine.program import TORCH_DTYPES, RankProgram
from ..engine.rendezvous import free_port
from ..layouts import MegatronOptions, RankLayout, refit_layouts
from ..plan import RankPlan, plan_refit, rank_plan
from ..spec import InferParallel, TrainParallel, load_model_spec

NEEDS = "gpu-check needs a CUDA GPU and CuPy (pip install -e '.[gpu]')"


@dataclass(frozen=True)
class Row:
    """One line of the table: what was checked, the figure measured, its ratio to the
    reference measured in the same run, and whether the check passed."""

    check: str
    figure: str
    ratio: str
    ok: bool = True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_gbps(device: torch.device, nbytes: int, repeats: int) -> float:
    """Device-to-device copy of ``nbytes`` (the peak a pack or the wire is held to)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return nbytes / _timed(lambda: dst.copy_(src), device, repeats) / 1e9


def nccl_loopback_rows(device: torch.device, sizes_mib: list[int], repeats: int) -> list[Row]:
    """Check 1: one rank sending to itself over NCCL, each size against a device copy."""
    from ..engine.cupy_nccl import CupyNcclTransport

    transport = CupyNcclTransport("127.0.0.1", free_port(), 0, 1, device.index)
    rows = []
    try:
        for mib in sizes_mib:
            n = mib << 20
            send = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
            recv = torch.zeros_like(send)
            seconds = _timed(lambda s=send, r=recv: transport.exchange([(0, s)], [(0, r)]),
                             device, repeats)  # fmt: skip
            exact = bool(torch.equal(send, recv))
            nccl, copy = n / seconds / 1e9, copy_gbps(device, n, repeats)
            rows.append(
                Row(
                    f"NCCL self send/recv {mib} MiB",
                    f"{nccl:,.0f} GB/s vs copy {copy:,.0f} GB/s",
                    f"{nccl / copy:.2f}",
                    exact,
                )  # fmt: skip
            )
            del send, recv
    finally:
        transport.close()
    return rows


def _random_tensors(layout: RankLayout, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(layout.rank)
    return {
        t.name: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=device).normal_(
            generator=g
        )
        for t in layout.tensors
    }


def digest(tensors: Mapping[str, torch.Tensor], chunk: int = 1 << 24) -> int:
    """A position-weighted sum of every byte (mod 2^61-1): equal bytes, equal digest;
    one changed byte changes it."""
    device = next(iter(tensors.values())).device
    weights = torch.randint(
        1, 2**31, (chunk,), dtype=torch.int64, generator=torch.Generator().manual_seed(7)
    ).to(device)
    total = 0
    for name in sorted(tensors):
        raw = tensors[name].detach().reshape(-1).view(torch.uint8)
        for start in range(0, raw.numel(), chunk):
            part = raw[start : start + chunk].to(torch.int64)
            total = (total + int((part * weights[: part.numel()]).sum().item())) % (2**61 - 1)
    return total


def _copy_bytes(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(d.numel() * d.element_size() for d, _ in pairs)


def run_program_checks(
    device: torch.device,
    model: str,
    train: TrainParallel,
    infer: InferParallel,
    source_rank: int,
    dest_rank: int,
    options: MegatronOptions,
    repeats: int = 5,
    bucket_mb: float = 512,
) -> list[Row]:
    """Checks 2-4 on one training and one inference rank's programs."""
    spec = load_model_spec(model)
    sources, destinations = refit_layouts(spec, train, infer, options)
    plan = plan_refit(spec, sources, destinations, bucket_mb=bucket_mb)
    s = plan.num_sources
    rows = _rank_checks(
        f"training rank {source_rank}",
        rank_plan(plan, source_rank),
        source_rank,
        sources[source_rank],
        True,
        device,
        repeats,
    )
    rows += _rank_checks(
        f"inference rank {dest_rank}",
        rank_plan(plan, s + dest_rank),
        s + dest_rank,
        destinations[dest_rank],
        False,
        device,
        repeats,
    )
    return rows  # fmt: skip


def _rank_checks(
    label: str,
    slice_: RankPlan,
    rank: int,
    layout: RankLayout,
    is_source: bool,
    device: torch.device,
    repeats: int,
) -> list[Row]:
    tensors = _random_tensors(layout, device)
    pointers = {n: t.data_ptr() for n, t in tensors.items()}
    serial = RankProgram(slice_, rank, tensors, device)
    overlapped = RankProgram(slice_, rank, tensors, device, overlap=True)
    largest = max(b.numel() for b in [*serial.send_buffers, *serial.recv_buffers])
    wire = LoopbackTransport(device, largest)
    rows = []
    # Pack or unpack throughput against the device copy peak.
    if is_source:
        moved = sum(_copy_bytes(p.copies_out) for p in serial.rounds)

        def work() -> None:
            for p in serial.rounds:
                p.pack()

        what = "pack"
    else:
        serial.replay(wire)  # fill the receive buffers once
        moved = sum(_copy_bytes(p.copies_in) for p in serial.rounds)

        def work() -> None:
            for p in serial.rounds:
                p.unpack()

        what = "unpack"
    with torch.no_grad():
        rate = moved / _timed(work, device, repeats) / 1e9
    peak = copy_gbps(device, max(moved, 1 << 20), repeats)
    rows.append(
        Row(f"{what}, {label}", f"{rate:,.0f} GB/s vs copy {peak:,.0f} GB/s "
            f"({moved / 2**30:,.2f} GiB, {len(serial.rounds)} rounds)", f"{rate / peak:.2f}")
    )  # fmt: skip
    # Overlapped vs serial replay through the loopback wire.
    t_serial = _timed(lambda: serial.replay(wire), device, repeats)
    t_overlap = _timed(lambda: overlapped.replay(wire), device, repeats)
    rows.append(
        Row(f"replay {label}: serial / overlapped",
            f"{t_serial * 1e3:,.1f} ms / {t_overlap * 1e3:,.1f} ms",
            f"{t_serial / t_overlap:.2f}")
    )  # fmt: skip
    if not is_source:
        for t in tensors.values():
            t.fill_(float("nan"))
        wire.new_step()
        serial.replay(wire)
        want = digest(tensors)
        for t in tensors.values():
            t.fill_(float("nan"))
        wire.new_step()
        overlapped.replay(wire)
        got = digest(tensors)
        rows.append(Row(f"bit-exact, {label}: overlapped == serial", f"{got:#x}", "-",
                        got == want))  # fmt: skip
    moved_ptrs = [n for n, t in tensors.items() if t.data_ptr() != pointers[n]]
    rows.append(Row(f"storage pointers unchanged, {label}", f"{len(pointers)} tensors",
                    "-", not moved_ptrs))  # fmt: skip
    return rows


def print_table(rows: list[Row]) -> None:
    """The rows as a Markdown table."""
    print("| check | figure | ratio | ok |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r.check} | {r.figure} | {r.ratio} | {'yes' if r.ok else 'NO'} |")


def run(repeats: int, quick: bool) -> int:
    """Every check on the current GPU, then the table; the exit status."""
    from ..engine.cupy_nccl import cupy_available

    if not torch.cuda.is_available() or not cupy_available():
        print(f"{NEEDS}; found torch.cuda.is_available()={torch.cuda.is_available()}, "
              f"CuPy usable={cupy_available()}", file=sys.stderr)  # fmt: skip
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    sizes = [1, 16] if quick else [1, 16, 256, 1024]
    rows = nccl_loopback_rows(device, sizes, repeats)
    if quick:
        rows += run_program_checks(
            device, "small-qwen3", TrainParallel(tp=2, pp=2), InferParallel(tp=4, dp=2),
            1, 0, MegatronOptions(), repeats, bucket_mb=4,
        )  # fmt: skip
    else:
        rows += run_program_checks(
            device, "deepseek-v3", TrainParallel(pp=16, dp=16, ep=16), InferParallel(tp=32, dp=8),
            16, 0, MegatronOptions(num_layers_in_first_pipeline_stage=3,
                                   num_layers_in_last_pipeline_stage=2), repeats,
        )  # fmt: skip
    print(f"gpu-check on {torch.cuda.get_device_name(device)}, "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    print_table(rows)
    return 0 if all(r.ok for r in rows) else 1


def cmd_gpu_check(args: argparse.Namespace) -> int:
    """``nemo-refit-reshard gpu-check [--repeats N] [--quick]``."""
    return run(args.repeats, args.quick)
