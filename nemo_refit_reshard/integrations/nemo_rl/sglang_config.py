"""NeMo RL's SGLang generation (``policy.generation.backend: sglang``) in our terms.

NeMo RL runs SGLang as HTTP servers, one per ``sglang_cfg.tp_size`` GPUs
(``sglang_server_config.num_gpus`` in all), colocated with the policy only: its GRPO
setup refuses the other placements, or would wait forever for inference ranks that
never join its collective. These functions read ``policy.generation.sglang_cfg`` into
:class:`InferParallel` and refuse, naming the key, what the refit cannot serve. Nothing
here imports NeMo RL or SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...spec.parallel import InferParallel
from .errors import NemoRlConfigError

WHERE = "policy.generation.sglang_cfg"
SGLANG_DELTA = (
    "refit.delta=true with policy.generation.backend=sglang: delta refits are served for "
    "vLLM generation only; set refit.delta=false"
)


def _size(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key, 1)
    value = 1 if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise NemoRlConfigError(f"{WHERE}.{key}={value!r} must be a positive integer")
    return value


def check_sglang_generation(generation: Mapping[str, Any]) -> Mapping[str, Any]:
    """``policy.generation`` with ``backend: sglang`` as ``reshard`` serves it; returns
    ``sglang_cfg``. Colocated (as NeMo RL runs SGLang), one SGLang data-parallel replica
    per server (SGLang's ``update_weights_from_tensor`` asserts it), tensor parallel with
    expert parallelism 1 or ``tp_size`` (the SGLang layouts, ``layouts/sglang.py``)."""
    if not (generation.get("colocated") or {}).get("enabled", True):
        raise NemoRlConfigError(
            "policy.generation.colocated.enabled=False with backend=sglang: NeMo RL runs "
            "SGLang colocated only (its setup would wait for inference ranks that never "
            "join its collective); set it to true"
        )
    scfg = generation.get("sglang_cfg") or {}
    tp = _size(scfg, "tp_size")
    rules = [
        ("dp_size", _size(scfg, "dp_size") == 1,
         "NeMo RL passes it as SGLang's --dp-size (replicas inside one server), whose "
         "update_weights_from_tensor SGLang refuses; set it to 1 and run more servers "
         "(sglang_server_config.num_gpus)"),
        ("pp_size", _size(scfg, "pp_size") == 1,
         "the SGLang layouts are tensor parallel only; set it to 1"),
        ("ep_size", _size(scfg, "ep_size") in (1, tp),
         f"SGLang's experts are planned over ep_size 1 or tp_size={tp}; set one of them"),
    ]  # fmt: skip
    for key, ok, why in rules:
        if not ok:
            raise NemoRlConfigError(f"{WHERE}.{key}={scfg.get(key)!r}: {why}")
    server = scfg.get("sglang_server_config") or {}
    per_engine = server.get("num_gpus_per_engine", tp)
    if per_engine != tp:
        raise NemoRlConfigError(
            f"{WHERE}.sglang_server_config.num_gpus_per_engine={per_engine!r} must equal "
            f"tp_size={tp} (one SGLang server per tp_size GPUs)"
        )
    return scfg


def sglang_infer_parallel(generation: Mapping[str, Any], engines: int) -> InferParallel:
    """SGLang's sizes: ``engines`` servers of ``tp_size`` ranks, experts over ``ep_size``
    (1, or all of a server's tp ranks: InferParallel's ``ep = engine_dp·tp``)."""
    scfg = check_sglang_generation(generation)
    tp, ep = _size(scfg, "tp_size"), _size(scfg, "ep_size")
    return InferParallel(tp=tp, dp=engines, ep=ep)


def check_sglang_servers(servers: list[Any]) -> None:
    """The SGLang server actors must be ours (``sglang_worker.py``): NeMo RL's own worker
    starts SGLang without our loader, which SGLang would refuse as an unknown
    ``load_format`` inside its scheduler. Ours has ``begin_weight_update``."""
    if not servers:
        raise NemoRlConfigError(
            "policy.generation.backend=sglang: NeMo RL started no SGLang servers"
        )
    theirs = [i for i, s in enumerate(servers) if not hasattr(s, "begin_weight_update")]
    if theirs:
        raise NemoRlConfigError(
            f"SGLang servers {theirs} were started by NeMo RL's own SGLangGenerationWorker, "
            "without our refit loader: call grpo.policy_factory(refit, config) before NeMo "
            "RL's setup (examples/nemo_rl/run_grpo.py does)"
        )
