"""The refit as SGLang's custom weight loader: SGLang's own extension point, no patch.

An engine started with ``--custom-weight-loader`` |LOADER| (``ServerArgs(
custom_weight_loader=[LOADER])``) calls ``refit_loader(model, named_tensors)`` in every
tensor-parallel rank's scheduler whenever the driver calls
``Engine.update_weights_from_tensor(named_tensors, load_format=LOADER)``
(``WeightUpdater.update_weights_from_tensor``, ``model_runner_components/
weight_updater.py``). The ``named_tensors`` are not weights here but one command:
the name says which receiver operation (``receiver.py``) and the tensor holds its
arguments as UTF-8 JSON (:func:`refit_command`), so the driver reaches every rank
through SGLang's own request path, inside SGLang's ``begin_weight_update`` /
``end_weight_update`` session, after ``pause_generation``.

The loader never raises into SGLang: the scheduler does not catch a loader's exception,
so one would end the scheduler process (and the engine). Instead the error is logged,
kept in the rank's state (``refit_status``) and, for a refit step, the weights stay
marked stale (``WeightsState``) until a later refit succeeds.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import receiver

LOADER = "nemo_refit_reshard.integrations.sglang.loader.refit_loader"
PREFIX = "nemo_refit_reshard."
OPS: dict[str, Callable[..., Any]] = {
    "join": receiver.refit_join,
    "load_plan": receiver.refit_load_plan,
    "step": receiver.refit_step,
    "close": receiver.refit_close,
}

logger = logging.getLogger(__name__)


def refit_command(op: str, **arguments: Any) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` that make every rank run ``op`` with ``arguments``: one
    entry, a uint8 tensor holding the JSON (SGLang ships tensors to every rank)."""
    if op not in OPS:
        raise ValueError(f"unknown refit operation {op!r}; choose from {sorted(OPS)}")
    payload = bytearray(json.dumps(arguments).encode())
    return [(PREFIX + op, torch.frombuffer(payload, dtype=torch.uint8).clone())]


def _decode(name: str, tensor: torch.Tensor) -> tuple[str, dict[str, Any]]:
    op = name.removeprefix(PREFIX)
    if not name.startswith(PREFIX) or op not in OPS:
        raise ValueError(
            f"{name!r} is not a refit command: with load_format={LOADER!r} send "
            "refit_command(...), not weights"
        )
    # numpy's bytes, not tolist(): a plan slice shipped inline can be megabytes
    return op, json.loads(tensor.detach().cpu().contiguous().numpy().tobytes().decode())


def refit_loader(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: run each command on this rank (see module doc)."""
    for name, tensor in named_tensors:
        try:
            op, arguments = _decode(name, tensor)
            result = OPS[op](model, **arguments)
            logger.info("refit %s on tp rank %s: %s", op, receiver.engine_rank(), result)
        except Exception as err:  # noqa: BLE001 - kept for refit_status, never raised
            lines = str(err).strip().splitlines()
            message = f"{name}: {type(err).__name__}: {lines[0] if lines else ''}"
            logger.error("refit failed: %s\n%s", message, traceback.format_exc())
            receiver._state(model).errors.append(message)
