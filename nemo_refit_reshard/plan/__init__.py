"""Layer 3: the static transfer plan (pure Python, no process groups)."""

from .messages import Message
from .overlap import PlanError
from .plan import check_specs_match, plan_refit
from .refit_plan import PLAN_VERSION, PlanStats, RefitPlan
from .transfer import DTYPE_BYTES, Transfer

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
