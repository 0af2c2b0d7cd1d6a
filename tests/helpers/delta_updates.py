"""Updates that change a small fraction of a policy's weights, as RL steps do at the wire
dtype (delta refit tests of the veRL and vLLM-native routes)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nemo_refit_reshard.spec import ModelSpec
from tests.helpers.checkpoints import random_tensors


def change_some(
    tensors: Mapping[str, torch.Tensor], step: int, seed: int, fraction: float = 0.01
) -> int:
    """In place and deterministically (a generator seeded ``seed + step``, tensors in
    name order): about ``fraction`` of each tensor's elements get ``+ 0.5 .. 1.5`` (in
    float32, then stored in the tensor's dtype: every hit changes, in BF16 too, for
    values of N(0, 1) size); the rest keep their bits. Returns the elements hit."""
    g = torch.Generator().manual_seed(seed + step)
    hits = 0
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            hit = torch.rand(t.shape, generator=g) < fraction
            bump = 0.5 + torch.rand(int(hit.sum()), generator=g)
            t[hit] = (t[hit].float() + bump).to(t.dtype)
            hits += int(hit.sum())
    return hits


def policy_at(spec: ModelSpec, step: int, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The policy after ``step`` updates: :func:`random_tensors` at ``seed`` in ``dtype``,
    then :func:`change_some` for steps ``1..step``."""
    tensors = {n: t.to(dtype) for n, t in random_tensors(spec, seed).items()}
    for s in range(1, step + 1):
        change_some(tensors, s, seed)
    return tensors


def bf16_policy(config: Mapping[str, Any], step: int, seed: int) -> dict[str, torch.Tensor]:
    """:func:`policy_at` in BF16 for an HF ``config.json`` (a Ray actor's call)."""
    from nemo_refit_reshard.spec import spec_from_hf_config

    return policy_at(spec_from_hf_config(dict(config), name="test"), step, seed, torch.bfloat16)


def write_policy_steps(spec: ModelSpec, directory: Path, steps: int, seed: int) -> list[str]:
    """``directory/policy{s}.safetensors`` for ``s`` in ``0..steps-1``: :func:`policy_at`
    in float32 (what an actor hands its checkpoint engine)."""
    from safetensors.torch import save_file

    tensors = policy_at(spec, 0, seed, torch.float32)
    paths = []
    for step in range(steps):
        if step:
            change_some(tensors, step, seed)
        path = directory / f"policy{step}.safetensors"
        save_file(tensors, str(path))
        paths.append(str(path))
    return paths
