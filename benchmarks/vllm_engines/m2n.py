"""``nccl_m2n``: vLLM's many-to-many engine.

Which parameters resolve *direct* (each worker receives its shard) and which take the
full-tensor *fallback* is vLLM's ``m2n_layout.resolve_parameter_destinations`` run on
vLLM's own model class for each rank (meta device), with the arguments
``m2n_engine._prepare_destination_plan`` passes it. The trainer's source layouts are
checked with vLLM's ``m2n_common.check_plan_limits`` / ``validate_layout``; choosing
them (the rule in :func:`m2n_source`) is ours."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from benchmarks.vllm_engines.common import Box, Case, Figures, Held, held_numel, rank_models

if TYPE_CHECKING:
    import torch

# name -> (direct?, its placements when direct, bytes this worker receives)
Resolution = dict[str, tuple[bool, Any, int]]


def native_m2n_layout(
    shape: tuple[int, ...], boxes_by_rank: list[list[Box]], num_ranks: int
) -> tuple[Any, tuple] | None:
    """Megatron's own layout of one tensor as an m2n source layout (a 2-D mesh over every
    training rank in order, each axis Replicate or Shard(d)), or None where placements
    cannot express it (a rank holding none of it, or several pieces: PP, EP, fused)."""
    from vllm.distributed.weight_transfer.m2n_common import REPLICATE, REPLICATED, M2NMesh

    if any(len(b) != 1 for b in boxes_by_rank):
        return None
    full = (tuple(0 for _ in shape), tuple(shape))
    if all(b[0] == full for b in boxes_by_rank):
        return M2NMesh((num_ranks, 1), 0), REPLICATED
    for a in range(1, num_ranks + 1):
        if num_ranks % a:
            continue
        b = num_ranks // a
        for axis, k in ((0, a), (1, b)):
            for d, extent in enumerate(shape):
                if k == 1 or extent % k:
                    continue
                w = extent // k
                ok = True
                for r, bx in enumerate(boxes_by_rank):
                    idx = r // b if axis == 0 else r % b
                    want = list(full[0]), list(full[1])
                    want[0][d], want[1][d] = idx * w, w
                    if bx[0] != (tuple(want[0]), tuple(want[1])):
                        ok = False
                        break
                if ok:
                    placements = [REPLICATE, REPLICATE]
                    placements[axis] = d
                    return M2NMesh((a, b), 0), tuple(placements)
    return None


def m2n_source(
    name: str,
    shape: tuple[int, ...],
    itemsize: int,
    held: list[Held],
    num_ranks: int,
    dst: Any,
) -> tuple[Any, int, int]:
    """The m2n source layout of one tensor and the bytes the trainer gathers for it.

    ``m2n_common.m2n_param_meta`` needs every parameter owned by every training rank,
    laid out by DTensor placements over a <= 2-D mesh. Megatron's own layout when it is
    one (gather 0); otherwise (our rule, the least we found that vLLM's checks accept) the
    trainer re-lays the tensor out as Shard(0) over ``k`` ranks, replicated over
    ``T / k`` — the largest ``k`` dividing ``T`` and dim 0 that ``check_plan_limits``
    accepts against the destination (it caps one destination shard at
    ``MAX_SOURCE_SHARDS`` = 16 source shards) — and each rank gathers the part of its
    block it did not hold. Returns (layout, gather bytes, one rank's block bytes)."""
    from vllm.distributed.weight_transfer.m2n_common import (
        REPLICATE,
        M2NMesh,
        check_plan_limits,
        resolve_layout,
        validate_layout,
    )

    boxes = [h.get(name, []) for h in held]
    native = native_m2n_layout(shape, boxes, num_ranks)
    if native is not None:
        src = resolve_layout(*native)
        validate_layout(*src, shape, name)
        check_plan_limits(src, dst, name, shape)
        return src, 0, 0
    for k in sorted((k for k in range(1, num_ranks + 1) if num_ranks % k == 0), reverse=True):
        if shape[0] % k:
            continue
        src = resolve_layout(M2NMesh((num_ranks // k, k), 0), (REPLICATE, 0))
        try:
            check_plan_limits(src, dst, name, shape)
        except ValueError:
            continue
        rows = shape[0] // k
        rest = math.prod(shape[1:])
        gather = 0
        for r in range(num_ranks):
            j = r % k
            offsets = (j * rows, *(0 for _ in shape[1:]))
            sizes = (rows, *shape[1:])
            gather += rows * rest - held_numel(boxes[r], offsets, sizes)
        return src, gather * itemsize, rows * rest * itemsize
    raise ValueError(f"{name}: no m2n source layout passes check_plan_limits")


def m2n_rank(
    model: torch.nn.Module,
    names: list[str],
    dtypes: list[torch.dtype],
    shapes: list[tuple[int, ...]],
    num_workers: int,
    shard_axis_size: int,
    allow_direct: bool,
) -> Resolution:
    """vLLM's own resolution for one worker: name -> (direct?, bytes this worker receives)."""
    from vllm.distributed.weight_transfer.m2n_layout import resolve_parameter_destinations

    dests = resolve_parameter_destinations(
        model,
        names,
        dtypes,
        shapes,
        num_workers=num_workers,
        shard_axis_size=shard_axis_size,
        allow_direct=allow_direct,
    )
    out = {}
    for d, dtype, shape in zip(dests, dtypes, shapes):
        if d.direct:
            out[d.name] = (True, d.placements, d.tensor.numel() * dtype.itemsize)
        else:
            out[d.name] = (False, None, math.prod(shape) * dtype.itemsize)
    return out


def m2n_resolve_ranks(case: Case) -> list[Resolution]:
    """:func:`m2n_rank` of one worker per TP position, by representative name."""
    # m2n_engine._prepare_destination_plan: dst mesh (replicas, tp) over all N
    # workers; direct loading only without PP and quantization.
    return [
        m2n_rank(
            model,
            case.rnames,
            case.rdtypes,
            case.rshapes,
            case.num_workers,
            case.infer.tp,
            allow_direct=case.infer.pp == 1,
        )
        for model in rank_models(case)
    ]


def nccl_m2n_figures(case: Case, per_pos: list[Resolution]) -> Figures:
    """``nccl_m2n`` from vLLM's resolution per TP position (:func:`m2n_resolve_ranks`).

    A worker receives its shard of each direct tensor and every fallback tensor whole;
    its staging is the largest fallback tensor (one live at a time: a lower bound). The
    trainer gathers, and holds at most one block of, what :func:`m2n_source` re-lays out
    against the destination layout (mesh ``(replicas, tp)`` after the T training
    ranks)."""
    from vllm.distributed.weight_transfer.m2n_common import M2NMesh, resolve_layout

    T, tp = case.num_sources, case.infer.tp
    w_bytes = [0] * tp
    fallback_names: set[str] = set()
    worker_stage = 0
    placement_of: dict[str, object] = {}
    for t in case.tensors:
        r = case.rep[t.name]
        for pos in range(tp):
            direct, placements, b = per_pos[pos][r]
            w_bytes[pos] += b
            if not direct:
                fallback_names.add(t.name)
                worker_stage = max(worker_stage, b)
            placement_of[t.name] = placements

    dst_mesh = M2NMesh((case.replicas, tp), T)
    m2n_gather, m2n_trainer_stage = 0, 0
    for t in case.tensors:
        dst = resolve_layout(dst_mesh, placement_of[t.name])
        itemsize = case.dtype[t.name].itemsize
        _, gather, block = m2n_source(t.name, tuple(t.shape), itemsize, case.held, T, dst)
        m2n_gather += gather
        m2n_trainer_stage = max(m2n_trainer_stage, block)

    whole = sum(case.nbytes[n] for n in fallback_names) / case.model_bytes
    return Figures(
        max(w_bytes),
        sum(w_bytes) * case.replicas,
        m2n_gather,
        worker_stage,
        m2n_trainer_stage,
        [f"{len(fallback_names):,} of {len(case.tensors):,} tensors whole ({whole:.1%} of bytes)"],
        frozenset(fallback_names),
    )
