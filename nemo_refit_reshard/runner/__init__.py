"""The local multi-process runner behind ``demo`` and ``bench``: every training and
inference rank of a refit as a process on this machine, on gloo (or CuPy NCCL);
``colocated.py``: the same with each inference rank sharing a training rank's "GPU"."""

from typing import Any

from .config import RunConfig, build_layouts

# The process runners load torch and its distributed package; the planning commands
# need only ``build_layouts``, so the runners are imported on first use.
_RUNNERS = {"run_colocated": ".colocated", "RunResult": ".spawn", "run_local": ".spawn"}


def __getattr__(name: str) -> Any:
    if name in _RUNNERS:
        import importlib

        return getattr(importlib.import_module(_RUNNERS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RunConfig", "RunResult", "build_layouts", "run_colocated", "run_local"]
