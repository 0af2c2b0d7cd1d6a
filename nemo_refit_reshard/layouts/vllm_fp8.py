"""vLLM's block-FP8 parameters (``Fp8LinearMethod``, ``Fp8MoEMethod``) on one rank.

With a block-FP8 checkpoint (``spec/quantization.py``) vLLM 0.33 registers, for every
quantized linear layer, ``weight`` as e4m3 (the same rows and columns as the
unquantized weight) and ``weight_scale_inv`` (float32, ``[ceil(rows/bn), ceil(cols/bk)]``
of the local weight); fused MoE layers get ``w13_weight_scale_inv``
(``[E_local, 2·ceil(n/bn), ceil(H/bk)]``) and ``w2_weight_scale_inv``
(``[E_local, ceil(H/bn), ceil(n/bk)]``). Its weight loaders shard a scale exactly as
its weight, in block units: a shard at weight row ``o`` of ``s`` rows is scale rows
``[ceil(o/bn), +ceil(s/bn))``. That is a slice of the canonical scale only where the
shard starts on a block boundary, so this provider requires every TP shard to start
there — vLLM itself refuses split row/column sizes off the block (``Weight
output_partition_size = ... is not divisible by weight quantization block_n``) and
fails to load fused ones. A shard that is the last of its tensor may end inside a block
(DeepSeek-V3's ``kv_a_proj_with_mqa``: 576 rows, 5 scale rows). Fused MoE layers whose
local intermediate size is off the block make vLLM refine the scale grid and upsample
the checkpoint's scales — not a slice: refused.

Where the facts come from: vLLM 0.33 ``layers/quantization/fp8.py``
(``create_weights``), ``utils/fp8_utils.py`` (``validate_fp8_block_shape``,
``create_fp8_scale_parameter``), ``layers/linear.py`` (``adjust_block_scale_shard``),
``fused_moe/oracle/fp8.py`` (``refine_fp8_moe_block_shape``); checked against vLLM's own
FP8 classes in tests/test_vllm_truth.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..spec import ModelSpec
from ..spec.quantization import FP8, SCALE_SUFFIX, cdiv, scale_name
from .base import Box, LayoutBuilder


class Fp8Layout:
    """The FP8 half of a vLLM rank's provider (mixed into ``VllmRankWalker``)."""

    spec: ModelSpec
    b: LayoutBuilder
    dtype: str
    version: str

    def fp8(self, canonical: str) -> bool:
        return canonical in self.spec and self.spec.tensor(canonical).dtype == FP8

    def weight_dtype(self, canonical: str) -> str:
        return FP8 if self.fp8(canonical) else self.dtype

    @property
    def block(self) -> tuple[int, int]:
        q = self.spec.arch.quant
        assert q is not None
        return q.block

    def _refuse(self, name: str, what: str, size: int, block: int) -> ValueError:
        return ValueError(
            f"{name}: {what} {size} is not a multiple of the FP8 block {block}; vLLM "
            f"{self.version} cannot hold this checkpoint at this tensor-parallel size "
            "(choose one whose shards are whole blocks)"
        )

    def scale_rows(
        self,
        weight: str,
        shape: tuple[int, int],
        segments: list[tuple[int, int, str, int]],
        start: int,
        stop: int,
        local_row: int = 0,
        total: int | None = None,
    ) -> None:
        """The scale of a row-fused weight laid out by ``b.rows(weight, segments, start,
        stop, local_row)`` (``shape``: the local weight; ``total``: the fused rows, whose
        last segment may end inside a block). Declares the scale on first use."""
        bn, bk = self.block
        name = scale_name(weight)
        if local_row == 0:
            self.b.tensor(name, (cdiv(shape[0], bn), cdiv(shape[1], bk)), "float32")
        total = stop if total is None else total
        for value, what in ((start, "shard start row"), (local_row, "local row")):
            if value % bn:
                raise self._refuse(weight, what, value, bn)
        if stop != total and (stop - start) % bn:
            raise self._refuse(weight, "rows per rank", stop - start, bn)
        scaled = []
        for fused_row, rows, canonical, canonical_row in segments:
            lo, hi = max(start, fused_row), min(stop, fused_row + rows)
            if lo >= hi:
                continue
            last = fused_row + rows == total
            if fused_row % bn or canonical_row % bn or (not last and rows % bn):
                raise self._refuse(weight, f"{canonical} segment of rows", rows, bn)
            scaled.append(
                (fused_row // bn, cdiv(rows, bn), scale_name(canonical), canonical_row // bn)
            )
        self.b.rows(name, scaled, start // bn, cdiv(stop, bn), local_row // bn)

    def scale_columns(
        self, weight: str, canonical: str, rows: int, n: int, rank: int, tp: int
    ) -> None:
        """The scale of a row-parallel weight over ``tp`` ranks: columns
        ``[rank·n, (rank+1)·n)``."""
        bn, bk = self.block
        if tp > 1 and n % bk:  # vLLM's validate_fp8_block_shape refuses it
            raise self._refuse(weight, "input columns per rank", n, bk)
        name, shape = scale_name(weight), (cdiv(rows, bn), cdiv(n, bk))
        self.b.tensor(name, shape, "float32")
        self.b.piece(
            scale_name(canonical), Box((0, rank * n // bk), shape), name, Box((0, 0), shape)
        )

    def scale_full(self, weight: str, canonical: str, shape: tuple[int, int]) -> None:
        bn, bk = self.block
        name, scale = scale_name(weight), (cdiv(shape[0], bn), cdiv(shape[1], bk))
        self.b.tensor(name, scale, "float32")
        self.b.piece(scale_name(canonical), Box.full(scale), name, Box.full(scale))

    def expert_scales(
        self, module: str, experts: Sequence[str], n: int, lo: int, hidden: int
    ) -> None:
        """``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` of the local experts
        (``experts``: their checkpoint modules, in slot order; SGLang's fused shared expert
        among them): each expert's gate, up and down scales at the block offsets of its
        intermediate slice ``[lo, lo + n)``."""
        bn, bk = self.block
        if n % bn or n % bk:
            raise ValueError(
                f"{module}: {n} intermediate rows per rank is not a multiple of the FP8 "
                f"block {bn}: vLLM {self.version} then refines the experts' scale grid and "
                "upsamples the checkpoint's scales, which this refit does not model; use "
                "expert parallel or a tensor-parallel size whose shards are whole blocks"
            )
        rn, rh, cn, ch = n // bn, cdiv(hidden, bn), n // bk, cdiv(hidden, bk)
        w13, w2 = f"{module}.w13_{SCALE_SUFFIX}", f"{module}.w2_{SCALE_SUFFIX}"
        self.b.tensor(w13, (len(experts), 2 * rn, ch), "float32")
        self.b.tensor(w2, (len(experts), rh, cn), "float32")
        gate_up, down = Box((lo // bn, 0), (rn, ch)), Box((0, lo // bk), (rh, cn))
        for j, hf in enumerate(experts):
            self.b.piece(
                f"{hf}.gate_proj.{SCALE_SUFFIX}", gate_up, w13, Box((j, 0, 0), (1, rn, ch))
            )
            self.b.piece(f"{hf}.up_proj.{SCALE_SUFFIX}", gate_up, w13, Box((j, rn, 0), (1, rn, ch)))
            self.b.piece(f"{hf}.down_proj.{SCALE_SUFFIX}", down, w2, Box((j, 0, 0), (1, rh, cn)))


__all__ = ["Fp8Layout"]
