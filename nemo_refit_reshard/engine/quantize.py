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

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_block_fp8(
    x: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)``: ``x`` ``[m, n]`` as e4m3 and its float32 block scales
    ``[ceil(m/bm), ceil(n/bn)]`` (see the module docstring)."""
    if x.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(x.shape)}")
    m, n = x.shape
    bm, bn = block
    rows, cols = _cdiv(m, bm), _cdiv(n, bn)
    padded = torch.zeros((rows * bm, cols * bn), dtype=x.dtype, device=x.device)
    padded[:m, :n] = x
    blocks = padded.view(rows, bm, cols, bn)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(AMAX_FLOOR)
    scale = amax / E4M3_MAX
    q = (blocks * (1.0 / scale)).to(E4M3)
    return q.view(rows * bm, cols * bn)[:m, :n].contiguous(), scale.view(rows, cols)


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


__all__ = ["E4M3", "E4M3_MAX", "quantize_block_fp8", "quantize_into"]
