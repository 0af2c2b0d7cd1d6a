"""Driver-side plan work for the GRPO run: layouts, plans, JSON, pre-flight checks.

The driver builds both plans once from the same layouts the workers' models have
(``TRAINER_LAYOUT_OPTIONS`` for the Megatron side, the generator's dtype for the vLLM
side) and ships JSON only: each worker gets its own reshard slice
(``rank_plan(plan, r).to_json()``) and, for the baseline, the gather-broadcast plan.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import torch

from ..engine.program import TORCH_DTYPES, check_live_tensors
from ..layouts import VllmOptions, refit_layouts
from ..layouts.base import Box, RankLayout
from ..plan import BroadcastPlan, BroadcastStep, PlanError, RefitPlan
from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel, TrainParallel
from .task import policy_spec
from .trainer import TRAINER_LAYOUT_OPTIONS


def build_layouts(
    policy: dict[str, Any], train: TrainParallel, infer: InferParallel, infer_dtype: str
) -> tuple[ModelSpec, list[RankLayout], list[RankLayout]]:
    """The policy's spec (``policy``: its HF config), every training rank's layout and
    every inference rank's."""
    spec = policy_spec(policy)
    vllm = VllmOptions(params_dtype=infer_dtype)
    sources, destinations = refit_layouts(spec, train, infer, TRAINER_LAYOUT_OPTIONS, vllm)
    return spec, sources, destinations


# -- the gather-broadcast baseline as JSON -------------------------------------------------
def broadcast_plan_to_json(plan: BroadcastPlan) -> str:
    def step(st: BroadcastStep) -> dict[str, Any]:
        return {
            "canonical": st.canonical,
            "shape": list(st.shape),
            "dtype": st.dtype,
            "root": st.root,
            "gathers": [[h, name, b.to_json(), c.to_json()] for h, name, b, c in st.gathers],
            "readers": [
                [d, [[name, lb.to_json(), cb.to_json()] for name, lb, cb in pieces]]
                for d, pieces in st.readers
            ],
        }

    return json.dumps(
        {
            "num_sources": plan.num_sources,
            "num_destinations": plan.num_destinations,
            "rounds": [[step(st) for st in steps] for steps in plan.rounds],
        },
        separators=(",", ":"),
    )


def broadcast_plan_from_json(text: str) -> BroadcastPlan:
    data = json.loads(text)

    def step(d: dict[str, Any]) -> BroadcastStep:
        return BroadcastStep(
            d["canonical"],
            tuple(d["shape"]),
            d["dtype"],
            d["root"],
            tuple((h, n, Box.from_json(b), Box.from_json(c)) for h, n, b, c in d["gathers"]),
            tuple(
                (dst, tuple((n, Box.from_json(lb), Box.from_json(cb)) for n, lb, cb in pieces))
                for dst, pieces in d["readers"]
            ),
        )

    return BroadcastPlan(
        data["num_sources"],
        data["num_destinations"],
        tuple(tuple(step(s) for s in steps) for steps in data["rounds"]),
    )


def broadcast_tensor_names(plan: BroadcastPlan, group_rank: int) -> set[str]:
    """The live tensors ``group_rank`` reads or writes in the baseline."""
    s, names = plan.num_sources, set()
    for steps in plan.rounds:
        for st in steps:
            names.update(name for holder, name, _, _ in st.gathers if holder == group_rank)
            for dst, pieces in st.readers:
                if s + dst == group_rank:
                    names.update(name for name, _, _ in pieces)
    return names


# -- pre-flight check of the workers' live tensors -------------------------------------------
def check_worker_tensors(
    plan: RefitPlan,
    broadcast: BroadcastPlan | None,
    group_rank: int,
    described: Mapping[str, Any],
    who: str,
) -> None:
    """Raise ``PlanError`` naming ``who`` if the tensors a worker reported
    (``describe_tensors``) differ from what the plans expect of refit rank ``group_rank``."""
    shapes = {
        name: torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta")
        for name, (shape, dtype) in described.items()
        if dtype in TORCH_DTYPES
    }
    check_live_tensors(plan.expected_tensors(group_rank), shapes, None, who)
    if broadcast is not None:
        missing = sorted(broadcast_tensor_names(broadcast, group_rank) - set(described))
        if missing:
            raise PlanError(
                f"{who}: the broadcast plan uses tensors this worker does not have: {missing}"
            )


# -- test-only: a deliberately broken plan -----------------------------------------------
def without_canonical(plan: RefitPlan, canonical: str) -> RefitPlan:
    """``plan`` minus every transfer of ``canonical`` (a broken refit for tests: the
    destinations keep stale values of that tensor). Stats are left as they were."""
    rounds = []
    found = False
    for msgs in plan.class_rounds:
        kept = []
        for m in msgs:
            transfers = tuple(t for t in m.transfers if t.canonical != canonical)
            found |= len(transfers) != len(m.transfers)
            if transfers:
                kept.append(dataclasses.replace(m, transfers=transfers))
        rounds.append(tuple(kept))
    if not found:
        names = sorted(
            {t.canonical for msgs in plan.class_rounds for m in msgs for t in m.transfers}
        )
        raise PlanError(f"the plan moves no {canonical!r}; choose one of {names}")
    # The fingerprint is derived from the content, so the broken plan gets its own.
    broken = dataclasses.replace(plan, class_rounds=tuple(rounds))
    return broken


def broadcast_without_canonical(plan: BroadcastPlan, canonical: str) -> BroadcastPlan:
    """The baseline minus ``canonical`` (the test-only counterpart of :func:`without_canonical`)."""
    rounds = tuple(tuple(st for st in steps if st.canonical != canonical) for steps in plan.rounds)
    return BroadcastPlan(plan.num_sources, plan.num_destinations, tuple(r for r in rounds if r))
