"""Refit inside real vLLM engines (worker side) and reading a vLLM engine's configuration.

Importing this package does not import vLLM; the worker functions do, inside vLLM's
worker processes.
"""

from .config import (
    IN_PLACE_MOE_BACKENDS,
    EngineLayout,
    UnsupportedVllmOption,
    check_supported,
    engine_layout,
)
from .discarded_weights import refit_delta_stats, refit_forget_weights, watch_weights
from .worker import (
    ReshardWorkerExtension,
    check_moe_backends,
    refit_check_plan,
    refit_close,
    refit_connect_colocated,
    refit_describe,
    refit_join,
    refit_load_plan,
    refit_require_fresh,
    refit_status,
    refit_step,
)

__all__ = [
    "IN_PLACE_MOE_BACKENDS",
    "EngineLayout",
    "ReshardWorkerExtension",
    "UnsupportedVllmOption",
    "check_moe_backends",
    "check_supported",
    "engine_layout",
    "refit_check_plan",
    "refit_close",
    "refit_connect_colocated",
    "refit_delta_stats",
    "refit_describe",
    "refit_forget_weights",
    "refit_join",
    "refit_load_plan",
    "refit_require_fresh",
    "refit_status",
    "refit_step",
    "watch_weights",
]
