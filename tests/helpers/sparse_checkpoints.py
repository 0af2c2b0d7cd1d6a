"""Checkpoints that change a little each step, as RL updates do (delta refit tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from nemo_refit_reshard.spec import ModelSpec
from tests.helpers.checkpoints import random_tensors


def write_sparse_steps(
    spec: ModelSpec, directory: Path, steps: int, seed: int, fraction: float
) -> list[str]:
    """``directory/step{s}.safetensors`` for ``s`` in ``0..steps``: step 0 is
    :func:`~tests.helpers.checkpoints.random_tensors` at ``seed``; step ``s`` is step
    ``s - 1`` with about ``fraction`` of each tensor's elements (drawn from a generator
    seeded ``seed + s``) given new values, the rest bit for bit as they were."""
    from safetensors.torch import save_file

    tensors = random_tensors(spec, seed)
    paths = []
    for step in range(steps + 1):
        if step:
            g = torch.Generator().manual_seed(seed + step)
            for t in tensors.values():
                hit = torch.rand(t.shape, generator=g) < fraction
                t[hit] += 0.5 + torch.rand(int(hit.sum()), generator=g)  # always a new value
        path = directory / f"step{step}.safetensors"
        save_file(tensors, str(path))
        paths.append(str(path))
    return paths
