"""The refit as SGLang's custom weight loader: SGLang's own extension point, no patch.

An engine started with ``--custom-weight-loader`` |LOADER| (``ServerArgs(
custom_weight_loader=[LOADER])``) calls ``refit_loader(model, named_tensors)`` in every
tensor-parallel rank's scheduler whenever the driver calls
``Engine.update_weights_from_tensor(named_tensors, load_format=LOADER)`` or POSTs
``/update_weights_from_tensor`` (``WeightUpdater.update_weights_from_tensor``,
``model_runner_components/weight_updater.py``). The ``named_tensors`` are not weights
here but one command (:func:`refit_command`): its name says which receiver operation
(``receiver.py``) and carries the arguments as JSON, its tensor is empty. So the driver
reaches every rank through SGLang's own request path, inside SGLang's
``begin_weight_update`` / ``end_weight_update`` session, after ``pause_generation``.

Why the arguments ride in the name: a driver without SGLang installed (NeMo RL's: SGLang
lives in its engines' venv only) serializes the command as SGLang's
``MultiprocessingSerializer`` does, with ``ForkingPickler`` (:func:`serialized_refit_command`).
A non-empty CPU tensor pickles there as a file descriptor, valid on one node while the
sender lives; an empty one pickles inline, and a string passes SGLang's
``SafeUnpickler`` (builtins and tensors only).

The loader never raises into SGLang: the scheduler does not catch a loader's exception,
so one would end the scheduler process (and the engine). Instead the error is logged,
kept in the rank's state (``refit_status``) and, for a refit step, the weights stay
marked stale (``WeightsState``) until a later refit succeeds.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import receiver

LOADER = "nemo_refit_reshard.integrations.sglang.loader.refit_loader"
PREFIX = "nemo_refit_reshard."
SEPARATOR = "?"  # between the operation and its JSON arguments in the command's name
OPS: dict[str, Callable[..., Any]] = {
    "join": receiver.refit_join,
    "connect_colocated": receiver.refit_connect_colocated,
    "load_plan": receiver.refit_load_plan,
    "step": receiver.refit_step,
    "close": receiver.refit_close,
}

logger = logging.getLogger(__name__)


def refit_command(op: str, **arguments: Any) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` that make every rank run ``op`` with ``arguments``: one
    entry named ``nemo_refit_reshard.<op>?<JSON>`` with an empty uint8 tensor."""
    if op not in OPS:
        raise ValueError(f"unknown refit operation {op!r}; choose from {sorted(OPS)}")
    return [(PREFIX + op + SEPARATOR + json.dumps(arguments), torch.empty(0, dtype=torch.uint8))]


def serialized_refit_command(op: str, tp_size: int, **arguments: Any) -> list[str]:
    """``serialized_named_tensors`` of SGLang's ``/update_weights_from_tensor`` for
    :func:`refit_command`: one entry per tensor-parallel rank, each what SGLang's
    ``MultiprocessingSerializer.serialize(..., output_str=True)`` makes (base64 of a
    ``ForkingPickler`` dump), without importing SGLang."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's ForkingPickler reductions

    buf = io.BytesIO()
    ForkingPickler(buf).dump(refit_command(op, **arguments))
    return [base64.b64encode(buf.getvalue()).decode()] * tp_size


def _decode(name: str, tensor: torch.Tensor) -> tuple[str, dict[str, Any]]:
    op, _, text = name.removeprefix(PREFIX).partition(SEPARATOR)
    if not name.startswith(PREFIX) or op not in OPS or tensor.numel():
        raise ValueError(
            f"{name[:80]!r} is not a refit command: with load_format={LOADER!r} send "
            "refit_command(...), not weights"
        )
    return op, json.loads(text) if text else {}


def refit_loader(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: run each command on this rank (see module doc)."""
    for name, tensor in named_tensors:
        try:
            op, arguments = _decode(name, tensor)
            result = OPS[op](model, **arguments)
            logger.info("refit %s on engine rank %s: %s", op, receiver.engine_rank(), result)
        except Exception as err:  # noqa: BLE001 - kept for refit_status, never raised
            lines = str(err).strip().splitlines()
            label = name.partition(SEPARATOR)[0][:80]  # the operation, not its arguments
            message = f"{label}: {type(err).__name__}: {lines[0] if lines else ''}"
            logger.error("refit failed: %s\n%s", message, traceback.format_exc())
            receiver._state(model).errors.append(message)
