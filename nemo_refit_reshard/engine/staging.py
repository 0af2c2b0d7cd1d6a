"""Byte buffers one process creates and another on the same device opens by a text handle.

* CPU (the colocated refit's CPU twin): POSIX shared memory; the handle is the segment's
  name (``engine/shm_segments.py``: named after its creator, removed by the creator's
  ``close``, swept when the creator dies). The opener maps it without registering it
  with ``multiprocessing``'s resource tracker: a tracker shared by a host and its guest
  (children of one parent) would otherwise forget the host's segment when the guest
  unregisters its own copy of the name, and never remove it.
* CUDA: CUDA IPC of a buffer from the creator's own caching allocator; the handle is
  ``UntypedStorage._share_cuda_()``'s fields and the GPU's UUID as JSON (bytes
  hex-encoded), opened with ``UntypedStorage._new_shared_cuda`` — what
  ``torch.multiprocessing`` does, without pickling. Field 0 is the creator's device
  *index*, which names another GPU in a process whose ``CUDA_VISIBLE_DEVICES`` lists the
  GPUs in another order: the opener replaces it by the index of the creator's GPU (by
  UUID) among its own visible GPUs (:func:`visible_index`), as vLLM does when it rebuilds
  IPC handles. The creator must keep its buffer alive while the other side uses it.
  The buffer comes from a ``cudaMalloc`` segment even where the creator runs with
  ``expandable_segments:True``, which a second process could open only through
  ``pidfd_getfd`` (refused in unprivileged containers); the ``cudaMallocAsync`` backend
  is refused by name (``engine/staging_alloc.py``).
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .shm_segments import new_segment_name, sweep_orphans
from .staging_alloc import allocate_shareable


@dataclass
class SharedBuffer:
    """A uint8 tensor both processes see, and the handle that names it."""

    tensor: torch.Tensor
    handle: str
    _owner: Any = field(default=None, repr=False)  # what keeps the memory mapped

    def close(self) -> None:
        """Drop this process's mapping (the creator also removes the OS segment). Idempotent.

        A CUDA creator's block returns to its allocator once no view of it is left here
        and the opener has dropped its mapping (torch's CUDA IPC reference count: until
        then torch keeps it in its "limbo", collected here and on the allocator's next
        shortage); an opener that died holding it keeps it until this process exits."""
        owner, self._owner = self._owner, None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if isinstance(owner, torch.Tensor) and owner.is_cuda:
            del owner
            torch.cuda.ipc_collect()
            return
        if isinstance(owner, tuple):
            shm, created = owner
            try:
                shm.close()
            except BufferError:  # views compiled into a program still use it: freed with them
                pass
            if created:
                try:
                    shm.unlink()  # the name goes now; the bytes with the last mapping
                except FileNotFoundError:  # removed already (a sweep judged this process dead)
                    from multiprocessing import resource_tracker

                    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


# --- CUDA IPC: the handle and the device it opens on --------------------------------------


def cuda_handle(fields: Sequence[Any], uuid: str) -> str:
    """The text handle of ``_share_cuda_()``'s ``fields`` exported from the GPU ``uuid``."""
    return "cuda:" + json.dumps(
        {
            "uuid": uuid,
            "kinds": "".join("b" if isinstance(f, bytes) else "v" for f in fields),
            "fields": [f.hex() if isinstance(f, bytes) else f for f in fields],
        }
    )


def parse_cuda_handle(handle: str) -> tuple[str, list[Any]]:
    """``(GPU UUID, _share_cuda_() fields)`` of a :func:`cuda_handle`."""
    kind, _, text = handle.partition(":")
    try:
        if kind != "cuda":
            raise ValueError(kind)
        body = json.loads(text)
        fields = [
            bytes.fromhex(v) if k == "b" else v
            for k, v in zip(body["kinds"], body["fields"], strict=True)
        ]
        return str(body["uuid"]), fields
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"not a CUDA staging handle: {handle[:60]!r} (the two sides run different "
            "versions of nemo_refit_reshard?)"
        ) from err


def visible_index(uuid: str, visible: Sequence[str]) -> int:
    """The index under which this process sees the GPU ``uuid``, ``visible`` being the
    UUIDs of its visible GPUs in its own order (``CUDA_VISIBLE_DEVICES``)."""
    for index, seen in enumerate(visible):
        if seen == uuid:
            return index
    raise ValueError(
        f"CUDA IPC: the staging is on GPU {uuid}, which this process does not see (its "
        f"visible GPUs: {', '.join(visible) or 'none'}); make that GPU visible to it "
        "(CUDA_VISIBLE_DEVICES)"
    )


def gpu_uuid(index: int) -> str:
    """The UUID of this process's GPU ``index`` (as ``torch`` prints it)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpu_uuids() -> list[str]:
    """The UUIDs of this process's visible GPUs, in its own index order."""
    return [gpu_uuid(i) for i in range(torch.cuda.device_count())]


def _new_shared_cuda(*fields: Any) -> torch.UntypedStorage:
    """Open a CUDA IPC storage (a seam: CPU tests stand in for it)."""
    torch.cuda._lazy_init()
    return torch.UntypedStorage._new_shared_cuda(*fields)


def _open_cuda(handle: str, device: torch.device) -> SharedBuffer:
    uuid, fields = parse_cuda_handle(handle)
    index = visible_index(uuid, visible_gpu_uuids())
    if device.index is not None and device.index != index:
        raise ValueError(
            f"CUDA IPC: the staging is on GPU {uuid}, this process's cuda:{index}, not the "
            f"{device} it was asked to open it on: a worker and its training rank share one GPU"
        )
    fields[0] = index  # the creator's index names another GPU here
    storage = _new_shared_cuda(*fields)
    tensor = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return SharedBuffer(tensor, handle, storage)


# --- POSIX shared memory ------------------------------------------------------------------


def _open_shm(name: str, nbytes: int) -> SharedBuffer:
    """Map segment ``name`` without telling any resource tracker (see the module's note)."""
    import _posixshmem  # what multiprocessing.shared_memory maps segments with

    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        size = os.fstat(fd).st_size
        if size < max(nbytes, 1):
            raise ValueError(f"staging segment {name} holds {size} bytes, the handle says {nbytes}")
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]
    return SharedBuffer(tensor, f"shm:{name}:{nbytes}", (mapping, False))


def create_shared_buffer(nbytes: int, device: torch.device) -> SharedBuffer:
    """A new buffer of ``nbytes`` on ``device`` (CPU or CUDA) and its handle."""
    if device.type == "cuda":
        tensor, fields = allocate_shareable(nbytes, device)
        handle = cuda_handle(fields, gpu_uuid(tensor.device.index))
        return SharedBuffer(tensor[:nbytes], handle, tensor)
    if device.type != "cpu":
        raise ValueError(f"shared staging on {device.type}: only cpu and cuda")
    from multiprocessing.shared_memory import SharedMemory

    sweep_orphans()  # what dead creators left behind (engine/shm_segments.py)
    # Registered with this process's resource tracker, which unlinks it if this
    # process dies without close().
    shm = SharedMemory(name=new_segment_name(), create=True, size=max(nbytes, 1))
    tensor = torch.frombuffer(shm.buf, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]
    return SharedBuffer(tensor, f"shm:{shm.name}:{nbytes}", (shm, True))


def open_shared_buffer(handle: str, device: torch.device) -> SharedBuffer:
    """The buffer another process on ``device`` created (:func:`create_shared_buffer`)."""
    kind, _, rest = handle.partition(":")
    if kind == "cuda":
        if device.type != "cuda":
            raise ValueError(f"a CUDA staging handle opened on {device}")
        return _open_cuda(handle, device)
    if kind != "shm" or device.type != "cpu":
        raise ValueError(f"cannot open staging handle {handle[:40]!r} on {device}")
    name, _, size = rest.rpartition(":")
    return _open_shm(name, int(size))


__all__ = [
    "SharedBuffer",
    "create_shared_buffer",
    "cuda_handle",
    "gpu_uuid",
    "open_shared_buffer",
    "parse_cuda_handle",
    "visible_gpu_uuids",
    "visible_index",
]
