"""``python -m nemo_refit_reshard.cli.ipc_check [cuda|cpu] [--alloc-conf CONF]``: the staging
across processes.

One process exports a staging buffer (``engine/staging.py``) filled with a known
pattern; a second opens it by its handle and compares every byte. On CUDA:

1. the UUID round trip: each visible GPU's UUID maps back to its own index;
2. the opener with the exporter's ``CUDA_VISIBLE_DEVICES``: same GPU, same bytes;
3. the opener with the GPUs in reversed order (two GPUs or more; one GPU: skipped, said
   so): the exporter's ``cuda:0`` is the opener's ``cuda:<n-1>`` — the GPU must be the
   same by UUID, the bytes equal;
4. the opener, the exporter running with ``expandable_segments:True`` (unless its
   settings have it already): the staging still comes from a ``cudaMalloc`` segment,
   whose handle opens without ``pidfd_getfd`` (``engine/staging_alloc.py``);
5. ``/dev/shm`` once both processes have exited: no entry named after either left.

The exporter stands for the training process, so it runs with the trainer's allocator
settings: ``--alloc-conf CONF`` sets its ``PYTORCH_CUDA_ALLOC_CONF`` (default: this
process's environment, passed through); each CUDA row says which settings it ran with
and the kind of segment the staging came from. ``cpu`` runs 2 and 5 over POSIX shared
memory (the CPU twin). A table at the end; exit 0 when every row passes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from ..engine.staging import (
    create_shared_buffer,
    gpu_uuid,
    open_shared_buffer,
    parse_cuda_handle,
    visible_gpu_uuids,
    visible_index,
)
from ..engine.staging_alloc import (
    CUDA_MALLOC,
    EXPANDABLE,
    StagingAllocatorRefused,
    allocator_settings,
    handle_kind,
    join_settings,
    split_settings,
)
from .gpu_check import Row, print_table

NBYTES = 1 << 20
SHM = "/dev/shm"
CONF = "PYTORCH_CUDA_ALLOC_CONF"
SEGMENT_KINDS = {CUDA_MALLOC: "cudaMalloc", EXPANDABLE: "expandable"}


def _pattern(device: torch.device) -> torch.Tensor:
    return (torch.arange(NBYTES, device=device) % 251).to(torch.uint8)


def _device(kind: str) -> torch.device:
    return torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")


def _export(kind: str) -> None:
    """Child: export a buffer, say its handle, keep it until told, release it."""
    device = _device(kind)
    made: dict[str, str] = {}
    if kind == "cuda":
        # A block the caching allocator already mapped, as a trainer's weights would be:
        # with expandable segments on, the staging must still not come from one.
        warm = torch.empty(4 * NBYTES, dtype=torch.uint8, device=device)
        made["settings"] = allocator_settings()
    try:
        buf = create_shared_buffer(NBYTES, device)
    except StagingAllocatorRefused as err:
        print(json.dumps({**made, "error": str(err)}), flush=True)
        return
    buf.tensor.copy_(_pattern(device))
    if kind == "cuda":
        torch.cuda.synchronize(device)
        del warm
        made["segment"] = SEGMENT_KINDS.get(handle_kind(parse_cuda_handle(buf.handle)[1]), "?")
    uuid = gpu_uuid(0) if kind == "cuda" else "-"
    print(json.dumps({**made, "handle": buf.handle, "uuid": uuid}), flush=True)
    sys.stdin.readline()
    buf.close()


def _open(kind: str, handle: str) -> None:
    """Child: open the handle, report the device (by UUID) and whether the bytes match."""
    buf = open_shared_buffer(handle, torch.device(kind))
    device = buf.tensor.device
    equal = bool(torch.equal(buf.tensor[:NBYTES], _pattern(device)))
    uuid = gpu_uuid(device.index) if kind == "cuda" else "-"
    print(json.dumps({"index": device.index, "uuid": uuid, "equal": equal}), flush=True)
    buf.close()


def _child(
    args: list[str], visible: str | None, alloc_conf: str | None = None
) -> subprocess.Popen[str]:
    """A child with this process's environment (its allocator settings included), its
    ``CUDA_VISIBLE_DEVICES`` and ``PYTORCH_CUDA_ALLOC_CONF`` replaced where given."""
    env = dict(os.environ)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if alloc_conf is not None:
        env[CONF] = alloc_conf
    return subprocess.Popen(
        [sys.executable, "-m", "nemo_refit_reshard.cli.ipc_check", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _left_by(pids: list[int]) -> list[str]:
    """Entries of ``/dev/shm`` named after one of ``pids`` (the project's segments,
    ``nrr-<ns>-<pid>-…``; torch's CUDA IPC reference counters, ``torch_<pid>_…``)."""
    try:
        names = os.listdir(SHM)
    except OSError:
        return []
    marks = [m for p in pids for m in (f"-{p}-", f"_{p}_")]
    return sorted(n for n in names if any(m in n for m in marks))


def _pair(
    kind: str,
    opener_visible: str | None,
    label: str,
    timeout_s: float,
    pids: list[int],
    alloc_conf: str | None = None,
) -> Row:
    """Export in one child (this process's visible GPUs, allocator settings
    ``alloc_conf`` where given), open in another."""
    exporter = _child(["--export", kind], None, alloc_conf)
    pids.append(exporter.pid)
    assert exporter.stdin is not None and exporter.stdout is not None
    try:
        made = json.loads(exporter.stdout.readline() or "{}")
        if "handle" not in made:
            why = made.get("error", "see its stderr").splitlines()[0]
            return Row(label, f"the exporter failed: {why}", "-", False)
        opener = _child(["--open", kind, made["handle"]], opener_visible)
        pids.append(opener.pid)
        out, _ = opener.communicate(timeout=timeout_s)
        seen = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    finally:
        exporter.stdin.write("done\n")
        exporter.stdin.close()
        exporter.wait(timeout=timeout_s)
    if not seen:
        return Row(label, f"the opener failed (exit {opener.returncode})", "-", False)
    same = seen["uuid"] == made["uuid"]
    where = "POSIX shared memory"
    if kind == "cuda":
        where = (
            f"exporter cuda:0 -> opener cuda:{seen['index']}, GPU {seen['uuid']}, staging "
            f"from a {made['segment']} segment (exporter {CONF}={made['settings']!r})"
        )
    ok = same and seen["equal"] and opener.returncode == 0 and exporter.returncode == 0
    ok = ok and made.get("segment", "cudaMalloc") == "cudaMalloc"
    return Row(label, f"{where}, bytes equal {seen['equal']}", "-", ok)


def with_expandable(settings: str) -> str | None:
    """``settings`` with ``expandable_segments:True``; ``None`` if they have it already."""
    items = split_settings(settings)
    if dict(items).get("expandable_segments", "").lower() == "true":
        return None
    keep = [(k, v) for k, v in items if k != "expandable_segments"]
    return join_settings([*keep, ("expandable_segments", "True")])


def run_ipc_check(
    kind: str = "cuda", timeout_s: float = 300, alloc_conf: str | None = None
) -> list[Row]:
    """The rows of this check on ``kind`` (``cuda`` or ``cpu``); ``alloc_conf``: the
    exporter's ``PYTORCH_CUDA_ALLOC_CONF`` (default: this process's)."""
    rows: list[Row] = []
    pids: list[int] = []
    reversed_order = None
    if kind == "cuda":
        uuids = visible_gpu_uuids()
        maps = [visible_index(gpu_uuid(i), uuids) for i in range(len(uuids))]
        rows.append(
            Row("UUID -> index round trip", f"{len(uuids)} GPU(s): {maps}", "-",
                maps == list(range(len(uuids))))
        )  # fmt: skip
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        order = listed.split(",") if listed else [str(i) for i in range(len(uuids))]
        reversed_order = ",".join(reversed(order)) if len(uuids) >= 2 else None
    same = "open, same CUDA_VISIBLE_DEVICES"
    rows.append(_pair(kind, None, same, timeout_s, pids, alloc_conf))
    if kind == "cuda":
        if reversed_order is None:
            rows.append(Row("open, reversed CUDA_VISIBLE_DEVICES", "skipped: 1 GPU", "-"))
        else:
            label = f"open, CUDA_VISIBLE_DEVICES={reversed_order}"
            rows.append(_pair(kind, reversed_order, label, timeout_s, pids, alloc_conf))
        given = os.environ.get(CONF, "") if alloc_conf is None else alloc_conf
        expandable = with_expandable(given)
        if expandable is not None:
            label = "open, exporter with expandable_segments:True"
            rows.append(_pair(kind, None, label, timeout_s, pids, expandable))
    left = _left_by(pids)
    rows.append(Row("/dev/shm after both exit", f"{len(left)} new: {left[:4]}", "-", not left))
    return rows


def main(argv: list[str]) -> int:
    if argv[:1] == ["--export"]:
        _export(argv[1])
        return 0
    if argv[:1] == ["--open"]:
        _open(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(prog="python -m nemo_refit_reshard.cli.ipc_check")
    parser.add_argument("kind", nargs="?", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--alloc-conf",
        default=None,
        help=f"the training process's {CONF}, for the exporter (default: this environment's)",
    )
    args = parser.parse_args(argv)
    if args.kind == "cuda" and not torch.cuda.is_available():
        print("ipc_check needs a CUDA GPU (or run it with 'cpu')", file=sys.stderr)
        return 1
    rows = run_ipc_check(args.kind, alloc_conf=args.alloc_conf)
    print_table(rows)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
