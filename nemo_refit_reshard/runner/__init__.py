"""The local multi-process runner behind ``demo`` and ``bench``: every training and
inference rank of a refit as a process on this machine, on gloo (or CuPy NCCL)."""

from .config import RunConfig, build_layouts
from .spawn import RunResult, run_local

__all__ = ["RunConfig", "RunResult", "build_layouts", "run_local"]
