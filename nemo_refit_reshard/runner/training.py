"""Real optimizer steps between refits, for delta runs (``demo --delta``, ``bench --delta``).

Megatron keeps BF16 parameters and FP32 master weights; its Adam updates the masters and
casts them back. :class:`AdamTrainedWeights` does the same on the canonical tensors,
lazily per tensor, so that every rank of a local run (each a process) holds the same
weights after the same number of steps without any of them holding the whole model
unless it asks for every tensor::

    master_0 = init_std · N(0, 1)                       (seeded by name, as SyntheticWeights)
    g_t      = N(0, 1)                                  (seeded by name and step)
    m_t = β1·m + (1-β1)·g_t,  v_t = β2·v + (1-β2)·g_t²
    master_t = master_{t-1} - lr · (m_t / (1-β1^t)) / (sqrt(v_t / (1-β2^t)) + ε)
    weight_t = master_t cast to the tensor's dtype

Adam's normalized step is about ``lr`` per element whatever the gradient's scale, so the
fraction of BF16 weights that change per step is about ``lr`` over the spacing of BF16
values near each weight: the sparsity RL refits see (a random gradient stands in for a
policy gradient; ``benchmarks/delta_density.py`` measures a real model's).
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.program import TORCH_DTYPES
from ..spec import ModelSpec

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
INIT_STD = 0.02  # Megatron's init_method_std


class AdamTrainedWeights(Mapping[str, torch.Tensor]):
    """Canonical weights after :attr:`step` Adam steps (module docstring)."""

    def __init__(self, spec: ModelSpec, seed: int = 0, lr: float = 1e-6) -> None:
        self.spec, self.seed, self.lr = spec, seed, lr
        self.step = 0
        self._state: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}
        self._weights: dict[str, torch.Tensor] = {}

    def _salt(self, name: str) -> int:
        return self.seed * 1_000_003 + zlib.crc32(name.encode())

    def _normal(self, name: str, step: int) -> torch.Tensor:
        shape = self.spec.tensor(name).shape
        g = torch.Generator().manual_seed(self._salt(name) * 7919 + step)
        return torch.randn(shape, generator=g)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._state:
            master = INIT_STD * self._normal(name, 0)
            self._state[name] = (master, torch.zeros_like(master), torch.zeros_like(master), 0)
        master, m, v, done = self._state[name]
        for t in range(done + 1, self.step + 1):  # catch this tensor up, one step at a time
            g = self._normal(name, t)
            m.mul_(BETA1).add_(g, alpha=1 - BETA1)
            v.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)
            denom = (v / (1 - BETA2**t)).sqrt_().add_(EPS)
            master.addcdiv_(m, denom, value=-self.lr / (1 - BETA1**t))
        if done != self.step or name not in self._weights:
            self._state[name] = (master, m, v, self.step)
            self._weights[name] = master.to(TORCH_DTYPES[self.spec.tensor(name).dtype])
        return self._weights[name]

    def advance(self) -> None:
        """One more optimizer step (applied to each tensor when next read)."""
        self.step += 1

    def __iter__(self) -> Iterator[str]:
        return (t.name for t in self.spec)

    def __len__(self) -> int:
        return len(self.spec)


def write_trajectory(weights: AdamTrainedWeights, steps: int, folder: str) -> None:
    """Write the canonical weights after 0..``steps`` Adam steps, one raw file per tensor
    and step, for every rank of a local run to map (:class:`TrajectoryWeights`): the
    driver runs the optimizer once, and no rank holds its state (a 246M model's masters
    and moments are 12 bytes a parameter: more than a 2-core machine's memory over 12
    ranks)."""
    for step in range(steps + 1):
        out = Path(folder, str(step))
        out.mkdir(parents=True, exist_ok=True)
        for name in weights:
            weights[name].contiguous().view(torch.uint8).numpy().tofile(out / name)
        weights.advance()


class TrajectoryWeights(Mapping[str, torch.Tensor]):
    """The canonical weights after :attr:`step` optimizer steps, mapped from the files
    :func:`write_trajectory` wrote (read-only pages the ranks share)."""

    def __init__(self, spec: ModelSpec, folder: str) -> None:
        self.spec, self.folder, self.step = spec, folder, 0
        self._mapped: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._mapped:
            t = self.spec.tensor(name)
            path = Path(self.folder, str(self.step), name)
            raw = np.memmap(path, dtype=np.uint8, mode="r")
            with warnings.catch_warnings():  # read-only pages, never written through
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(raw)
            self._mapped[name] = tensor.view(TORCH_DTYPES[t.dtype]).view(t.shape)
        return self._mapped[name]

    def advance(self) -> None:
        self.step += 1
        self._mapped.clear()

    def __iter__(self) -> Iterator[str]:
        return (t.name for t in self.spec)

    def __len__(self) -> int:
        return len(self.spec)


def refill(layout, tensors: Mapping[str, torch.Tensor], canonical: Mapping[str, torch.Tensor]):
    """Copy every piece of ``layout`` from ``canonical`` into the rank's live ``tensors``
    in place (a training rank after its optimizer step)."""
    from ..layouts.fp8_wire import live_layout

    for t in live_layout(layout).tensors:
        local = tensors[t.name]
        for p in t.pieces:
            src = canonical[p.canonical][p.canonical_box.slices()]
            local[p.local_box.slices()] = src.reshape(p.local_box.sizes).to(local)


def delta_figures(stats: Any, baseline_bytes: int) -> dict[str, Any]:
    """A rank's delta figures of one step (``engine.delta.DeltaStats``), as reported."""
    return {
        "version": stats.version,
        "sent_bytes": stats.sent_bytes,
        "dense_bytes": stats.dense_bytes,
        "units": stats.units,
        "changed": stats.changed,
        "forms": stats.forms,
        "stale": stats.stale,  # messages sent dense: their receiver held other bytes
        "check_bytes": stats.check_bytes,  # fingerprints sent for the base check
        "baseline_bytes": baseline_bytes,
    }
