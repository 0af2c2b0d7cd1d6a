"""The local multi-process runner behind ``demo`` and ``bench``: every training and
inference rank of a refit as a process on this machine, on gloo (or CuPy NCCL);
``colocated.py``: the same with each inference rank sharing a training rank's "GPU"."""

from .colocated import run_colocated
from .config import RunConfig, build_layouts
from .spawn import RunResult, run_local

__all__ = ["RunConfig", "RunResult", "build_layouts", "run_colocated", "run_local"]
