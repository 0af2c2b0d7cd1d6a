"""The colocated staging: CUDA IPC opened on the exporter's GPU by UUID, and every shared
segment released — by close, by the creator's resource tracker when it dies, by the next
creator's sweep when a shared tracker outlives it.

Stand-ins (named): ``staging.visible_gpu_uuids`` (the opener's visible GPUs) and
``staging._new_shared_cuda`` (``UntypedStorage._new_shared_cuda``, which needs a GPU)
let the CUDA open path run on CPU; the ``gpu`` test runs the real one. New names are
reached through their modules inside each test, so that each test fails on its own on
the code before the fix.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_refit_reshard.engine import staging
from nemo_refit_reshard.engine.colocated import ColocatedHost
from nemo_refit_reshard.engine.materialize import SyntheticWeights, materialize
from nemo_refit_reshard.engine.rendezvous import free_port
from nemo_refit_reshard.engine.staging import create_shared_buffer, open_shared_buffer
from nemo_refit_reshard.integrations.worker import ColocatedTrainer, RefitEndpoint
from nemo_refit_reshard.plan import Colocation
from nemo_refit_reshard.runner import RunConfig, build_layouts, run_colocated
from nemo_refit_reshard.runner.colocated import colocated_plan

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
DENSE = RunConfig(model="small-qwen3", train="tp=2,pp=2", infer="tp=2")
UUIDS = ["GPU-0a", "GPU-1b", "GPU-2c", "GPU-3d"]  # the machine's GPUs, nvidia-smi order


def _segments():
    from nemo_refit_reshard.engine import shm_segments

    return shm_segments


def project_segments(pid: int | None = None) -> list[str]:
    return _segments().project_segments(pid)


def segment_creator(name: str) -> tuple[str, int] | None:
    return _segments().segment_creator(name)


def _wait_gone(path: Path, deadline_s: float = 300) -> bool:
    """Whether ``path`` disappears (another process removes it) before the deadline."""
    end = time.monotonic() + deadline_s
    while path.exists() and time.monotonic() < end:
        time.sleep(0.2)
    return not path.exists()


# --- 5. CUDA IPC by GPU UUID ----------------------------------------------------------------


def test_visible_index_maps_every_permutation_of_cuda_visible_devices() -> None:
    """Exporter and opener each see any ordered subset of the GPUs; the exporter's GPU
    opens on the opener's index of the same physical GPU, whatever the two orders."""
    moved = same = 0
    for n in (1, 2, 3):
        for exporter in itertools.permutations(UUIDS, n):
            for opener in itertools.permutations(UUIDS, n):
                for i, uuid in enumerate(exporter):
                    if uuid not in opener:
                        continue
                    j = staging.visible_index(uuid, opener)
                    assert opener[j] == uuid  # the same physical GPU
                    moved, same = moved + (j != i), same + (j == i)
    assert (moved, same) == (936, 508)  # most orders name the GPU by another index
    assert staging.visible_index("GPU-2c", ["GPU-2c", "GPU-1b", "GPU-0a"]) == 0
    assert staging.visible_index("GPU-0a", ["GPU-2c", "GPU-1b", "GPU-0a"]) == 2


def test_visible_index_refuses_a_gpu_the_opener_does_not_see() -> None:
    with pytest.raises(ValueError) as err:
        staging.visible_index("GPU-3d", ["GPU-1b", "GPU-0a"])
    assert str(err.value) == (
        "CUDA IPC: the staging is on GPU GPU-3d, which this process does not see (its "
        "visible GPUs: GPU-1b, GPU-0a); make that GPU visible to it (CUDA_VISIBLE_DEVICES)"
    )


FIELDS = (2, b"\x01\x02\xff", 64, 0, b"/torch_1_2", 5, b"\x00ev", True)  # _share_cuda_()'s


def test_cuda_handle_round_trip_keeps_fields_and_uuid() -> None:
    assert staging.parse_cuda_handle(staging.cuda_handle(FIELDS, "GPU-2c")) == (
        "GPU-2c",
        list(FIELDS),
    )
    with pytest.raises(ValueError, match="not a CUDA staging handle"):
        staging.parse_cuda_handle("cuda:b:[1]")


def test_open_uses_the_openers_index_of_the_exporters_gpu(monkeypatch) -> None:
    """The exporter (CUDA_VISIBLE_DEVICES=0,1,2) shares a buffer on its cuda:2; the
    opener sees the GPUs as 2,1,0, so the same GPU is its cuda:0. Stand-ins:
    ``visible_gpu_uuids`` (the opener's GPUs) and ``_new_shared_cuda`` (records what
    it is asked to open; a CPU storage)."""
    opened: list[tuple[Any, ...]] = []

    def new_shared_cuda(*fields: Any) -> torch.UntypedStorage:
        opened.append(fields)
        return torch.UntypedStorage(fields[2])

    monkeypatch.setattr(staging, "visible_gpu_uuids", lambda: ["GPU-2c", "GPU-1b", "GPU-0a"])
    monkeypatch.setattr(staging, "_new_shared_cuda", new_shared_cuda)
    handle = staging.cuda_handle(FIELDS, "GPU-2c")
    buf = open_shared_buffer(handle, torch.device("cuda", 0))
    assert opened == [(0, *FIELDS[1:])]  # every field as exported but the device index
    assert buf.tensor.numel() == 64 and buf.handle == handle
    open_shared_buffer(handle, torch.device("cuda"))  # the current device: mapped too
    assert opened[1][0] == 0
    with pytest.raises(ValueError) as err:
        open_shared_buffer(handle, torch.device("cuda", 2))
    assert str(err.value) == (
        "CUDA IPC: the staging is on GPU GPU-2c, this process's cuda:0, not the cuda:2 "
        "it was asked to open it on: a worker and its training rank share one GPU"
    )
    monkeypatch.setattr(staging, "visible_gpu_uuids", lambda: ["GPU-1b"])
    with pytest.raises(ValueError, match="GPU GPU-2c, which this process does not see"):
        open_shared_buffer(handle, torch.device("cuda", 0))
    assert len(opened) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_handle_names_its_gpu_and_close_frees_it() -> None:
    """On this GPU: the handle carries the creator's GPU UUID, which maps back to the
    creator's own index; close returns the buffer to the allocator. (The open from a
    second process, also with reversed CUDA_VISIBLE_DEVICES: ``cli/ipc_check.py``, the
    ipc-devices row of scripts/gpu_checks.sh.)"""
    uuids = staging.visible_gpu_uuids()
    for i in range(len(uuids)):
        assert staging.visible_index(staging.gpu_uuid(i), uuids) == i
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    before = torch.cuda.memory_allocated(device)
    buf = create_shared_buffer(8 << 20, device)
    uuid, fields = staging.parse_cuda_handle(buf.handle)
    assert (uuid, fields[0]) == (uuids[device.index], device.index)
    assert torch.cuda.memory_allocated(device) >= before + (8 << 20)
    # What an opener does when it drops its mapping: torch frees a shared block only
    # once its IPC reference count is back to zero.
    torch.UntypedStorage._release_ipc_counter_cuda(fields[4], fields[5])
    buf.close()
    assert torch.cuda.memory_allocated(device) == before


# --- 6. Release what is taken ---------------------------------------------------------------


def _host(plan, rank: int = 0) -> ColocatedHost:
    spec, sources, _ = build_layouts(DENSE)
    tensors = materialize(sources[rank], SyntheticWeights(spec.unquantized(), 0))
    return ColocatedHost(plan, plan, rank, tensors)


def test_init_close_cycles_leave_no_segment() -> None:
    """N hosts made and closed, each opened by a guest: exactly one segment of this
    process while it lives, none after close (count exact, never growing)."""
    plan = colocated_plan(DENSE)
    me = os.getpid()
    assert project_segments(me) == []
    for cycle in range(4):
        host = _host(plan)
        assert host.staging is not None
        (name,) = project_segments(me)
        assert host.staging.handle.startswith(f"shm:{name}:")
        guest = open_shared_buffer(host.staging.handle, CPU)
        host.staging.tensor[:3] = torch.tensor([cycle, 7, 9], dtype=torch.uint8)
        assert guest.tensor[:3].tolist() == [cycle, 7, 9]
        guest.close()
        host.close()
        host.close()  # idempotent
        assert project_segments(me) == [], cycle
        assert not Path("/dev/shm", name).exists()
        with pytest.raises(RuntimeError, match="this host is closed"):
            host.replay(None)  # type: ignore[arg-type]


def test_trainer_close_releases_its_staging() -> None:
    plan = colocated_plan(DENSE)
    spec, sources, _ = build_layouts(DENSE)
    me, s = os.getpid(), plan.num_sources
    for rank in range(s):  # ranks 0, 1 host a worker; 2, 3 none
        tensors = materialize(sources[rank], SyntheticWeights(spec.unquantized(), 0))
        endpoint = RefitEndpoint("127.0.0.1", free_port(), s, rank, secret="x" * 16)
        trainer = ColocatedTrainer(endpoint, tensors, plan)
        hosts = Colocation(plan.colocated_hosts).guest_of(rank, s) is not None
        assert len(project_segments(me)) == int(hosts), rank
        trainer.close()
        assert project_segments(me) == [], rank


_KILLED_HOST = """
import os, signal, sys, torch
from nemo_refit_reshard.engine.staging import create_shared_buffer, open_shared_buffer
cpu = torch.device("cpu")
host = create_shared_buffer(1 << 20, cpu)
guest = open_shared_buffer(host.handle, cpu)  # as a guest sharing the host's tracker does
guest.tensor[:2] = 5
guest.close()
print(host.handle.split(":")[1], flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)  # dies mid-step: no close, no atexit
"""


@pytest.mark.slow
def test_a_killed_creator_leaves_no_segment() -> None:
    """A process that created the staging (and opened it as a guest would, through the
    same resource tracker) is SIGKILLed: its tracker removes the segment. Before the fix
    the guest's unregister made the tracker forget it, and it stayed for good."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_HOST],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the tracker's "leaked shared_memory" warning
        text=True,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    name = proc.stdout.readline().strip()
    path = Path("/dev/shm", name)
    assert path.exists(), name
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.wait() == -signal.SIGKILL
    assert _wait_gone(path), f"{name} left in /dev/shm by a killed creator"


def _create_and_die(queue) -> None:  # a multiprocessing child: shares its parent's tracker
    buf = create_shared_buffer(4096, CPU)
    queue.put(buf.handle.split(":")[1])
    time.sleep(600)  # killed by the parent


@pytest.mark.slow
def test_the_next_init_sweeps_what_a_killed_child_left() -> None:
    """A child sharing this process's resource tracker is SIGKILLed after creating its
    staging: the tracker would remove the segment only when this process exits; the next
    staging made here sweeps it (its creator is not running)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_create_and_die, args=(queue,))
    child.start()
    name = queue.get(timeout=600)
    child.kill()
    child.join()
    path = Path("/dev/shm", name)
    assert path.exists() and segment_creator(name)[1] == child.pid  # type: ignore[index]
    assert not _segments().pid_running(child.pid)  # type: ignore[arg-type]
    mine = create_shared_buffer(16, CPU)
    assert not path.exists()
    mine.close()
    assert project_segments(os.getpid()) == []


def test_sweep_keeps_running_creators_and_other_namespaces(monkeypatch) -> None:
    mine = create_shared_buffer(16, CPU)
    name = mine.handle.split(":")[1]
    other_ns = name.replace(f"nrr-{_segments()._pid_namespace()}-", "nrr-1-", 1)
    Path("/dev/shm", other_ns).write_bytes(b"x")  # a dead pid? another namespace's
    monkeypatch.setattr(_segments(), "pid_running", lambda pid: False)
    try:
        assert name in _segments().sweep_orphans()  # "dead" creator: swept
        assert Path("/dev/shm", other_ns).exists()  # never judged from here
    finally:
        os.unlink(Path("/dev/shm", other_ns))
        mine.close()  # its segment is gone already


@pytest.mark.slow
def test_demo_and_a_host_killed_mid_step_leave_no_segment(monkeypatch) -> None:
    """The colocated demo, and the same with training rank 0 SIGKILLed at the start of
    its first timed step (its guest waiting on the staging): no segment of the run is
    left. The driver's sweep is stubbed out for the clean run, so that only the ranks'
    own close can leave /dev/shm clean there."""
    from nemo_refit_reshard.runner import colocated as runner

    def dead_segments() -> list[str]:
        return [n for n in project_segments() if not _segments().pid_running(segment_creator(n)[1])]  # type: ignore[index]

    before = set(dead_segments())
    swept: list[int] = []
    monkeypatch.setattr(runner, "sweep_orphans", lambda: swept.append(1))
    result = run_colocated(replace(DENSE, steps=1, timeout_s=120))
    assert result.errors() == {} and swept == [1]
    assert set(dead_segments()) <= before
    monkeypatch.undo()
    result = run_colocated(replace(DENSE, steps=2, timeout_s=20, kill_rank=0, kill_step=1))
    assert result.errors()[0] == f"process died without a report (exit code {-signal.SIGKILL})"
    assert dead_segments() == []


@pytest.mark.slow
def test_ipc_check_cpu_twin() -> None:
    """``cli/ipc_check.py`` on CPU: two processes, one exports, one opens and compares."""
    from nemo_refit_reshard.cli.ipc_check import run_ipc_check

    rows = run_ipc_check("cpu")
    assert [(r.check, r.figure, r.ok) for r in rows] == [
        ("open, same CUDA_VISIBLE_DEVICES", "POSIX shared memory, bytes equal True", True),
        ("/dev/shm after both exit", "0 new: []", True),
    ]


@pytest.mark.slow
def test_a_failed_vllm_native_colocated_start_releases_its_staging(tmp_path: Path) -> None:
    """``trainer_init`` of the vLLM-native colocated trainer, its client refusing at once
    (``tests/programs/colocated_start_fails.py``, a stand-in for VLLMWeightSyncClient):
    the error reaches the caller and no segment of that start is left behind."""
    from tests.helpers import vllm_env

    if vllm_env.skip_reason() is not None:
        pytest.skip(vllm_env.skip_reason() or "")
    out = tmp_path / "out.json"
    vllm_env.finish(vllm_env.start("colocated_start_fails", str(out)), "the failed start")
    assert json.loads(out.read_text()) == {"error": "the workers refused the engine", "left": []}
