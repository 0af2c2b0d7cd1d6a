"""Layer 3: the static transfer plan (pure Python, no process groups).

The tree follows the planner (``build.py``'s ``plan_refit`` calls the passes in order):

* shared by every pass: ``base.py`` (:class:`Transfer`, dtype sizes, box cutting, the
  order of transfers in a message, :class:`PlanError`, relay-buffer names),
  ``cluster.py`` (:class:`Cluster`, :class:`Placement`, :class:`Topology`, NVLink
  domains, the round-time formula), ``colocation.py`` (:class:`Colocation`: which
  training rank shares each inference rank's GPU), ``config.py`` (:class:`PlanConfig`);
* the passes: ``pass1_needs.py``, ``pass2_fanout.py``, ``pass3_senders.py``,
  ``pass4_routes/`` (chain, domain, carry), ``pass5_rounds/`` (first-fit, timed:
  pair loads, fills, budget), ``pass6_messages.py``, ``pass7_assemble.py``; and
  ``relay_choice.py``, which runs passes 2-5 per candidate for ``relay="auto"``;
* the plan as built: ``result/`` (:class:`RefitPlan` and its stats, its expansion to
  every rank, JSON, one rank's share :class:`RankPlan`);
* about plans: ``analysis/`` (predicted time, the bandwidth floor, the gather-broadcast
  baseline and its prediction, an independent check of a plan).
"""

from .analysis.baseline import (
    BroadcastPlan,
    BroadcastPrediction,
    BroadcastStep,
    plan_broadcast,
    predict_broadcast,
    predict_broadcast_layouts,
)
from .analysis.floor import Floor, FloorTerm, bandwidth_floor
from .analysis.predict import Prediction, predict_refit, predict_timeline, traffic_matrix
from .analysis.verify import verify_plan
from .base import DTYPE_BYTES, PlanError, Transfer, is_relay, relay_tensor, relayed_to
from .build import check_specs_match, plan_refit, plan_with
from .cluster import Cluster, LinkModel, Placement, Topology
from .colocation import ColocatedBytes, Colocation, colocated_bytes
from .config import RELAY_CHOICES, RELAY_MODES, PlanConfig
from .pass6_messages import Message
from .relay_choice import RelayChoice
from .result.fp8_steps import QuantizeStep
from .result.rank_share import RankPlan, load_plan_json, rank_plan
from .result.refit_plan import PLAN_VERSION, PlanStats, RefitPlan

__all__ = [
    "DTYPE_BYTES",
    "PLAN_VERSION",
    "RELAY_CHOICES",
    "RELAY_MODES",
    "BroadcastPlan",
    "BroadcastPrediction",
    "BroadcastStep",
    "Cluster",
    "ColocatedBytes",
    "Colocation",
    "Floor",
    "FloorTerm",
    "LinkModel",
    "Message",
    "Placement",
    "PlanConfig",
    "PlanError",
    "PlanStats",
    "Prediction",
    "RankPlan",
    "RefitPlan",
    "RelayChoice",
    "Topology",
    "Transfer",
    "bandwidth_floor",
    "check_specs_match",
    "colocated_bytes",
    "is_relay",
    "load_plan_json",
    "plan_broadcast",
    "plan_refit",
    "plan_with",
    "predict_broadcast",
    "predict_broadcast_layouts",
    "predict_refit",
    "predict_timeline",
    "rank_plan",
    "QuantizeStep",
    "relay_tensor",
    "relayed_to",
    "traffic_matrix",
    "verify_plan",
]
