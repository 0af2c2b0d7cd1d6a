"""Refit inside vLLM's workers: plain functions for ``collective_rpc`` and an extension class.

Every function takes vLLM's worker as its first argument, as
``LLM.collective_rpc(fn, args=...)`` / ``AsyncLLM.collective_rpc(fn, args=...)``
call it; :class:`ReshardWorkerExtension` exposes the same operations as methods
for ``worker_extension_cls`` (then ``collective_rpc("refit_join", args=...)``).
Each vLLM worker of an engine runs them, in this order::

    refit_describe(worker)                        -> this rank's live parameters
    refit_join(worker, endpoint_json, first_rank) -> joins the refit group
    refit_load_plan(worker, plan)                 -> checks and compiles its plan slice
    refit_step(worker)                            -> one refit, in place; timing
    refit_close(worker)

Parameters are written **in place**: their storage never moves, so CUDA graphs
captured by vLLM stay valid. With the gloo transport and parameters on a GPU, the
messages go through pinned host buffers (``engine/host_staged.py``); the program still
unpacks into the parameters on the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...plan import PlanError, RankPlan, RefitPlan, load_plan_json
from ..worker import EngineRankState, describe_tensors, device_name, plan_text
from .config import EngineLayout, UnsupportedVllmOption, engine_layout
from .derived import DerivedWeights, check_derived, derived_parameter_names
from .discarded_weights import STATE_ATTR, refit_delta_stats, refit_forget_weights, watch_weights
from .kernel_checks import check_fp8_kernels, check_moe_backends

_STATE = STATE_ATTR


@dataclass(kw_only=True)
class _WorkerState(EngineRankState):
    # ``params`` (EngineRankState's): on an FP8 engine, its e4m3 weights and scales
    layout: EngineLayout
    derived: DerivedWeights  # what vLLM derives from the parameters, rerun after every refit


def _model(worker: Any) -> torch.nn.Module:
    # vLLM's Worker holds the model in its runner; a weight-transfer engine
    # (``transfer_worker.py``) is handed the model itself.
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return worker.model
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def engine_rank(worker: Any) -> int:
    """This worker's rank inside its engine: ``(edp·pp + pp_rank)·tp + tp_rank``."""
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    par = worker.vllm_config.parallel_config
    edp = int(getattr(par, "data_parallel_rank", 0) or 0)
    pp, tp = int(par.pipeline_parallel_size), int(par.tensor_parallel_size)
    return (edp * pp + get_pp_group().rank_in_group) * tp + get_tensor_model_parallel_rank()


# vLLM's attention layers of a quantized engine register KV-cache scales (Fp8KVCacheMethod,
# BaseKVCacheMethod) even when the KV cache is not FP8: constants set at load, in no
# checkpoint the trainer holds, read by no kernel then. They are not refit.
KV_CACHE_SCALES = (".attn.q_scale", ".attn.k_scale", ".attn.v_scale", ".attn.prob_scale")


def refit_parameters(model: torch.nn.Module, vllm_config: Any) -> dict[str, torch.Tensor]:
    """The parameters a refit writes: all of the model's, less the KV-cache scales of an
    engine whose KV cache is not FP8 (an FP8 KV cache's scales are not refit: refused) and
    less what vLLM derives after loading (MLA's ``W_UK_T``/``W_UV``: ``derived.py``)."""
    cache = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    if str(cache).startswith("fp8"):
        raise UnsupportedVllmOption(
            f"kv_cache_dtype={cache!r}: the FP8 KV cache's scales are not refit; serve "
            "with kv_cache_dtype='auto'"
        )
    derived = derived_parameter_names(model)
    return {
        n: p
        for n, p in model.named_parameters()
        if not n.endswith(KV_CACHE_SCALES) and n not in derived
    }


def check_engine(model: torch.nn.Module, vllm_config: Any, vllm_version: str) -> EngineLayout:
    """Every refusal of an engine this refit cannot serve, before any transfer: called
    when a worker is first used (``worker_extension_cls``) and when vLLM creates our
    weight-transfer engine (``transfer_worker.py``), so both refuse the same things."""
    check_moe_backends(model)
    layout = engine_layout(vllm_config, vllm_version)
    refit_parameters(model, vllm_config)  # an FP8 KV cache
    if layout.fp8_block is not None:
        # e4m3 weights and scales are written in place: quantized by the training ranks,
        # or by this rank's program from the BF16 pieces the plan sends it
        # (layouts/fp8_wire.py); only kernels that keep them as loaded compute right.
        check_fp8_kernels(model)
    check_derived(model)  # derived tensors a refit cannot recompute in place
    return layout


def _state(worker: Any) -> _WorkerState:
    state = getattr(worker, _STATE, None)
    if state is None:
        model = _model(worker)
        layout = check_engine(model, worker.vllm_config, _vllm_version())
        params = refit_parameters(model, worker.vllm_config)
        derived = DerivedWeights.of(model, worker.vllm_config)
        state = _WorkerState(
            layout=layout, engine_rank=engine_rank(worker), params=params, derived=derived
        )
        setattr(worker, _STATE, state)
    return state


def refit_describe(worker: Any) -> dict[str, Any]:
    """This rank's live parameters and where it sits, for the driver to check the plan."""
    s = _state(worker)
    first = next(iter(s.params.values()))
    return {
        "vllm_version": s.layout.vllm_version,
        "parallel": str(s.layout.parallel),
        "engine_rank": s.engine_rank,
        "device": str(first.device),
        "gpu": device_name(first.device),
        "all2all_backend": s.layout.options.all2all_backend,
        "tensors": describe_tensors(s.params),
    }


def refit_join(worker: Any, endpoint_json: str, first_rank: int) -> int:
    """Join the refit group as rank ``first_rank + engine rank``; returns that rank.

    ``endpoint_json`` is a :class:`RefitEndpoint` whose ``group_rank`` is ignored:
    every worker of the engine receives the same arguments from ``collective_rpc``.
    """
    # With gloo and parameters on a GPU, RefitWorker stages the messages through pinned
    # host memory (engine/host_staged.py); the parameters are still written in place.
    return _state(worker).join(endpoint_json, first_rank)


def refit_check_plan(
    worker: Any, plan: str | Mapping[str, str], group_rank: int
) -> RefitPlan | RankPlan:
    """Check, on this worker alone, that the plan for refit rank ``group_rank`` writes
    exactly the live parameters, with their shapes and dtypes (the transport checks the
    device when the plan is loaded); a mismatch is a ``PlanError`` naming the tensors
    and the vLLM version. Returns the loaded plan."""
    s = _state(worker)
    loaded = load_plan_json(plan_text(plan, group_rank, "worker"))
    expected = loaded.expected_tensors(group_rank)
    where = f"vLLM {s.layout.vllm_version} rank {s.engine_rank} of {s.layout.parallel}"
    hint = (
        f"build the plan with VllmOptions(vllm_version={s.layout.vllm_version!r}, "
        f"all2all_backend={s.layout.options.all2all_backend!r}) and this engine's parallelism"
    )
    problems = s.plan_problems(expected)
    if problems:
        raise PlanError.listing(f"{where}: live parameters do not match the plan", problems, hint)
    return loaded


def refit_load_plan(
    worker: Any, plan: str | Mapping[str, str], fingerprint: str | None = None
) -> int:
    """Check the plan against the live parameters (:func:`refit_check_plan`) and compile
    this rank's program. Collective over the refit group: every rank calls it. ``plan``
    is JSON text, a path where ``{rank}`` stands for this worker's refit rank, or a
    mapping from refit rank to slice (ship each worker its slice). ``fingerprint``, when
    given, is the plan the driver built: a slice of another plan is refused. Returns the
    number of parameters the plan writes."""
    return _state(worker).load_plan(lambda rank: _checked_plan(worker, plan, rank, fingerprint))


def _checked_plan(
    worker: Any, plan: str | Mapping[str, str], rank: int, fingerprint: str | None
) -> RefitPlan | RankPlan:
    loaded = refit_check_plan(worker, plan, rank)
    if fingerprint is not None and loaded.fingerprint != fingerprint:
        raise PlanError(
            f"the plan shipped to refit rank {rank} is {loaded.fingerprint[:12]}, not the "
            f"driver's plan {fingerprint[:12]}: ship every rank a slice of the same plan"
        )
    return loaded


def refit_connect_colocated(
    worker: Any,
    endpoint_json: str,
    first_rank: int,
    addresses: list[str],
    plan: str | Mapping[str, str],
    fingerprint: str | None = None,
) -> int:
    """Colocated refit (``plan/colocation.py``): connect to the training rank on this
    worker's GPU (``addresses[engine rank]``), open its staging and compile this rank's
    unpack, after checking the plan against the live parameters as
    :func:`refit_load_plan` does. ``endpoint_json``: the training ranks' group (its
    secret and timeouts). Returns this worker's refit rank."""
    s = _state(worker)
    s.close()
    rank = first_rank + s.engine_rank
    if s.engine_rank >= len(addresses):
        raise PlanError(
            f"vLLM rank {s.engine_rank}: the trainer named hosts for {len(addresses)} "
            "workers; every worker of a colocated engine needs a training rank on its GPU"
        )
    loaded = _checked_plan(worker, plan, rank, fingerprint)
    return s.connect_colocated(endpoint_json, addresses[s.engine_rank], loaded, rank)


def refit_step(worker: Any, step: int | None = None) -> dict[str, float]:
    """One refit (collective), writing the parameters in place; this rank's timing.

    The caller must have paused generation on this engine (no forward pass may run
    while weights change) and should reset the prefix cache afterwards. Versioned:
    from the start until it completes the weights are stale (``refit_status``), and a
    failed refit leaves them so — ask ``refit_require_fresh`` before generating again.
    Then what vLLM derives from the weights (MLA's ``W_UK_T``/``W_UV`` of a block-FP8
    engine) is recomputed in place (``derived_seconds``): until then they are stale too.
    """
    s = _state(worker)
    if s.colocated is not None:
        seconds = s.colocated.refit(step)
        derived = _rerun_derived(s)
        s.steps += 1
        rank = s.colocated.guest.group_rank if s.colocated.guest is not None else -1
        return {"group_rank": float(rank), "seconds": seconds, "derived_seconds": derived}
    if s.refit is None or s.refit.refitter is None:
        raise RuntimeError("call refit_join and refit_load_plan before refit_step")
    timing = s.refit.refit(step)
    derived = _rerun_derived(s)
    s.steps += 1
    return {
        "group_rank": float(s.refit.endpoint.group_rank),
        "seconds": timing.seconds,
        "exchange_seconds": timing.exchange_seconds,
        "host_seconds": timing.host_seconds,
        "derived_seconds": derived,
    }


def _rerun_derived(s: _WorkerState) -> float:
    """Recompute the derived tensors after a complete refit; a failure leaves the weights
    marked stale (the refit parameters are new, the derived tensors are not)."""
    start = time.perf_counter()
    try:
        s.derived.rerun()
    except BaseException as err:
        s.weights.failed(s.weights.step if s.weights.step is not None else s.steps, err)
        raise
    return time.perf_counter() - start


def refit_engine_rank(worker: Any) -> int:
    """This worker's rank in its engine (tp, pp and engine-dp), as the refit sees it."""
    return _state(worker).engine_rank


def refit_status(worker: Any) -> dict[str, object]:
    """This rank's weights: the last complete refit's step and plan, or why stale."""
    return _state(worker).weights.as_dict()


def refit_require_fresh(worker: Any) -> None:
    """Raise ``StaleWeightsError`` (naming the failed step) if a refit failed or did not
    finish on this rank: the driver asks every worker before resuming generation."""
    _state(worker).weights.require_fresh(f"generation on vLLM rank {_state(worker).engine_rank}")


def refit_close(worker: Any) -> None:
    s = getattr(worker, _STATE, None)
    if s is not None:
        s.close()


class ReshardWorkerExtension:
    """vLLM ``worker_extension_cls``: ``LLM(..., worker_extension_cls=
    "nemo_refit_reshard.integrations.vllm.ReshardWorkerExtension")``, then
    ``llm.collective_rpc("refit_join", args=(endpoint_json, first_rank))`` etc."""

    def refit_describe(self) -> dict[str, Any]:
        return refit_describe(self)

    def refit_join(self, endpoint_json: str, first_rank: int) -> int:
        return refit_join(self, endpoint_json, first_rank)

    def refit_check_plan(self, plan: str | Mapping[str, str], group_rank: int) -> None:
        refit_check_plan(self, plan, group_rank)

    def refit_load_plan(self, plan: str | Mapping[str, str]) -> int:
        return refit_load_plan(self, plan)

    def refit_step(self, step: int | None = None) -> dict[str, float]:
        return refit_step(self, step)

    def refit_status(self) -> dict[str, object]:
        return refit_status(self)

    def refit_require_fresh(self) -> None:
        refit_require_fresh(self)

    def refit_close(self) -> None:
        refit_close(self)

    def init_worker_extension(self) -> None:
        """vLLM's hook, once per worker after device init: a call that loses the weights
        (``sleep(level=2)``, ...) makes the next refit dense (``discarded_weights.py``)."""
        watch_weights(self)

    def refit_forget_weights(self) -> int:
        return refit_forget_weights(self)

    def refit_delta_stats(self) -> dict[str, Any] | None:
        return refit_delta_stats(self)
