"""The CUDA staging comes from a ``cudaMalloc`` segment whatever the trainer's allocator
settings (``engine/staging_alloc.py``): under ``expandable_segments:True`` its export
would need ``pidfd_getfd`` in the opener, refused in unprivileged containers.

On CPU, torch's CUDA calls are stood in for by a fake caching allocator (the seams
``_recorded_settings``, ``_set_allocator_settings``, ``_allocator_backend``,
``_empty_cuda``, ``_share_cuda``): it hands out an expandable block (handle kind ``'e'``)
while its setting is on and a ``cudaMalloc`` one (``'c'``) while off, as torch's does.
The ``gpu`` test runs the real allocator; ``cli/ipc_check.py`` (the ipc-devices row of
``scripts/gpu_checks.sh``) opens such a staging from a second process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from nemo_refit_reshard.engine import staging, staging_alloc
from nemo_refit_reshard.engine.staging_alloc import (
    AllocationPath,
    StagingAllocatorRefused,
    allocation_path,
    allocator_settings,
    split_settings,
)

HANDLE = 64 * b"\x11"  # a cudaIpcMemHandle_t's bytes


def test_settings_split_into_pairs_brackets_kept() -> None:
    text = "expandable_segments:True, max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4]"
    assert split_settings(text) == [
        ("expandable_segments", "True"),
        ("max_split_size_mb", "128"),
        ("roundup_power2_divisions", "[256:1,>:4]"),
    ]
    assert split_settings("") == [] and split_settings(" , ") == []


def test_the_settings_in_force(monkeypatch) -> None:
    """torch's record of the last string set first, then the variables in torch's order."""
    monkeypatch.setattr(staging_alloc, "_recorded_settings", lambda: "")
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    assert allocator_settings(env) == "max_split_size_mb:64"
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    assert allocator_settings(env) == "expandable_segments:True"
    assert allocator_settings({}) == ""
    monkeypatch.setattr(staging_alloc, "_recorded_settings", lambda: "expandable_segments:False")
    assert allocator_settings(env) == "expandable_segments:False"


def test_the_path_for_each_setting() -> None:
    assert allocation_path("") == AllocationPath("caching")
    assert allocation_path("expandable_segments:False") == AllocationPath("caching")
    assert allocation_path("backend:native,expandable_segments:true,max_split_size_mb:128") == (
        AllocationPath(
            "expandable-off",
            "max_split_size_mb:128,expandable_segments:False",
            "max_split_size_mb:128,expandable_segments:True",
        )
    )
    assert allocation_path("max_split_size_mb:128", expandable=True).off == (
        "max_split_size_mb:128,expandable_segments:False"
    )


def test_the_async_backend_is_refused_by_name() -> None:
    want = (
        "CUDA IPC staging: this process allocates with torch's cudaMallocAsync backend "
        "(allocator settings 'backend:cudaMallocAsync'), whose memory torch cannot export "
        "by CUDA IPC; run the training process with the native backend: remove "
        "backend:cudaMallocAsync from PYTORCH_CUDA_ALLOC_CONF"
    )
    with pytest.raises(StagingAllocatorRefused) as err:
        allocation_path("backend:cudaMallocAsync")
    assert str(err.value) == want
    with pytest.raises(StagingAllocatorRefused) as err:
        allocation_path("", backend="cudaMallocAsync")  # torch says so, the text does not
    assert str(err.value) == want


class FakeAllocator:
    """torch's caching allocator as the staging sees it: ``expandable`` set by settings
    strings; each block's kind decided when it is allocated."""

    def __init__(self, expandable: bool, sticky: bool = False, old_torch: bool = False):
        self.expandable, self.sticky, self.old_torch = expandable, sticky, old_torch
        self.calls: list[str] = []
        self.kinds: dict[int, bytes] = {}

    def install(self, monkeypatch, recorded: str = "") -> None:
        monkeypatch.setattr(staging_alloc, "_recorded_settings", lambda: recorded)
        monkeypatch.setattr(staging_alloc, "_set_allocator_settings", self.set)
        monkeypatch.setattr(staging_alloc, "_allocator_backend", lambda: "native")
        monkeypatch.setattr(staging_alloc, "_empty_cuda", self.empty)
        monkeypatch.setattr(staging_alloc, "_share_cuda", self.share)
        monkeypatch.setattr(staging, "gpu_uuid", lambda index: "GPU-0a")

    def set(self, text: str) -> None:
        self.calls.append(text)
        if not self.sticky:
            self.expandable = dict(split_settings(text))["expandable_segments"] == "True"

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
        self.kinds[tensor.data_ptr()] = b"e" if self.expandable else b"c"
        return tensor

    def share(self, tensor: torch.Tensor) -> tuple:
        kind = self.kinds[tensor.data_ptr()]
        if kind == b"e" and self.old_torch:
            raise RuntimeError(
                "Tensors allocated with expandable_segments:True cannot be shared between "
                "processes. Consider using expandable_segments:False in data loading workers"
            )
        return (0, b"\x02" + kind + HANDLE, tensor.numel(), 0, b"/torch_1_2", 0, b"", True)


CUDA0 = torch.device("cuda", 0)


def _segment_kind(buf: staging.SharedBuffer) -> bytes:
    return staging_alloc.handle_kind(staging.parse_cuda_handle(buf.handle)[1])


def test_under_expandable_segments_the_staging_is_allocated_with_them_off(monkeypatch) -> None:
    """The trainer's other settings are kept both ways; the setting is back on after."""
    fake = FakeAllocator(expandable=True)
    fake.install(monkeypatch)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    buf = staging.create_shared_buffer(16, CUDA0)
    assert _segment_kind(buf) == b"c" and buf.tensor.numel() == 16
    assert fake.calls == [
        "max_split_size_mb:64,expandable_segments:False",
        "max_split_size_mb:64,expandable_segments:True",
    ]
    assert fake.expandable


def test_without_expandable_segments_the_settings_are_left_alone(monkeypatch) -> None:
    fake = FakeAllocator(expandable=False)
    fake.install(monkeypatch)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert _segment_kind(staging.create_shared_buffer(16, CUDA0)) == b"c"
    assert fake.calls == []


@pytest.mark.parametrize("old_torch", [False, True], ids=["exports-e", "refuses-export"])
def test_a_setting_no_record_shows_is_caught_by_the_handle(monkeypatch, old_torch) -> None:
    """Set at run time where neither torch's record nor the environment shows it: the
    first block is expandable (an ``'e'`` handle, or a torch that refuses to export it),
    so the staging is allocated again with the setting off, and it is put back on."""
    fake = FakeAllocator(expandable=True, old_torch=old_torch)
    fake.install(monkeypatch)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert _segment_kind(staging.create_shared_buffer(16, CUDA0)) == b"c"
    assert fake.calls == ["expandable_segments:False", "expandable_segments:True"]


def test_an_allocator_that_stays_expandable_is_refused_by_name(monkeypatch) -> None:
    fake = FakeAllocator(expandable=True, sticky=True)
    fake.install(monkeypatch, recorded="expandable_segments:True")
    with pytest.raises(StagingAllocatorRefused) as err:
        staging.create_shared_buffer(16, CUDA0)
    assert str(err.value) == (
        "CUDA IPC staging: torch's caching allocator gave the staging an expandable segment "
        "(allocator settings 'expandable_segments:True') even with expandable_segments "
        "turned off around it; a worker opens one only through pidfd_getfd, which "
        "unprivileged containers refuse. Run the training process with "
        "expandable_segments:False in PYTORCH_CUDA_ALLOC_CONF"
    )
    assert fake.calls == ["expandable_segments:False", "expandable_segments:True"]


def test_ipc_check_runs_the_exporter_with_the_trainers_settings(monkeypatch) -> None:
    """``--alloc-conf`` (else this environment's) reaches the exporter; a row with
    expandable segments on is added unless the given settings have them already."""
    from nemo_refit_reshard.cli import ipc_check

    monkeypatch.setattr(ipc_check, "visible_gpu_uuids", lambda: ["GPU-0a"])
    monkeypatch.setattr(ipc_check, "gpu_uuid", lambda i: "GPU-0a")
    monkeypatch.setattr(ipc_check, "_left_by", lambda pids: [])
    pairs: list[tuple[str, str | None]] = []

    def pair(kind, visible, label, timeout_s, pids, alloc_conf=None):
        pairs.append((label, alloc_conf))
        return ipc_check.Row(label, "-", "-")

    monkeypatch.setattr(ipc_check, "_pair", pair)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    ipc_check.run_ipc_check("cuda")
    expandable = "max_split_size_mb:64,expandable_segments:True"
    assert pairs == [
        ("open, same CUDA_VISIBLE_DEVICES", None),
        ("open, exporter with expandable_segments:True", expandable),
    ]
    pairs.clear()
    ipc_check.run_ipc_check("cuda", alloc_conf="expandable_segments:True")
    assert pairs == [("open, same CUDA_VISIBLE_DEVICES", "expandable_segments:True")]

    seen = {}

    class Popen:
        def __init__(self, args, env, **kwargs):
            seen.update(args=args[-2:], conf=env.get("PYTORCH_CUDA_ALLOC_CONF"))

    monkeypatch.setattr(subprocess, "Popen", Popen)
    ipc_check._child(["--export", "cuda"], None, "expandable_segments:True")
    assert seen == {"args": ["--export", "cuda"], "conf": "expandable_segments:True"}
    ipc_check._child(["--export", "cuda"], None)
    assert seen["conf"] == "max_split_size_mb:64"  # passed through


GPU_PROGRAM = """
import json, torch
from nemo_refit_reshard.engine import staging, staging_alloc
warm = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # an expandable block
buf = staging.create_shared_buffer(8 << 20, torch.device("cuda", 0))
after = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
segments = {s["address"]: s for s in torch.cuda.memory_snapshot()}
def expandable(t):
    p = t.data_ptr()
    return sorted({s.get("is_expandable") for a, s in segments.items()
                   if a <= p < a + s["total_size"]}, key=str)
print(json.dumps({
    "kind": staging_alloc.handle_kind(staging.parse_cuda_handle(buf.handle)[1]).decode(),
    "staging": expandable(buf.tensor), "warm": expandable(warm), "after": expandable(after),
    "settings": staging_alloc.allocator_settings(),
}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_staging_is_a_cudamalloc_block_under_expandable_segments() -> None:
    """A process with ``expandable_segments:True``: its blocks before and after are
    expandable, the staging is not (its handle kind ``'c'``), the setting is back on."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    proc = subprocess.run(
        [sys.executable, "-c", GPU_PROGRAM], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {
        "kind": "c",
        "staging": [False],
        "warm": [True],
        "after": [True],
        "settings": "expandable_segments:True",
    }
