"""Which GPU a worker computes on, named so that every process on a machine agrees.

A colocated refit pairs each generation worker with the training rank on its GPU
(``plan/colocation.py``). Device indices cannot say that: each process numbers the GPUs
it sees (``CUDA_VISIBLE_DEVICES`` differs between Ray actors, vLLM workers pick theirs
by local rank). A GPU's UUID does, together with the machine it is in.

A CPU process has no GPU: in the CPU twin of a colocated run, ``NRR_DEVICE`` names the
GPU the process stands for (set per process by whoever places them, as Ray places GPU
actors).
"""

from __future__ import annotations

import os
import socket

import torch

DEVICE_ENV = "NRR_DEVICE"


def device_name(device: torch.device | str) -> str | None:
    """``"<hostname>:<GPU UUID>"`` for a CUDA device; on CPU ``"<hostname>:<$NRR_DEVICE>"``,
    or None when that is unset (a CPU process that stands for no GPU)."""
    device = torch.device(device)
    hostname = socket.gethostname()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"{hostname}:{torch.cuda.get_device_properties(index).uuid}"
    named = os.environ.get(DEVICE_ENV)
    return f"{hostname}:{named}" if named else None


__all__ = ["DEVICE_ENV", "device_name"]
