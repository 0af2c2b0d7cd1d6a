"""``nemo-refit-reshard gpu-check``: the GPU paths on one GPU, in one command.

Without CUDA (or CuPy) it says in one line what it needs and exits 1. With them, every
figure a ratio measured in the same run:

1. ``CupyNcclTransport``, one rank sending to itself, 1 MiB to 1 GiB (``--quick``: 1 and
   16 MiB): bandwidth against a device-to-device copy of the same bytes.
2. Pack and unpack throughput of real compiled programs — DeepSeek-V3 trained with
   ``pp=16,dp=16,ep=16`` refit into vLLM ``tp=32,dp=8``: training rank 16's share and
   inference rank 0's, tensors on the GPU (``--quick``: a small Qwen3) — against the
   device copy peak (a copy of at most 1 GiB: ``gpu_check_memory.py`` says why).
3. Overlapped vs serial replay of both programs through a loopback transport (the wire
   is a copy on its own stream, ``engine/loopback.py``).
4. Bit-exact: the inference rank's tensors after the overlapped replay equal those
   after the serial one; CUDA-graph safety: no tensor's storage moved.

Cards under 100 GB run ``--quick`` unless ``--full`` is given (it says so): DeepSeek-V3's
inference rank 0 alone holds 40.9 GiB. Before a rank's checks allocate anything, the
memory they will hold is computed from its programs compiled on the meta device and
compared with what the device has free. A check that raises (out of memory, NCCL, …)
becomes a failed row with the error's first line, and the others still run: the table
always comes. Exit 0 when every row passes. ``run_program_checks`` also runs on CPU
(tests, with a small model) — the CPU twin of checks 2-4.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..engine.loopback import LoopbackTransport
from ..engine.program import RankProgram
from ..engine.rendezvous import free_port
from ..layouts import MegatronOptions, RankLayout, refit_layouts
from ..plan import RankPlan, plan_refit, rank_plan
from ..spec import InferParallel, TrainParallel, load_model_spec
from .gpu_check_memory import (
    DIGEST_CHUNK,
    GB,
    RankMemory,
    empty_tensors,
    gib,
    largest_message,
    moved_bytes,
    plan_rank_memory,
    reference_bytes,
)

NEEDS = "gpu-check needs a CUDA GPU and CuPy (pip install -e '.[gpu]')"
QUICK_BELOW_BYTES = 100 * GB  # cards with less memory run --quick unless --full is given
NCCL_SIZES_MIB = {True: [1, 16], False: [1, 16, 256, 1024]}  # by quick


@dataclass(frozen=True)
class Row:
    """One line of the table: what was checked, the figure measured, its ratio to the
    reference measured in the same run, and whether the check passed."""

    check: str
    figure: str
    ratio: str
    ok: bool = True


@dataclass(frozen=True)
class ProgramCase:
    """The refit whose two ranks' programs checks 2-4 run."""

    model: str
    train: TrainParallel
    infer: InferParallel
    source_rank: int
    dest_rank: int
    options: MegatronOptions
    bucket_mb: float


FULL = ProgramCase(
    "deepseek-v3", TrainParallel(pp=16, dp=16, ep=16), InferParallel(tp=32, dp=8), 16, 0,
    MegatronOptions(num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=2),
    512,
)  # fmt: skip
QUICK = ProgramCase(
    "small-qwen3", TrainParallel(tp=2, pp=2), InferParallel(tp=4, dp=2), 1, 0,
    MegatronOptions(), 4,
)  # fmt: skip


@dataclass(frozen=True)
class RankCase:
    """One rank of a :class:`ProgramCase`: its slice of the plan and its layout."""

    label: str
    slice_: RankPlan
    rank: int
    layout: RankLayout
    is_source: bool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    """Give what the last check held back to the device (its tensors are garbage now)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
    """Device-to-device copy of ``nbytes`` (the peak a pack or the wire is held to);
    callers size it with ``reference_bytes`` (at most 1 GiB)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return nbytes / _timed(lambda: dst.copy_(src), device, repeats) / 1e9


def guarded(label: str, check: Callable[[], list[Row]], device: torch.device) -> list[Row]:
    """``check()``'s rows; if it raises, one failed row with the error's first line (the
    other checks still run and the table still comes). Frees what it held either way."""
    try:
        return check()
    except Exception as err:  # noqa: BLE001 — any failure of one check is its row
        first = next((line for line in str(err).splitlines() if line.strip()), "")
        return [Row(f"{label}: raised", f"{type(err).__name__}: {first.strip()}"[:240], "-", False)]
    finally:
        _free(device)


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
            nccl, copy = n / seconds / 1e9, copy_gbps(device, reference_bytes(n), repeats)
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
    tensors = empty_tensors(layout, device)
    for t in tensors.values():
        t.normal_(generator=g)
    return tensors


def digest(tensors: Mapping[str, torch.Tensor], chunk: int = DIGEST_CHUNK) -> int:
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


def case_ranks(case: ProgramCase) -> list[RankCase]:
    """Plan ``case`` (the whole refit) and slice out its training and inference rank."""
    spec = load_model_spec(case.model)
    sources, destinations = refit_layouts(spec, case.train, case.infer, case.options)
    plan = plan_refit(spec, sources, destinations, bucket_mb=case.bucket_mb)
    s, src, dst = plan.num_sources, case.source_rank, case.dest_rank
    return [
        RankCase(f"training rank {src}", rank_plan(plan, src), src, sources[src], True),
        RankCase(
            f"inference rank {dst}", rank_plan(plan, s + dst), s + dst, destinations[dst], False
        ),
    ]


def case_memory(case: ProgramCase) -> list[RankMemory]:
    """What each rank's checks of ``case`` hold (what :func:`_rank_checks` sizes by)."""
    return [
        plan_rank_memory(r.label, r.slice_, r.rank, r.layout, r.is_source) for r in case_ranks(case)
    ]


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
    """Checks 2-4 on one training and one inference rank's programs; a rank whose
    checks raise is one failed row, and the other rank still runs."""
    case = ProgramCase(model, train, infer, source_rank, dest_rank, options, bucket_mb)
    rows: list[Row] = []
    for r in case_ranks(case):
        rows += guarded(r.label, lambda r=r: _rank_checks(r, device, repeats), device)
    return rows


def _fits(mem: RankMemory, device: torch.device) -> None:
    """Refuse, before allocating, checks the device cannot hold."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    print(f"gpu-check: {mem.label}: holds at most {gib(mem.allocated)} "
          f"({gib(mem.tensors)} of tensors); {gib(free)} of {gib(total)} free")  # fmt: skip
    if mem.allocated > free:
        raise MemoryError(
            f"{mem.label}'s checks need {gib(mem.allocated)}, {gib(free)} free of "
            f"{gib(total)}: run --quick"
        )


def _rank_checks(r: RankCase, device: torch.device, repeats: int) -> list[Row]:
    label, is_source = r.label, r.is_source
    mem = plan_rank_memory(label, r.slice_, r.rank, r.layout, is_source)
    _fits(mem, device)
    tensors = _random_tensors(r.layout, device)
    pointers = {n: t.data_ptr() for n, t in tensors.items()}
    serial = RankProgram(r.slice_, r.rank, tensors, device)
    overlapped = RankProgram(r.slice_, r.rank, tensors, device, overlap=True)
    wire = LoopbackTransport(device, largest_message(serial))
    rows = []
    # Pack or unpack throughput against the device copy peak.
    if is_source:

        def work() -> None:
            for p in serial.rounds:
                p.pack()

        what = "pack"
    else:
        serial.replay(wire)  # fill the receive buffers once

        def work() -> None:
            for p in serial.rounds:
                p.unpack()

        what = "unpack"
    moved = moved_bytes(serial, is_source)
    with torch.no_grad():
        rate = moved / _timed(work, device, repeats) / 1e9
    peak = copy_gbps(device, mem.reference, repeats)
    launches = sum(serial.launches_per_round)
    rows.append(
        Row(f"{what}, {label}", f"{rate:,.0f} GB/s vs copy {peak:,.0f} GB/s "
            f"({moved / 2**30:,.2f} GiB, {len(serial.rounds)} rounds, {launches:,} copy "
            f"launches for {serial.num_copies:,} copies)", f"{rate / peak:.2f}")
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
    """The rows as a Markdown table (a ``|`` inside a cell becomes ``/``)."""
    print("| check | figure | ratio | ok |")
    print("|---|---|---|---|")
    for r in rows:
        cells = [r.check, r.figure, r.ratio, "yes" if r.ok else "NO"]
        print("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")


def choose_quick(quick: bool | None, name: str, total_bytes: int) -> bool:
    """``--quick`` / ``--full`` as given; neither: quick on cards under 100 GB, said so."""
    if quick is not None:
        return quick
    if total_bytes < QUICK_BELOW_BYTES:
        print(f"gpu-check: --quick chosen: {name} has {total_bytes / GB:.0f} GB, under "
              f"{QUICK_BELOW_BYTES // GB} GB (--full: DeepSeek-V3 scale)")  # fmt: skip
        return True
    return False


def run(repeats: int, quick: bool | None = None) -> int:
    """Every check on the current GPU, then the table; the exit status. ``quick``:
    ``None`` chooses by the card's memory (:func:`choose_quick`)."""
    from ..engine.cupy_nccl import cupy_available

    if not torch.cuda.is_available() or not cupy_available():
        print(f"{NEEDS}; found torch.cuda.is_available()={torch.cuda.is_available()}, "
              f"CuPy usable={cupy_available()}", file=sys.stderr)  # fmt: skip
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    quick = choose_quick(quick, name, torch.cuda.get_device_properties(device).total_memory)
    t0 = time.perf_counter()
    sizes = NCCL_SIZES_MIB[quick]
    rows = guarded("NCCL self send/recv", lambda: nccl_loopback_rows(device, sizes, repeats),
                   device)  # fmt: skip
    c = QUICK if quick else FULL
    rows += guarded(
        f"programs of {c.model}",
        lambda: run_program_checks(device, c.model, c.train, c.infer, c.source_rank,
                                   c.dest_rank, c.options, repeats, c.bucket_mb),
        device,
    )  # fmt: skip
    print(f"gpu-check on {name} ({'quick' if quick else 'full'}), "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    print_table(rows)
    return 0 if all(r.ok for r in rows) else 1


def cmd_gpu_check(args: argparse.Namespace) -> int:
    """``nemo-refit-reshard gpu-check [--repeats N] [--quick | --full]``."""
    return run(args.repeats, getattr(args, "quick", None))
