"""A rank's share of a plan: what one worker needs, without the rest of the plan.

A full plan lists every message of every rank; at frontier scale that is
gigabytes. ``RankPlan`` keeps only the messages one refit-group rank sends or
receives and the live tensors it must hold, plus the full plan's fingerprint
(which every rank still compares before the first refit). The driver builds
the plan once and ships each worker its slice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...layouts.base import Box
from ..base import PlanError
from ..pass6_messages import Message
from .fp8_steps import QuantizeStep
from .refit_plan import PLAN_VERSION, RefitPlan
from .serialize import NameTable, message_from_json, message_json


@dataclass(frozen=True)
class RankPlan:
    """One refit-group rank's messages and expected live tensors."""

    fingerprint: str  # of the full plan this slice was cut from
    group_rank: int
    num_sources: int
    num_destinations: int
    num_rounds: int
    tensors: dict[str, tuple[tuple[int, ...], str]]  # live name -> (shape, dtype)
    messages: tuple[Message, ...]
    colocated_hosts: tuple[int, ...] = ()  # the full plan's (plan/colocation.py)
    fp8_block: tuple[int, int] | None = None  # the full plan's (fp8_steps.py)
    quantize: tuple[QuantizeStep, ...] = ()  # this rank's block-FP8 quantization

    def quantize_steps_of(self, group_rank: int) -> tuple[QuantizeStep, ...]:
        self._check(group_rank)
        return self.quantize

    def expected_tensors(self, group_rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
        self._check(group_rank)
        return self.tensors

    def messages_of(self, group_rank: int) -> list[Message]:
        self._check(group_rank)
        return list(self.messages)

    def _check(self, group_rank: int) -> None:
        if group_rank != self.group_rank:
            raise PlanError(
                f"this plan slice is for refit rank {self.group_rank}, not {group_rank}; "
                "ship each worker its own slice"
            )

    def to_json(self) -> str:
        names = NameTable()
        messages = [[m.round, message_json(m, names)] for m in self.messages]
        return json.dumps(
            {
                "version": PLAN_VERSION,
                "slice_of": self.fingerprint,
                "group_rank": self.group_rank,
                "num_sources": self.num_sources,
                "num_destinations": self.num_destinations,
                "num_rounds": self.num_rounds,
                "tensors": {k: [list(s), d] for k, (s, d) in sorted(self.tensors.items())},
                "names": names.names,
                "messages": messages,
                **({"colocated_hosts": list(self.colocated_hosts)} if self.colocated_hosts else {}),
                **(
                    {
                        "fp8_block": list(self.fp8_block),
                        "quantize": [q.to_json() for q in self.quantize],
                    }
                    if self.fp8_block is not None
                    else {}
                ),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> RankPlan:
        data: dict[str, Any] = json.loads(text)
        boxes: dict[tuple, Box] = {}
        if data.get("version") != PLAN_VERSION or "slice_of" not in data:
            raise PlanError("not a plan slice of this version; rebuild it with this version")
        return cls(
            fingerprint=data["slice_of"],
            group_rank=data["group_rank"],
            num_sources=data["num_sources"],
            num_destinations=data["num_destinations"],
            num_rounds=data["num_rounds"],
            tensors={k: (tuple(s), d) for k, (s, d) in data["tensors"].items()},
            messages=tuple(
                message_from_json(r, m, data["names"], boxes) for r, m in data["messages"]
            ),
            colocated_hosts=tuple(data.get("colocated_hosts", ())),
            fp8_block=tuple(data["fp8_block"]) if "fp8_block" in data else None,  # type: ignore[arg-type]
            quantize=tuple(QuantizeStep.from_json(q) for q in data.get("quantize", ())),
        )


def rank_plan(plan: RefitPlan, group_rank: int) -> RankPlan:
    """Cut ``group_rank``'s share out of ``plan``."""
    return RankPlan(
        fingerprint=plan.fingerprint,
        group_rank=group_rank,
        num_sources=plan.num_sources,
        num_destinations=plan.num_destinations,
        num_rounds=plan.num_rounds,
        tensors=dict(plan.expected_tensors(group_rank)),
        messages=tuple(plan.messages_of(group_rank)),
        colocated_hosts=plan.colocated_hosts,
        fp8_block=plan.fp8_block,
        quantize=plan.quantize_steps_of(group_rank),
    )


def load_plan_json(text: str) -> RefitPlan | RankPlan:
    """A full plan or a rank's slice, whichever ``text`` holds."""
    return RankPlan.from_json(text) if '"slice_of"' in text[:200] else RefitPlan.from_json(text)
