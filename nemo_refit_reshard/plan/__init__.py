"""Layer 3: the static transfer plan (pure Python, no process groups)."""

from .balance import DTYPE_BYTES, Transfer
from .overlap import PlanError
from .plan import PLAN_VERSION, PlanStats, RefitPlan, check_specs_match, plan_refit
from .schedule import Message

__all__ = [
    "DTYPE_BYTES",
    "PLAN_VERSION",
    "Message",
    "PlanError",
    "PlanStats",
    "RefitPlan",
    "Transfer",
    "check_specs_match",
    "plan_refit",
]
