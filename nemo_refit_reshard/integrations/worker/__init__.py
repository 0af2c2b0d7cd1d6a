"""The framework-neutral worker API: what a training or generation worker calls to refit.

``endpoint.py``: :class:`RefitEndpoint`, where and as whom a worker joins the refit
group. ``refit_worker.py``: :class:`RefitWorker`, one worker's membership (join, load a
plan, refit). ``weights.py``: :class:`WeightsState`, whether a rank's weights are whole
or stale. ``colocated.py``: :class:`ColocatedTrainer` and :class:`ColocatedWorker`, the
same for a training rank and the generation worker sharing its GPU; ``device.py``:
:func:`device_name`, which GPU a worker is on (to pair them); ``plan_text.py``:
:func:`plan_text`, a generation rank's slice of the plan shipped to its engine;
``engine_rank.py``: :class:`EngineRankState`, what a generation engine's rank keeps between
refit calls (the vLLM and SGLang receivers share it). Nothing here knows Megatron, vLLM or
Ray.
"""

from .colocated import ColocatedTrainer, ColocatedWorker
from .device import DEVICE_ENV, device_name
from .endpoint import TRANSPORTS, RefitEndpoint
from .engine_rank import EngineRankState
from .plan_text import plan_text
from .refit_worker import RefitWorker, describe_tensors
from .weights import StaleWeightsError, WeightsState

__all__ = [
    "DEVICE_ENV",
    "TRANSPORTS",
    "ColocatedTrainer",
    "ColocatedWorker",
    "EngineRankState",
    "RefitEndpoint",
    "RefitWorker",
    "StaleWeightsError",
    "WeightsState",
    "describe_tensors",
    "device_name",
    "plan_text",
]
