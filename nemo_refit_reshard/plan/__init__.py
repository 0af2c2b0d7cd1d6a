"""Layer 3: the static transfer plan (pure Python, no process groups)."""

from .baseline import BroadcastPlan, BroadcastStep, plan_broadcast
from .carry import is_relay, relay_tensor, relayed_to
from .messages import Message
from .overlap import PlanError
from .plan import check_specs_match, plan_refit
from .predict import (
    bandwidth_floor,
    predict_broadcast,
    predict_refit,
    predict_timeline,
    traffic_matrix,
)
from .rank_plan import RankPlan, load_plan_json, rank_plan
from .refit_plan import PLAN_VERSION, PlanStats, RefitPlan
from .topology import Cluster, Placement, Topology
from .transfer import DTYPE_BYTES, Transfer
from .verify import verify_plan

__all__ = [
    "DTYPE_BYTES",
    "PLAN_VERSION",
    "BroadcastPlan",
    "BroadcastStep",
    "Cluster",
    "Message",
    "Placement",
    "PlanError",
    "PlanStats",
    "RankPlan",
    "RefitPlan",
    "Topology",
    "Transfer",
    "bandwidth_floor",
    "check_specs_match",
    "is_relay",
    "load_plan_json",
    "plan_broadcast",
    "plan_refit",
    "predict_broadcast",
    "predict_refit",
    "predict_timeline",
    "rank_plan",
    "relay_tensor",
    "relayed_to",
    "traffic_matrix",
    "verify_plan",
]
