"""An inference rank's tensors in a local run: what the refit writes, what is checked.

For an unquantized engine both are the rank's layout, filled with NaN. For a block-FP8
engine the refit writes its e4m3 weights and scales — quantized by the training ranks,
or received as trained-dtype shadows and quantized by the rank's program
(``layouts/fp8_wire.py``, ``engine/quantize.Fp8Steps``); the check is then of the FP8
tensors against the whole canonical weights quantized by the same quantizer
(``QuantizedWeights``): a block cut at a shard boundary would show.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.materialize import materialize, mismatches
from ..engine.quantize import QuantizedWeights
from ..layouts import RankLayout
from ..spec import ModelSpec
from .config import RunConfig, fp8_destinations


@dataclass
class DestinationTensors:
    layout: RankLayout  # the rank's own layout (FP8 for an FP8 engine)
    live: dict[str, torch.Tensor]  # the rank's tensors, checked after a refit
    truth: Mapping[str, torch.Tensor]  # canonical tensors they must hold

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """What the refit writes."""
        return self.live

    def poison(self) -> None:
        """NaN everywhere a refit must write (before a step)."""
        for t in self.live.values():
            t.fill_(float("nan"))

    def retrain(self, trained: Mapping[str, Any]) -> None:
        """The truth after an optimizer step: ``trained``'s weights (quantized again for
        an FP8 engine); the live tensors keep what they hold."""
        if isinstance(self.truth, QuantizedWeights):
            self.truth = QuantizedWeights(trained, self.truth.fp8, self.truth.block)
        else:
            self.truth = trained

    def mismatches(self) -> list[str]:
        return mismatches(self.layout, self.live, self.truth)


def destination_tensors(
    cfg: RunConfig,
    spec: ModelSpec,
    layout: RankLayout,
    index: int,
    trained: Mapping[str, Any],
    device: torch.device,
) -> DestinationTensors:
    """Inference rank ``index``'s tensors; ``layout``: its planned (wire) layout;
    ``trained``: the canonical trained weights."""
    quant = spec.arch.quant
    if quant is None:
        return DestinationTensors(
            layout, materialize(layout, trained, fill=float("nan"), device=device), trained
        )
    own = fp8_destinations(cfg)[index]
    fp8 = {t.name for t in spec if t.dtype == "float8_e4m3fn"}
    truth = QuantizedWeights(trained, fp8, quant.block)
    live = materialize(own, truth, fill=float("nan"), device=device)
    return DestinationTensors(own, live, truth)


__all__ = ["DestinationTensors", "destination_tensors"]
