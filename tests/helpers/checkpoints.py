"""Random checkpoints for refit tests: seeded canonical tensors, written one file a step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from nemo_refit_reshard.engine.quantize import QuantizedWeights
from nemo_refit_reshard.spec import ModelSpec


def random_tensors(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of ``spec`` drawn from N(0, 1) in float32, from one generator seeded
    ``seed`` in spec order (every element distinct in practice)."""
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec}


def write_steps(
    spec: ModelSpec,
    directory: Path,
    steps: Iterable[int],
    seed: int,
    cast: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[str]:
    """``directory/step{s}.safetensors`` for each ``s`` in ``steps``: the tensors of
    :func:`random_tensors` at ``seed + s``, each passed through ``cast`` if given."""
    from safetensors.torch import save_file

    paths = []
    for step in steps:
        tensors = random_tensors(spec, seed + step)
        if cast is not None:
            tensors = {n: cast(t) for n, t in tensors.items()}
        path = directory / f"step{step}.safetensors"
        save_file(tensors, str(path))
        paths.append(str(path))
    return paths


def write_checkpoints(spec: ModelSpec, work: Path, steps: int) -> list[str]:
    """The start-up checkpoint (``step-1``), then one per refit step, seeds 99, 100, ..."""
    return write_steps(spec, work, range(-1, steps), seed=100)


def fp8_checkpoints(spec: ModelSpec, trained: list[str]) -> list[str]:
    """What vLLM loads for an FP8 engine: each trained checkpoint quantized (e4m3 weights
    and their scales from the bfloat16 weights), the rest in bfloat16."""
    from safetensors.torch import load_file, save_file

    fp8 = {t.name for t in spec if t.dtype == "float8_e4m3fn"}
    assert spec.arch.quant is not None
    out = []
    for path in trained:
        bf16 = {n: t.to(torch.bfloat16) for n, t in load_file(path).items()}
        q = QuantizedWeights(bf16, fp8, spec.arch.quant.block)
        quantized = path.replace(".safetensors", ".fp8.safetensors")
        save_file({t.name: q[t.name].contiguous() for t in spec}, quantized)
        out.append(quantized)
    return out
