"""Refit SGLang's live parameters in place from inside its scheduler processes.

``loader.py``: :func:`refit_loader`, SGLang's custom weight loader (``--custom-weight-
loader``), run in every tensor-parallel rank by ``Engine.update_weights_from_tensor``
with a :func:`refit_command`. ``receiver.py``: what each rank does (join the refit
group, check and load its plan slice, refit in place, rerun SGLang's
``post_load_weights``, close), versioned with ``WeightsState``. ``plugin.py``: SGLang
general plugin whose hook turns an error the loader caught into SGLang's own
``success=False`` answer to the driver. Why this extension
point: docs/sglang.md, "Where the receiver lives and why".
"""

from .loader import LOADER, refit_command, refit_loader
from .receiver import (
    refit_check_plan,
    refit_close,
    refit_describe,
    refit_join,
    refit_load_plan,
    refit_require_fresh,
    refit_status,
    refit_step,
)

__all__ = [
    "LOADER",
    "refit_check_plan",
    "refit_close",
    "refit_command",
    "refit_describe",
    "refit_join",
    "refit_load_plan",
    "refit_loader",
    "refit_require_fresh",
    "refit_status",
    "refit_step",
]
