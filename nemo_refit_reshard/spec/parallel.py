"""Parallelism specs for both sides, one grammar: ``key=value,key=value``.

Training (Megatron-core rules)::

    tp, pp, vpp, cp, dp, ep, etp        world = tp·pp·cp·dp
                                        expert grid etp·ep·edp = tp·cp·dp (per stage)
                                        etp defaults to tp

Inference (vLLM rules)::

    tp, pp, dp, engine_dp, ep           dp: independent engines (replicas), each
                                        holding the whole model;
                                        engine_dp: vLLM ``data_parallel_size``
                                        inside one engine (attention replicated,
                                        experts sharded over engine_dp·tp ranks);
                                        ep: 1, or engine_dp·tp when vLLM's
                                        ``enable_expert_parallel`` is on.

Omitted keys default to 1. Every rule violation is a ``ValueError`` that names
the rule and a value that would satisfy it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

TRAIN_KEYS = ("tp", "pp", "vpp", "cp", "dp", "ep", "etp")
INFER_KEYS = ("tp", "pp", "dp", "engine_dp", "ep")


def parse_parallel_string(text: str, allowed: tuple[str, ...], side: str) -> dict[str, int]:
    """``"tp=2,pp=2"`` -> ``{"tp": 2, "pp": 2}`` with key and value checks."""
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"{side} parallelism item {item!r} is not key=value")
        if key not in allowed:
            raise ValueError(
                f"unknown {side} parallelism key {key!r}; allowed: {', '.join(allowed)}"
            )
        if key in out:
            raise ValueError(f"{side} parallelism key {key!r} given twice")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{side} parallelism {key}={value!r} is not an integer") from None
        if number < 1:
            raise ValueError(f"{side} parallelism {key}={number} must be >= 1")
        out[key] = number
    return out


def _format(obj: object) -> str:
    return ",".join(f"{f.name}={getattr(obj, f.name)}" for f in fields(obj))  # type: ignore[arg-type]


@dataclass(frozen=True)
class TrainParallel:
    """Megatron-core parallel sizes. ``etp=None`` means "same as tp"."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"training parallelism {f.name}={v!r} must be an integer >= 1")
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        dense = self.tp * self.cp * self.dp
        expert = self.expert_tp * self.ep
        if dense % expert:
            # Smallest dp that makes tp·cp·dp a multiple of etp·ep.
            need = expert // math.gcd(self.tp * self.cp, expert)
            raise ValueError(
                f"training parallelism breaks Megatron's rule etp·ep·edp = tp·cp·dp: "
                f"etp·ep = {self.expert_tp}·{self.ep} = {expert} does not divide "
                f"tp·cp·dp = {self.tp}·{self.cp}·{self.dp} = {dense}; "
                f"ep={self.ep} needs dp to be a multiple of {need} (e.g. dp={need})"
            )
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("training parallelism vpp>1 needs pp>1 (virtual pipeline stages)")

    @property
    def expert_tp(self) -> int:
        assert self.etp is not None
        return self.etp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: tp·cp·dp / (etp·ep)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @classmethod
    def parse(cls, text: str) -> TrainParallel:
        return cls(**parse_parallel_string(text, TRAIN_KEYS, "training"))

    def __str__(self) -> str:
        return _format(self)


@dataclass(frozen=True)
class InferParallel:
    """vLLM parallel sizes for ``dp`` independent engines of ``engine_dp·pp·tp`` ranks each."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    engine_dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"inference parallelism {f.name}={v!r} must be an integer >= 1")
        moe_ranks = self.engine_dp * self.tp
        if self.ep not in (1, moe_ranks):
            raise ValueError(
                f"inference parallelism ep={self.ep} is not possible in vLLM: with "
                f"enable_expert_parallel the expert-parallel size is engine_dp·tp = "
                f"{self.engine_dp}·{self.tp} = {moe_ranks}; use ep={moe_ranks} or ep=1"
            )

    @property
    def expert_parallel(self) -> bool:
        return self.ep > 1

    @property
    def moe_size(self) -> int:
        """Ranks one stage's experts are spread over: engine_dp·tp."""
        return self.engine_dp * self.tp

    @property
    def engine_world_size(self) -> int:
        return self.engine_dp * self.pp * self.tp

    @property
    def world_size(self) -> int:
        return self.dp * self.engine_world_size

    @classmethod
    def parse(cls, text: str) -> InferParallel:
        return cls(**parse_parallel_string(text, INFER_KEYS, "inference"))

    def __str__(self) -> str:
        return _format(self)
