"""Refit inside SGLang's scheduler processes: one rank's operations on SGLang's model.

Every function takes SGLang's model, as SGLang hands it to a custom weight loader
(``loader.py``: ``WeightUpdater.update_weights_from_tensor`` calls
``custom_loader(model, named_tensors)`` in every tensor-parallel rank). This rank's
state — its refit-group membership, the compiled plan and the weights' version — lives
on the model object, so it survives from one ``update_weights_from_tensor`` call to the
next, as the vLLM receiver keeps it on vLLM's worker. Each rank runs, in order::

    refit_describe(model)                        -> this rank's live parameters
    refit_join(model, endpoint_json, first_rank) -> joins the refit group
    refit_load_plan(model, plan, fingerprint)    -> checks and compiles its plan slice
      (or, colocated: refit_connect_colocated(model, ...) -> its GPU's training rank)
    refit_step(model, step)                      -> one refit, in place
    refit_close(model)

Parameters are written **in place** (``RefitWorker`` unpacks into the live tensors):
their storage never moves, so CUDA graphs SGLang captured stay valid.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...layouts.sglang import SGLANG_KV_CACHE_SCALES
from ...plan import PlanError, RankPlan, RefitPlan, load_plan_json
from ..worker import EngineRankState, describe_tensors, device_name, plan_text

STATE_ATTR = "_nemo_refit_reshard_state"

# What SGLang derives from the loaded weights in ``post_load_weights`` (DeepSeek MLA's
# per-head ``w_kc``/``w_vc``, ``layouts/sglang.py::sglang_derived_tensors``): never sent,
# recomputed by SGLang's own method after every refit.
DERIVED_SUFFIXES = (".w_kc", ".w_vc")


@dataclass(kw_only=True)
class _RankState(EngineRankState):
    errors: list[str] = field(default_factory=list)  # what the loader caught (loader.py)


def sglang_version() -> str:
    import sglang

    return str(sglang.__version__)


def engine_rank() -> int:
    """This rank's place in its engine, ``pp_rank·tp + tp_rank``: SGLang's own world
    rank (``runtime_context.spawn_world_rank``; its launcher starts the ranks pp-major,
    ``entrypoints/engine.py``), which the SGLang layouts number the same way
    (``layouts/vllm_grid.py::vllm_position``)."""
    from sglang.srt.distributed import parallel_state as ps

    pp_rank = int(ps.get_pp_group().rank_in_group)
    return pp_rank * int(ps.get_tensor_model_parallel_world_size()) + int(
        ps.get_tensor_model_parallel_rank()
    )


def refit_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter a refit writes: all of the model's but the derived ones and an
    FP8 engine's KV-cache scales (``SGLANG_KV_CACHE_SCALES``: no plan writes them)."""
    skip = (*DERIVED_SUFFIXES, *SGLANG_KV_CACHE_SCALES)
    return {n: p for n, p in model.named_parameters() if not n.endswith(skip)}


def _state(model: torch.nn.Module) -> _RankState:
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        state = _RankState(engine_rank=engine_rank(), params=refit_parameters(model))
        # object.__setattr__: nn.Module's __setattr__ would register nothing here, but
        # going around it keeps the state out of any module bookkeeping.
        object.__setattr__(model, STATE_ATTR, state)
    return state


def refit_describe(model: torch.nn.Module) -> dict[str, Any]:
    """This rank's live parameters and where it sits, for the driver to check the plan."""
    s = _state(model)
    first = next(iter(s.params.values()))
    return {
        "sglang_version": sglang_version(),
        "engine_rank": s.engine_rank,
        "device": str(first.device),
        "gpu": device_name(first.device),
        "tensors": describe_tensors(s.params),
    }


def refit_join(model: torch.nn.Module, endpoint_json: str, first_rank: int) -> int:
    """Join the refit group as rank ``first_rank + engine rank``; returns that rank.
    Every rank receives the same arguments (one ``update_weights_from_tensor``
    payload for the whole engine), so the endpoint's ``group_rank`` is ignored."""
    return _state(model).join(endpoint_json, first_rank)


def refit_check_plan(
    model: torch.nn.Module,
    plan: str | Mapping[str, str],
    group_rank: int,
    fingerprint: str | None = None,
) -> RefitPlan | RankPlan:
    """The plan for refit rank ``group_rank``, checked on this rank alone: it must write
    exactly the live parameters with their shapes and dtypes, and be a slice of the
    driver's plan (``fingerprint``) when given. A mismatch is a ``PlanError``."""
    s = _state(model)
    loaded = load_plan_json(plan_text(plan, group_rank, "rank"))
    where = f"SGLang {sglang_version()} engine rank {s.engine_rank}"
    if fingerprint is not None and loaded.fingerprint != fingerprint:
        raise PlanError(
            f"{where}: the plan shipped to refit rank {group_rank} is "
            f"{loaded.fingerprint[:12]}, not the driver's plan {fingerprint[:12]}: ship "
            "every rank a slice of the same plan"
        )
    problems = s.plan_problems(loaded.expected_tensors(group_rank))
    problems += fp8_relayout_problems(s.params)
    problems += kv_cache_scale_problems(model)
    if problems:
        raise PlanError.listing(
            f"{where}: live parameters do not match the plan",
            problems,
            "build the plan with layouts/sglang.py for this engine's tp and dtype",
        )
    return loaded


def kv_cache_scale_problems(model: torch.nn.Module) -> list[str]:
    """KV-cache scales calibrated for the loaded weights (an FP8 KV cache's): a refit
    leaves them as they are, so they would no longer fit the new weights. SGLang's
    defaults are -1.0 before its post-load pass and 1.0 after it (no scale in the
    checkpoint): those scale nothing and are kept."""
    calibrated = [
        f"{name}: {float(p):g}"
        for name, p in model.named_parameters()
        if name.endswith(SGLANG_KV_CACHE_SCALES) and float(p) not in (-1.0, 1.0)
    ]
    if not calibrated:
        return []
    return [
        f"{len(calibrated)} calibrated KV-cache scales ({calibrated[0]}, ...): a refit does not "
        "recalibrate them; serve from a checkpoint without k_scale / v_scale tensors"
    ]


def fp8_relayout_problems(params: Mapping[str, torch.Tensor]) -> list[str]:
    """Why an in-place refit of FP8 parameters would be wrong on this device. SGLang's
    ``process_weights_after_loading`` keeps block-FP8 weights and scales as loaded on
    NVIDIA Hopper (sm90) only: with DeepGEMM's UE8M0 scales (sm100/sm120) it requantizes
    them, on AMD it pre-shuffles them, on an AMX CPU it repacks them; the refit writes
    them as the checkpoint has them and reruns only ``post_load_weights``."""
    fp8 = [n for n, p in params.items() if p.dtype == torch.float8_e4m3fn]
    if not fp8:
        return []
    device = next(iter(params.values())).device
    if device.type == "cuda" and torch.version.hip is None:
        major, minor = torch.cuda.get_device_capability(device)
        if major == 9:
            return []
        where = f"a CUDA sm{major}{minor} GPU"
    else:
        where = "AMD GPUs" if torch.version.hip is not None else f"{device.type}"
    return [
        f"{len(fp8)} block-FP8 parameters ({fp8[0]}, ...) on {where}: SGLang re-lays FP8 "
        "weights after loading there (UE8M0 requantization, pre-shuffle or repack), which "
        "an in-place refit would not match; refit FP8 SGLang engines on Hopper (sm90), or "
        "serve BF16"
    ]


def refit_load_plan(
    model: torch.nn.Module, plan: str | Mapping[str, str], fingerprint: str | None = None
) -> int:
    """Check the plan (:func:`refit_check_plan`) and compile this rank's program.
    Collective over the refit group. Returns the number of parameters it writes."""
    return _state(model).load_plan(lambda rank: refit_check_plan(model, plan, rank, fingerprint))


def refit_connect_colocated(
    model: torch.nn.Module,
    endpoint_json: str,
    first_rank: int,
    addresses: list[str],
    host_gpus: list[str | None],
    plan: str | Mapping[str, str],
    fingerprint: str | None = None,
) -> int:
    """Colocated refit (``plan/colocation.py``): this rank is the guest of the training
    rank on its GPU. ``addresses[k]`` / ``host_gpus[k]``: where the host of this engine's
    tp rank ``k`` listens and the GPU it reported. The plan put them there from the
    framework's placement, which this rank confirms with the GPU it runs on before it
    connects (a mismatch is a ``PlanError``: staging meant for another GPU is never
    read). ``endpoint_json``: the training ranks' group (secret, timeouts). Returns
    this rank's refit rank."""
    s = _state(model)
    s.close()
    rank = first_rank + s.engine_rank
    where = f"SGLang {sglang_version()} engine rank {s.engine_rank}"
    if s.engine_rank >= len(addresses) or len(host_gpus) != len(addresses):
        raise PlanError(
            f"{where}: the driver named hosts for {len(addresses)} ranks and GPUs for "
            f"{len(host_gpus)}; every rank of a colocated engine needs a training rank on its GPU"
        )
    mine = device_name(next(iter(s.params.values())).device)
    if mine is None or mine != host_gpus[s.engine_rank]:
        raise PlanError(
            f"{where} runs on GPU {mine}, but the plan made the training rank on GPU "
            f"{host_gpus[s.engine_rank]} its host: place each SGLang rank on the GPU of "
            "the training rank the plan names (NeMo RL: engine i's tp rank k on the "
            "placement group's GPU i*tp + k, as the policy's rank i*tp + k)"
        )
    loaded = refit_check_plan(model, plan, rank, fingerprint)
    return s.connect_colocated(endpoint_json, addresses[s.engine_rank], loaded, rank)


def refit_step(model: torch.nn.Module, step: int | None = None) -> dict[str, float]:
    """One refit (collective), in place; this rank's timing.

    Versioned: the weights are stale from the start until it completes, and a failed
    refit leaves them so (``refit_status``). Then SGLang's own ``post_load_weights``
    reruns, as SGLang's loaders run it after ``load_weights``: a custom loader bypasses
    ``load_weights``, and SGLang's ``end_weight_update`` skips it once a load ran."""
    s = _state(model)
    if s.colocated is not None:
        seconds = s.colocated.refit(step)
        guest = s.colocated.guest
        rank = guest.group_rank if guest is not None else -1
    elif s.refit is not None and s.refit.refitter is not None:
        seconds = s.refit.refit(step).seconds
        rank = s.refit.endpoint.group_rank
    else:
        raise RuntimeError(
            "join the refit group and load a plan (or connect colocated) before a refit step"
        )
    start = time.perf_counter()
    try:
        try:
            from sglang.srt.model_loader.loader import post_load_weights
        except ImportError:  # SGLang 0.5.12.post1 (NeMo RL's pin): the same, private
            from sglang.srt.model_loader.loader import _post_load_weights as post_load_weights

        post_load_weights(model)  # a no-op where the model has no post_load_weights
    except BaseException as err:
        # the refit parameters are new, what SGLang derives from them is not
        s.weights.failed(s.weights.step if s.weights.step is not None else s.steps, err)
        raise
    s.steps += 1
    return {
        "group_rank": float(rank),
        "seconds": seconds,
        "derived_seconds": time.perf_counter() - start,
    }


def refit_status(model: torch.nn.Module) -> dict[str, object]:
    """This rank's weights (the last complete refit's step and plan, or why stale) and
    the errors the loader caught."""
    s = _state(model)
    return {**s.weights.as_dict(), "errors": list(s.errors)}


def refit_require_fresh(model: torch.nn.Module) -> None:
    """Raise ``StaleWeightsError`` naming the failed step if this rank's weights may be
    torn: ask every rank before continuing generation."""
    s = _state(model)
    s.weights.require_fresh(f"generation on SGLang engine rank {s.engine_rank}")


def refit_close(model: torch.nn.Module) -> None:
    s = getattr(model, STATE_ATTR, None)
    if s is not None:
        s.close()
