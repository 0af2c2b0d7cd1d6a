"""Block FP8 quantization: the one quantizer every FP8 refit path uses.

For a weight ``x`` of shape ``[m, n]`` and blocks ``(bm, bn)`` (128×128 in every FP8
checkpoint we serve), block ``(i, j)`` is ``x[i·bm:(i+1)·bm, j·bn:(j+1)·bn]`` (the last
row and column of blocks may be partial) and

    amax[i, j]      = max(max |x_block|, 1e-4)           (in float32)
    scale_inv[i, j] = amax[i, j] / 448                    (448: e4m3's largest finite)
    q_block         = round-to-nearest-even-e4m3(x_block · (1 / scale_inv[i, j]))

so ``q_block · scale_inv[i, j]`` dequantizes it, which is what vLLM's block-FP8 linear
layers compute with (``weight``, ``weight_scale_inv``). The arithmetic is exactly that of
the reference vLLM uses in its own tests and DeepGEMM ships
(``per_block_cast_to_fp8`` without UE8M0: multiply by the reciprocal, not divide), so a
refit that quantizes here writes the bytes a checkpoint quantized by that reference
holds. ``amax`` is floored at 1e-4 as there, so an all-zero block gets a finite scale.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from ..plan.result.fp8_steps import QuantizeStep
from ..spec.quantization import cdiv, scale_name

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def quantize_block_fp8(
    x: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)``: ``x`` ``[m, n]`` as e4m3 and its float32 block scales
    ``[ceil(m/bm), ceil(n/bn)]`` (see the module docstring)."""
    if x.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(x.shape)}")
    m, n = x.shape
    bm, bn = block
    rows, cols = cdiv(m, bm), cdiv(n, bn)
    padded = torch.zeros((rows * bm, cols * bn), dtype=x.dtype, device=x.device)
    padded[:m, :n] = x
    blocks = padded.view(rows, bm, cols, bn)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(AMAX_FLOOR)
    scale = amax / E4M3_MAX
    q = (blocks * (1.0 / scale)).to(E4M3)
    return q.view(rows * bm, cols * bn)[:m, :n].contiguous(), scale.view(rows, cols)


def block_scales(x: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """``quantize_block_fp8(x, block)[1]`` without the e4m3 weight: the float32 block
    scales of ``x`` ``[m, n]`` (a sender staging scales apart from their weight)."""
    m, n = x.shape
    bm, bn = block
    rows, cols = cdiv(m, bm), cdiv(n, bn)
    padded = torch.zeros((rows * bm, cols * bn), dtype=x.dtype, device=x.device)
    padded[:m, :n] = x
    amax = padded.view(rows, bm, cols, bn).abs().float().amax(dim=(1, 3)).clamp(AMAX_FLOOR)
    return amax / E4M3_MAX


def quantize_into(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> None:
    """Quantize ``x`` into an engine's live ``weight`` (e4m3) and ``scale_inv`` (float32)
    in place (their storage is what the engine computes with)."""
    q, s = quantize_block_fp8(x, block)
    if q.shape != weight.shape or s.shape != scale_inv.shape:
        raise ValueError(
            f"block FP8 of {tuple(x.shape)} gives weight {tuple(q.shape)} and scales "
            f"{tuple(s.shape)}; the engine holds {tuple(weight.shape)} and "
            f"{tuple(scale_inv.shape)}"
        )
    weight.copy_(q)
    scale_inv.copy_(s)


class Fp8Steps:
    """A rank's block-FP8 quantization around a refit step (``plan/result/fp8_steps.py``).

    Sending (``QuantizeStep.source`` set): :attr:`tensors` holds the derived e4m3 weights
    and scales the program sends from, and :meth:`run` (before the step) fills them
    from the live tensors. Receiving: :attr:`tensors` holds the shadows the program
    receives into in place of the live e4m3 weights, and :meth:`run` (after the step)
    quantizes each shadow into its live weight and scale, in place; a 3-D shadow (fused
    experts, ``[E, rows, cols]``) expert by expert. The derived tensors cost ~0.5× the
    trained bytes a rank sends quantized; the shadows one trained-dtype copy of what a
    rank receives unquantized. Only the gather-broadcast baseline's receivers use it
    (``engine/broadcast.py``); the reshard program quantizes in bounded memory, per run
    into its staging and per band of block rows out of scratch (``fp8_rounds.py``)."""

    def __init__(
        self,
        steps: tuple[QuantizeStep, ...],
        block: tuple[int, int],
        live: Mapping[str, torch.Tensor],
        device: torch.device,
    ) -> None:
        self.block = block
        self.tensors: dict[str, torch.Tensor] = {}
        self._jobs: list[tuple[QuantizeStep, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for q in steps:
            dtype = getattr(torch, q.dtype)  # the trained dtype: bfloat16, float16, float32
            if q.source is not None and q.box is not None:  # a sending rank
                source = live[q.source][q.box.slices()]
                weight = torch.empty(q.shape, dtype=E4M3, device=device)
                scale = torch.empty(_scale_shape(q.shape, block), device=device)
                self.tensors[q.weight], self.tensors[q.scale] = weight, scale
                self._jobs.append((q, source, weight, scale))
            else:
                # NaN until written: a shadow the plan fails to fill shows after the step
                shadow = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
                self.tensors[q.weight] = shadow
                self._jobs.append((q, shadow, live[q.weight], live[q.scale]))

    @torch.no_grad()
    def run(self) -> None:
        for q, x, weight, scale in self._jobs:
            x = x.reshape(weight.shape).to(getattr(torch, q.dtype))  # a view where it can be
            if x.dim() == 2:
                quantize_into(x, weight, scale, self.block)
            else:
                for e in range(x.shape[0]):
                    quantize_into(x[e], weight[e], scale[e], self.block)


def _scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], cdiv(shape[-2], block[0]), cdiv(shape[-1], block[1]))


class QuantizedWeights(Mapping[str, torch.Tensor]):
    """A block-FP8 model's canonical tensors from its trained ones: each e4m3 weight and
    its scale as :func:`quantize_block_fp8` makes them from the whole canonical weight —
    what a checkpoint quantized from the trained weights holds (the truth a refit into
    an FP8 engine is checked against). ``fp8_names``: the spec's e4m3 weights."""

    def __init__(
        self, trained: Mapping[str, torch.Tensor], fp8_names: set[str], block: tuple[int, int]
    ) -> None:
        self.trained, self.block = trained, block
        self.fp8 = fp8_names
        self.scales = {scale_name(n): n for n in fp8_names}
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _quantized(self, weight: str) -> tuple[torch.Tensor, torch.Tensor]:
        if weight not in self._cache:
            self._cache[weight] = quantize_block_fp8(self.trained[weight], self.block)
        return self._cache[weight]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.fp8:
            return self._quantized(name)[0]
        if name in self.scales:
            return self._quantized(self.scales[name])[1]
        return self.trained[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.trained
        yield from self.scales

    def __len__(self) -> int:
        return len(self.trained) + len(self.scales)


__all__ = [
    "E4M3",
    "E4M3_MAX",
    "Fp8Steps",
    "QuantizedWeights",
    "block_scales",
    "quantize_block_fp8",
    "quantize_into",
]
