"""How a generation engine's ranks receive their plan: the text of one rank's slice."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ...plan import PlanError


def plan_text(plan: str | Mapping[str, str], group_rank: int, where: str = "worker") -> str:
    """The plan JSON for refit rank ``group_rank`` from what the driver shipped to every
    rank of an engine: JSON text; a path (``{rank}`` is replaced by the refit rank, so
    each rank reads only its slice); or a mapping from refit rank (as a string) to JSON
    text. ``where`` names the rank in errors (``worker``, ``rank``)."""
    if isinstance(plan, Mapping):
        if str(group_rank) not in plan:
            raise PlanError(
                f"the plan slices shipped to this engine are for refit ranks "
                f"{sorted(plan, key=int)}, not for this {where}'s refit rank {group_rank}"
            )
        return plan[str(group_rank)]
    if plan.strip().startswith("{"):
        return plan
    path = plan.format(rank=group_rank)
    if not os.path.exists(path):
        raise FileNotFoundError(f"refit plan file {path!r} does not exist on this {where}")
    with open(path) as f:
        return f.read()
