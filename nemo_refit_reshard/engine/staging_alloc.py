"""Where a CUDA staging buffer comes from so that CUDA IPC can share it.

Why: trainers often run torch's caching allocator with expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: NeMo RL, Megatron and veRL
recipes set it against fragmentation). A block of an expandable segment is cuMem-mapped
memory: ``UntypedStorage._share_cuda_()`` exports it as a POSIX file descriptor
(``ExpandableSegment::share``, handle kind ``'e'``) that the opener copies out of the
exporter with ``pidfd_getfd`` — refused (``EPERM``) in unprivileged containers, where
ptrace is restricted — and torch builds that do not share expandable segments refuse the
export itself. A block of a ``cudaMalloc`` segment exports a ``cudaIpcMemHandle_t``
(kind ``'c'``), which needs neither.

So the staging is allocated with expandable segments turned off around the allocation
and turned back on right after — the use torch's allocator itself names (its
``get_free_block``: "since we cannot share expandable memory via IPC, someone might
temporarily disable it"; while off, it hands out only blocks of ``cudaMalloc``
segments). The settings are set whole each time (all keys but ``backend``, with
``expandable_segments`` changed): torch before 2.9 resets the keys a settings string
leaves out. A ``torch.cuda.MemPool`` would not do: without an allocator of its own it
follows the same setting, and one with an allocator is refused under expandable segments
("MemPool doesn't currently support expandable_segments"). The window is one
allocation; another thread allocating inside it gets a ``cudaMalloc`` block too, which is
harmless.

The settings in force are torch's own record of the last string set (torch >= 2.9), else
``PYTORCH_CUDA_ALLOC_CONF`` then ``PYTORCH_ALLOC_CONF`` (the order torch reads them). A
setting changed where neither shows it is caught by the exported handle's kind: an
``'e'`` handle is allocated again with the setting off. torch's ``cudaMallocAsync``
backend cannot export CUDA IPC handles at all: refused by name, saying what to set.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
CUDA_MALLOC, EXPANDABLE = b"c", b"e"  # byte 1 of a _share_cuda_() handle (byte 0: version)


class StagingAllocatorRefused(RuntimeError):
    """The training process's CUDA allocator cannot give a staging CUDA IPC can share."""


def split_settings(text: str) -> list[tuple[str, str]]:
    """``key:value`` pairs of an allocator settings string, in order (commas inside
    ``[...]``, as in ``roundup_power2_divisions:[256:1,>:4]``, stay in their value)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            item = text[start:i].strip()
            start = i + 1
            if item:
                key, _, value = item.partition(":")
                items.append((key.strip(), value.strip()))
    return items


def join_settings(items: list[tuple[str, str]]) -> str:
    return ",".join(f"{k}:{v}" for k, v in items)


def allocator_settings(environ: Mapping[str, str] | None = None) -> str:
    """The allocator settings in force (see the module's note)."""
    recorded = _recorded_settings()
    if recorded:
        return recorded
    env = os.environ if environ is None else environ
    return next((env[v] for v in ALLOC_CONF_VARS if env.get(v)), "")


@dataclass(frozen=True)
class AllocationPath:
    """How the staging is allocated: ``caching`` (the caching allocator as it is set), or
    ``expandable-off`` (settings ``off`` around the allocation, ``back`` after it)."""

    name: str
    off: str = ""
    back: str = ""


def allocation_path(
    settings: str, backend: str = "native", expandable: bool | None = None
) -> AllocationPath:
    """The path for ``settings`` (``expandable``: known from elsewhere, e.g. a handle)."""
    items = split_settings(settings)
    given = dict(items)
    if given.get("backend", backend).lower() == "cudamallocasync":
        raise StagingAllocatorRefused(
            "CUDA IPC staging: this process allocates with torch's cudaMallocAsync backend "
            f"(allocator settings {settings or 'backend:cudaMallocAsync'!r}), whose memory "
            "torch cannot export by CUDA IPC; run the training process with the native "
            "backend: remove backend:cudaMallocAsync from PYTORCH_CUDA_ALLOC_CONF"
        )
    if expandable is None:
        expandable = given.get("expandable_segments", "").lower() == "true"
    if not expandable:
        return AllocationPath("caching")
    keep = [(k, v) for k, v in items if k not in ("backend", "expandable_segments")]
    return AllocationPath(
        "expandable-off",
        join_settings([*keep, ("expandable_segments", "False")]),
        join_settings([*keep, ("expandable_segments", "True")]),
    )


def handle_kind(fields: tuple[Any, ...] | list[Any]) -> bytes:
    """``CUDA_MALLOC``, ``EXPANDABLE`` or ``b""`` (another format) of ``_share_cuda_()``'s
    fields (field 1 is the handle: a version byte, then its kind)."""
    handle = fields[1]
    return handle[1:2] if isinstance(handle, bytes) and len(handle) >= 2 else b""


def expandable_refusal(settings: str) -> str:
    return (
        "CUDA IPC staging: torch's caching allocator gave the staging an expandable "
        f"segment (allocator settings {settings!r}) even with expandable_segments turned "
        "off around it; a worker opens one only through pidfd_getfd, which unprivileged "
        "containers refuse. Run the training process with expandable_segments:False in "
        "PYTORCH_CUDA_ALLOC_CONF"
    )


_ALLOCATING = threading.Lock()


def allocate_shareable(nbytes: int, device: torch.device) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """A uint8 tensor of ``max(nbytes, 1)`` bytes on the CUDA ``device`` from a
    ``cudaMalloc`` segment, and its ``_share_cuda_()`` fields."""
    # One allocation at a time in a process: the allocator's settings are global, and
    # another thread's window could turn expandable segments back on inside this one.
    with _ALLOCATING:
        settings = allocator_settings()
        path = allocation_path(settings, _allocator_backend())
        tensor, fields = _allocate(nbytes, device, path)
        if fields is None and path.name == "caching":  # set where neither record showed it
            del tensor
            again = allocation_path(settings, expandable=True)
            tensor, fields = _allocate(nbytes, device, again)
    if fields is None:
        raise StagingAllocatorRefused(expandable_refusal(settings))
    return tensor, fields


def _allocate(
    nbytes: int, device: torch.device, path: AllocationPath
) -> tuple[torch.Tensor, tuple[Any, ...] | None]:
    """The tensor and its fields, ``None`` for fields when it came from an expandable
    segment (exported as ``'e'``, or refused by a torch that does not share those)."""
    with _settings_around(path):
        tensor = _empty_cuda(max(nbytes, 1), device)
    try:
        fields = _share_cuda(tensor)
    except RuntimeError as err:
        if "expandable" not in str(err).lower():
            raise
        return tensor, None
    return tensor, (None if handle_kind(fields) == EXPANDABLE else fields)


@contextmanager
def _settings_around(path: AllocationPath) -> Iterator[None]:
    if path.name != "expandable-off":
        yield
        return
    _set_allocator_settings(path.off)
    try:
        yield
    finally:
        _set_allocator_settings(path.back)


# --- Seams: torch's CUDA calls (CPU tests stand in for them) ------------------------------


def _recorded_settings() -> str:
    """torch's record of the last settings string (torch >= 2.9; ``""`` before)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return getter() if getter is not None else ""


def _set_allocator_settings(text: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch < 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter(text)


def _allocator_backend() -> str:
    return torch.cuda.get_allocator_backend()


def _empty_cuda(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _share_cuda(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tensor.untyped_storage()._share_cuda_()


__all__ = [
    "AllocationPath",
    "StagingAllocatorRefused",
    "allocate_shareable",
    "allocation_path",
    "allocator_settings",
    "handle_kind",
    "split_settings",
]
