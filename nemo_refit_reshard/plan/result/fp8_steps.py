"""The quantization a block-FP8 refit runs around its transfers (``layouts/fp8_wire.py``).

A sending rank, before each step, fills every derived e4m3 tensor it sends from (or
whose scales it sends) from its live tensors; a receiving rank, after each step,
quantizes every shadow it received into its live e4m3 tensor and scales. Both are
:class:`QuantizeStep` s, listed per refit-group rank in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...layouts.base import Box, RankLayout


@dataclass(frozen=True)
class QuantizeStep:
    """``weight`` (e4m3, ``shape``) and ``scale`` (float32 block scales) := block FP8 of
    ``source[box]`` cast to ``dtype`` (a sending rank; both derived, owned by the
    program), or of ``weight``'s ``dtype`` shadow (a receiving rank, ``source`` None; both
    live, the shadow owned by the program)."""

    weight: str
    scale: str
    shape: tuple[int, ...]
    dtype: str
    source: str | None = None
    box: Box | None = None

    def to_json(self) -> list[Any]:
        row: list[Any] = [self.weight, self.scale, list(self.shape), self.dtype]
        if self.source is not None and self.box is not None:
            row += [self.source, self.box.to_json()]
        return row

    @classmethod
    def from_json(cls, row: list[Any]) -> QuantizeStep:
        box = Box.from_json(row[5]) if len(row) > 4 else None
        return cls(row[0], row[1], tuple(row[2]), row[3], row[4] if len(row) > 4 else None, box)


def source_steps(layout: RankLayout, used: set[str]) -> tuple[QuantizeStep, ...]:
    """The quantization a sending rank runs: for each derived weight it sends from, or
    whose scale it sends from."""
    steps = []
    for t in layout.tensors:
        link = t.fp8
        if link is None or link.source is None or link.box is None:
            continue
        if t.name in used or link.scale in used:
            steps.append(
                QuantizeStep(t.name, link.scale, t.shape, link.dtype, link.source, link.box)
            )
    return tuple(steps)


def destination_steps(layout: RankLayout) -> tuple[QuantizeStep, ...]:
    """The quantization a receiving rank runs: one per shadow it receives."""
    return tuple(
        QuantizeStep(t.name, t.fp8.scale, t.shape, t.fp8.dtype)
        for t in layout.tensors
        if t.fp8 is not None and t.fp8.source is None and t.pieces
    )


__all__ = ["QuantizeStep", "destination_steps", "source_steps"]
