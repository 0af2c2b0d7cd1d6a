"""Delta refit: the same compiled rounds, each message sent in its smallest form.

One module an idea: ``program`` (a rank's delta step: versions, rounds, baselines),
``codec`` (a message's changed units and its forms), ``rounds`` (what a step needs of a
compiled program), ``check`` (each delta's base checked against its receiver),
``compiled`` and ``kernels`` (the CPU ranks' numba path), ``stream`` (CPU ranks applying
each message as it arrives), ``options`` (options, stats, versions), ``colocated`` (a
colocated host's two halves). ``docs/delta.md`` tells the whole.
"""

from .options import BASELINE_PLACES, FAILED, UNKNOWN, DeltaError, DeltaOptions, DeltaStats
from .program import DeltaProgram

__all__ = [
    "BASELINE_PLACES", "FAILED", "UNKNOWN", "DeltaError", "DeltaOptions", "DeltaProgram",
    "DeltaStats",
]  # fmt: skip
