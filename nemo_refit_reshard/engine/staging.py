"""Byte buffers one process creates and another on the same device opens by a text handle.

* CPU (the colocated refit's CPU twin): POSIX shared memory (``multiprocessing.
  shared_memory``); the handle is the segment's name.
* CUDA: CUDA IPC of a buffer from the creator's own caching allocator; the handle is
  ``UntypedStorage._share_cuda_()``'s fields as JSON (bytes hex-encoded), opened with
  ``UntypedStorage._new_shared_cuda`` — what ``torch.multiprocessing`` does, without
  pickling. The creator must keep its buffer alive while the other side uses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SharedBuffer:
    """A uint8 tensor both processes see, and the handle that names it."""

    tensor: torch.Tensor
    handle: str
    _owner: Any = field(default=None, repr=False)  # what keeps the memory mapped

    def close(self) -> None:
        """Drop this process's mapping (the creator also removes an OS segment)."""
        shm, created = self._owner if isinstance(self._owner, tuple) else (None, False)
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if shm is not None:
            try:
                shm.close()
            except BufferError:  # views compiled into a program still use it: freed with them
                pass
            if created:
                shm.unlink()
        self._owner = None


def create_shared_buffer(nbytes: int, device: torch.device) -> SharedBuffer:
    """A new buffer of ``nbytes`` on ``device`` (CPU or CUDA) and its handle."""
    if device.type == "cuda":
        tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        fields = tensor.untyped_storage()._share_cuda_()
        text = json.dumps([f.hex() if isinstance(f, bytes) else f for f in fields])
        kinds = "".join("b" if isinstance(f, bytes) else "v" for f in fields)
        return SharedBuffer(tensor[:nbytes], f"cuda:{kinds}:{text}", tensor)
    if device.type != "cpu":
        raise ValueError(f"shared staging on {device.type}: only cpu and cuda")
    from multiprocessing.shared_memory import SharedMemory

    shm = SharedMemory(create=True, size=max(nbytes, 1))
    tensor = torch.frombuffer(shm.buf, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]
    return SharedBuffer(tensor, f"shm:{shm.name}:{nbytes}", (shm, True))


def open_shared_buffer(handle: str, device: torch.device) -> SharedBuffer:
    """The buffer another process on ``device`` created (:func:`create_shared_buffer`)."""
    kind, _, rest = handle.partition(":")
    if kind == "cuda":
        if device.type != "cuda":
            raise ValueError(f"a CUDA staging handle opened on {device}")
        kinds, _, text = rest.partition(":")
        values = json.loads(text)
        fields = [bytes.fromhex(v) if k == "b" else v for k, v in zip(kinds, values)]
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
        tensor = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        return SharedBuffer(tensor, handle, storage)
    if kind != "shm" or device.type != "cpu":
        raise ValueError(f"cannot open staging handle {handle[:40]!r} on {device}")
    from multiprocessing import resource_tracker
    from multiprocessing.shared_memory import SharedMemory

    name, _, size = rest.rpartition(":")
    shm = SharedMemory(name=name)
    # The creator owns the segment: this process must not remove it when it exits.
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    count = int(size)
    tensor = torch.frombuffer(shm.buf, dtype=torch.uint8, count=max(count, 1))[:count]
    return SharedBuffer(tensor, handle, (shm, False))


__all__ = ["SharedBuffer", "create_shared_buffer", "open_shared_buffer"]
