"""Delta refit's options, per-step stats and errors (``engine/delta/program.py`` runs them).

Versions: :data:`UNKNOWN` for a rank that is new, restarted or emptied, :data:`FAILED`
after a failed step; otherwise the step its baselines / weights hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import kernels as delta_kernels

UNKNOWN = -1
FAILED = -2
BASELINE_PLACES = ("auto", "device", "host")
# "auto" keeps a GPU rank's baselines on the GPU while they take at most this share of
# its free memory when the group forms: the rest stays for what the trainer allocates
# during a step (activations, gradients' buffers), which the refit cannot see.
AUTO_DEVICE_SHARE = 0.5


class DeltaError(RuntimeError):
    """A delta arrived that this rank cannot apply (the ranks disagree on versions)."""


@dataclass(frozen=True)
class DeltaOptions:
    """``anchor_every``: a dense step every that many versions (0: only when needed).
    ``baseline``: where senders keep their baselines, ``"device"`` (the staging's),
    ``"host"`` (pinned host memory when the device is a GPU), or ``"auto"`` (the device
    where they fit, :func:`choose_baseline_place`; else the host). ``cpu_kernel``: how CPU
    ranks compare, encode and apply (``engine/delta/kernels.py``): ``"numba"`` (compiled,
    one pass, no pack of direct messages), ``"numpy"``, or ``"auto"`` (numba when
    installed); the bytes on the wire are the same. ``check``: before each step, every
    receiver's live tensors are fingerprinted and a message whose receiver holds other
    bytes than its sender's baseline goes dense (``engine/delta/check.py``): weights
    changed outside the refit are caught, not patched into silent corruption. ``None``
    (the default): on for GPU ranks, where its reads run at HBM speed; off for CPU ranks,
    where reading every rank's messages each step costs more than the delta step itself
    (``docs/benchmarks.md``, "Delta refit (CPU)"); the group runs it only when every rank
    asks for it."""

    anchor_every: int = 0
    baseline: str = "auto"
    cpu_kernel: str = "auto"
    check: bool | None = None

    def __post_init__(self) -> None:
        if self.anchor_every < 0:
            raise ValueError(f"delta anchor_every={self.anchor_every} must be >= 0")
        if self.baseline not in BASELINE_PLACES:
            raise ValueError(
                f"delta baseline={self.baseline!r}: choose one of {list(BASELINE_PLACES)}"
            )
        if not (self.check is None or isinstance(self.check, bool)):
            raise ValueError(f"delta check={self.check!r} must be True, False or None (auto)")
        delta_kernels.use_numba(self.cpu_kernel)  # refuses an unknown or missing kernel


def choose_baseline_place(option: str, device: torch.device, nbytes: int) -> str:
    """Where a sender keeps ``nbytes`` of baselines: ``option`` when it names a place;
    for ``"auto"``, a GPU rank's device while they take at most :data:`AUTO_DEVICE_SHARE`
    of its free memory (a DeepSeek-V3 training rank's ~5.5 GiB in BF16 may not fit beside
    its model and optimizer), else pinned host memory; a CPU rank's own memory."""
    if option != "auto":
        return option
    if device.type != "cuda":
        return "device"
    free, _ = torch.cuda.mem_get_info(device)
    return "device" if nbytes <= AUTO_DEVICE_SHARE * free else "host"


@dataclass
class DeltaStats:
    """One step's delta on this rank: messages and payload bytes by form, units changed."""

    version: int = UNKNOWN
    sent_bytes: int = 0  # payloads + headers this rank sent
    dense_bytes: int = 0  # what the same messages weigh dense (without headers)
    units: int = 0  # units compared (delta-capable outgoing messages)
    changed: int = 0
    stale: int = 0  # messages sent dense: their receiver held other bytes (delta/check.py)
    check_bytes: int = 0  # fingerprints this rank sent for the base check (16 a message)
    forms: dict[str, int] = field(default_factory=dict)  # outgoing messages by form
    received: dict[str, int] = field(default_factory=dict)  # incoming messages by form
