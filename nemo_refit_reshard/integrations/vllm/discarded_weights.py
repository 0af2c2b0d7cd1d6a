"""Delta refit and a vLLM worker that loses its weights: it forgets its refit version, so
that its next refit sends it every message whole.

A delta re-packs each message's last content from the receiver's live weights
(``engine/delta/program.py``); weights discarded since — vLLM's sleep mode level 2, a selective
``discard`` of the weights, a reload from the checkpoint, a reset — would be patched
into garbage. vLLM 0.33 tells neither a ``worker_extension_cls`` nor a weight-transfer
engine when its worker sleeps, wakes or reloads: ``Worker.sleep`` / ``wake_up`` /
``discard`` / ``reload_weights`` / ``reset_weights`` call no hook (and the CPU worker's
sleep and wake do nothing). So, two ways in:

* :func:`refit_forget_weights`, a ``collective_rpc`` callable (and the extension's
  method of that name): the driver calls it after a level-2 wake or a reload;
* :func:`watch_weights`, run by ``ReshardWorkerExtension.init_worker_extension`` (the
  one hook vLLM calls, once per worker, after device init): it wraps *this worker's*
  ``sleep`` / ``discard`` / ``reload_weights`` / ``reset_weights`` (on the instance; the
  class is untouched) so that each call that loses the weights forgets first. vLLM
  dispatches them by name (``collective_rpc("sleep", ...)``), so the wrapper runs.

Both reach the refit of the worker-function route (``worker.py``) and of the
``reshard`` weight-transfer engine (``worker.weight_transfer_engine``). A colocated
worker needs neither: its host holds every message and sends its staging whole.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

_WATCHED = "_nemo_refit_reshard_watched"
# The attribute under which worker.py keeps a vLLM worker's refit state (defined here, so
# that this module needs nothing of worker.py, which imports it).
STATE_ATTR = "_nemo_refit_reshard"


def _refit_workers(worker: Any) -> list[Any]:
    """The RefitWorkers of this vLLM worker: its own (``worker.py`` functions) and its
    ``reshard`` weight-transfer engine's (which runs the same functions on itself)."""
    holders = [worker, getattr(worker, "weight_transfer_engine", None)]
    states = [getattr(h, STATE_ATTR, None) for h in holders if h is not None]
    return [s.refit for s in states if s is not None and s.refit is not None]


def refit_forget_weights(worker: Any) -> int:
    """This worker's weights no longer hold the last refit (woken from sleep level 2,
    reloaded, reset): its next refit is dense (``RefitWorker.forget_version``). Returns
    how many refit memberships forgot (0: none joined yet, nothing to forget)."""
    refits = _refit_workers(worker)
    for refit in refits:
        refit.forget_version()
    return len(refits)


def refit_delta_stats(worker: Any) -> dict[str, Any] | None:
    """This worker's last delta refit (``DeltaStats`` fields: ``version``, ``received``
    forms, ...), None without a delta refit."""
    for refit in _refit_workers(worker):
        if refit.refitter is not None and refit.refitter.delta is not None:
            return dataclasses.asdict(refit.refitter.delta.last)
    return None


def _sleep_discards(*args: Any, **kwargs: Any) -> bool:
    level = kwargs.get("level", args[0] if args else 1)
    return int(level) >= 2  # level 1 offloads the weights and restores them at wake


def _discard_hits_weights(*args: Any, **kwargs: Any) -> bool:
    tags = kwargs.get("tags", args[0] if args else ())
    return "weights" in ((tags,) if isinstance(tags, str) else tuple(tags))


# vLLM Worker methods that lose the weights, and when.
LOSES_WEIGHTS: dict[str, Callable[..., bool]] = {
    "sleep": _sleep_discards,
    "discard": _discard_hits_weights,
    "reload_weights": lambda *a, **k: True,
    "reset_weights": lambda *a, **k: True,
}


def watch_weights(worker: Any) -> list[str]:
    """Wrap this worker's methods of :data:`LOSES_WEIGHTS` so that a call that loses the
    weights forgets the refit version first (then runs vLLM's method as it was; a
    forgotten version only costs one dense refit). Idempotent; returns the names
    wrapped."""
    if getattr(worker, _WATCHED, None) is not None:
        return list(getattr(worker, _WATCHED))
    wrapped = []
    for name, loses in LOSES_WEIGHTS.items():
        original = getattr(worker, name, None)
        if not callable(original):
            continue

        def call(*args: Any, _original=original, _loses=loses, **kwargs: Any) -> Any:
            if _loses(*args, **kwargs):
                refit_forget_weights(worker)
            return _original(*args, **kwargs)

        setattr(worker, name, functools.wraps(original)(call))
        wrapped.append(name)
    setattr(worker, _WATCHED, tuple(wrapped))
    return wrapped


__all__ = ["LOSES_WEIGHTS", "refit_delta_stats", "refit_forget_weights", "watch_weights"]
