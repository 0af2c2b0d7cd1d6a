"""Is the installed vLLM's weight-transfer API the one our engines are written against?

Our ``reshard`` engines subclass vLLM's ``WeightTransferEngine`` and
``TrainerWeightTransferEngine`` and drive the ``VLLMWeightSyncClient`` protocol. Those
are young interfaces that vLLM changes between releases; a signature that moved would
otherwise surface as a ``TypeError`` deep inside a refit (or, worse, as an argument
silently taken for another). So :func:`api_problems` compares the parameter lists of
every method we override or call with the ones of the release we test
(:data:`SUPPORTED_VLLM`), and the plugin refuses the backend by name when they differ.

A parameter list is compared as its names, kinds (positional, keyword-only, ...) and
whether it has a default; annotations and default values are not compared (they change
for reasons that do not matter to a caller).
"""

from __future__ import annotations

import inspect
from types import ModuleType

SUPPORTED_VLLM = "0.33"  # the releases whose weight-transfer API we are tested against
SUPPORTED_RANGE = "vllm>=0.33,<0.34"  # the `.[vllm]` extra

# "Class.method" -> its parameters as vLLM 0.33 declares them (``self``/``cls`` left out).
EXPECTED: dict[str, str] = {
    "WeightTransferEngine.__init__": "(config, vllm_config, device, model)",
    "WeightTransferEngine.init_transfer_engine": "(init_info)",
    "WeightTransferEngine.start_weight_update": "()",
    "WeightTransferEngine.update_weights": "(update_info)",
    "WeightTransferEngine.receive_weights": "(update_info)",
    "WeightTransferEngine.finish_weight_update": "()",
    "WeightTransferEngine.shutdown": "()",
    "TrainerWeightTransferEngine.__init__": "(*, client, source=…, is_sender=…, rank=…)",
    "TrainerWeightTransferEngine.trainer_init": "(init_info, *, client, source=…)",
    "TrainerWeightTransferEngine.send_weights": "()",
    "VLLMWeightSyncClient.init_weight_transfer_engine": "(init_info)",
    "VLLMWeightSyncClient.start_weight_update": "()",
    "VLLMWeightSyncClient.update_weights": "(update_info)",
    "VLLMWeightSyncClient.finish_weight_update": "(weight_version=…)",
}


def parameters_text(func: object) -> str:
    """``func``'s parameters as ``(a, b=…, *, c)``: names, kinds and "has a default"."""
    params = list(inspect.signature(func).parameters.values())  # type: ignore[arg-type]
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    out: list[str] = []
    star = False
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
            continue
        if p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(p.name + ("=…" if p.default is not p.empty else ""))
    return "(" + ", ".join(out) + ")"


def api_problems(base: ModuleType) -> list[str]:
    """Each method of ``base`` (vLLM's ``vllm.distributed.weight_transfer.base``) whose
    parameters differ from :data:`EXPECTED`, as ``"Class.method(found) (expected
    (...))"``; empty when the API is the one we are written against."""
    problems: list[str] = []
    for qualified, expected in EXPECTED.items():
        cls_name, _, method = qualified.partition(".")
        cls = getattr(base, cls_name, None)
        func = getattr(cls, method, None) if cls is not None else None
        if func is None:
            problems.append(f"{qualified} is missing")
            continue
        found = parameters_text(func)
        if found != expected:
            problems.append(f"{qualified}{found} (expected {expected})")
    return problems


def incompatible_message(version: str, problems: list[str]) -> str:
    """The one line that refuses the backend on an incompatible vLLM."""
    return (
        f"nemo-refit-reshard: the 'reshard' weight-transfer backend supports vLLM "
        f"{SUPPORTED_VLLM}.x's weight-transfer API; vLLM {version} differs: "
        + "; ".join(problems)
        + f". Install {SUPPORTED_RANGE} (pip install 'nemo-refit-reshard[vllm]'), or refit "
        "through worker_extension_cls, NeMo RL or veRL, which do not use this API"
    )


class IncompatibleVllmError(RuntimeError):
    """The installed vLLM's weight-transfer API is not one our engines support."""


def refusing_engine(message: str) -> type:
    """A class to register under our backend's name on an incompatible vLLM: selecting
    the backend (either factory builds it) raises ``message`` instead of failing inside
    a refit."""

    class IncompatibleReshardEngine:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise IncompatibleVllmError(message)

        @classmethod
        def trainer_init(cls, *args: object, **kwargs: object) -> None:
            raise IncompatibleVllmError(message)

    return IncompatibleReshardEngine


__all__ = [
    "EXPECTED",
    "IncompatibleVllmError",
    "SUPPORTED_RANGE",
    "SUPPORTED_VLLM",
    "api_problems",
    "incompatible_message",
    "parameters_text",
    "refusing_engine",
]
