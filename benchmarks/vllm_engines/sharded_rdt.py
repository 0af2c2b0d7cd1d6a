"""``sharded_rdt``: vLLM's sharded RDT engine.

The op chains are baked by vLLM's own ``ShardedRDTWeightTransferEngine._bake`` (its
``FakeRDTTensor`` / ``BakeSink`` recording through the model's own ``load_weights``) on
the meta device; each worker's pull is the distinct ``FetchKey`` slices of that bake,
sized as ``_build_call_plan`` sizes them; its ring slot is vLLM's ``buffer_alloc_bytes``."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from benchmarks.vllm_engines.common import Case, Figures, held_numel, rank_models

if TYPE_CHECKING:
    import torch


def rdt_bake(
    model: torch.nn.Module, names: list[str], dtype_names: list[str], shapes: list[list[int]]
) -> tuple[dict[str, Any], list[str]]:
    """vLLM's own bake (``ShardedRDTWeightTransferEngine._bake``) on the meta device:
    name -> its module's scatters, and the names whose copy fired. Only the engine's
    attributes ``_bake`` reads are set; nothing else of the engine runs."""
    import torch
    from vllm.distributed.weight_transfer.sharded_rdt_engine import (
        ShardedRDTWeightTransferEngine,
    )
    from vllm.model_executor.model_loader.reload.layerwise import (
        record_metadata_for_reloading,
    )

    # As vLLM's model loader does after building (model_loader/utils.py:134); the
    # bake's initialize_layerwise_reload restores parameters from this metadata.
    record_metadata_for_reloading(model)
    engine = object.__new__(ShardedRDTWeightTransferEngine)
    engine.model = model
    engine.device = torch.device("meta")
    engine._name_to_plan = {}
    engine._live_names = set()
    info = SimpleNamespace(names=names, dtype_names=dtype_names, shapes=shapes)
    ShardedRDTWeightTransferEngine._bake(engine, info)
    unbaked = sorted(engine._live_names - set(engine._name_to_plan))
    return engine._name_to_plan, unbaked


def rdt_pull_bytes(name_to_plan: dict[str, Any]) -> dict[str, int]:
    """Bytes pulled per source name: its distinct ``FetchKey`` s (name, op chain), each
    ``prod(shape) * itemsize`` as ``_build_call_plan`` pass 3 sizes them (dedup per chunk;
    a key's chunk is its name's group and owner class, so per name is the same)."""
    seen: set = set()
    out: dict[str, int] = defaultdict(int)
    for scatters in {id(s): s for s in name_to_plan.values()}.values():
        for sc in scatters:
            if sc.src in seen:
                continue
            seen.add(sc.src)
            out[sc.src[0]] += (math.prod(sc.shape) or 1) * sc.dtype.itemsize
    return out


def rdt_bake_ranks(case: Case) -> tuple[list[dict[str, int]], list[str]]:
    """:func:`rdt_pull_bytes` of one worker per TP position, by representative name,
    and the live names no bake covered (all positions together)."""
    per_pos: list[dict[str, int]] = []
    unbaked_all: list[str] = []
    dtype_names = [str(d).removeprefix("torch.") for d in case.rdtypes]
    shapes = [list(s) for s in case.rshapes]
    for model in rank_models(case):
        plan_by_name, unbaked = rdt_bake(model, case.rnames, dtype_names, shapes)
        unbaked_all += unbaked
        per_pos.append(rdt_pull_bytes(plan_by_name))
    return per_pos, unbaked_all


def sharded_rdt_figures(case: Case, per_pos: list[dict[str, int]], unbaked: list[str]) -> Figures:
    """``sharded_rdt`` from vLLM's bake per TP position (:func:`rdt_bake_ranks`).

    A worker receives its pulls. Its staging is the RDT ring; the trainer's (ours) is the
    groups resident on one owner, gathered full there (both below)."""
    from vllm.distributed.weight_transfer.base import layerwise_groups
    from vllm.distributed.weight_transfer.sharded_rdt_common import buffer_alloc_bytes
    from vllm.distributed.weight_transfer.sharded_rdt_engine import (
        ShardedRDTWeightTransferInitInfo,
    )
    from vllm.distributed.weight_transfer.sharded_rdt_trainer import DEFAULT_GATHER_LOOKAHEAD

    tensors, rep, tp = case.tensors, case.rep, case.infer.tp
    groups = layerwise_groups([t.name for t in tensors])
    pulls = [sum(per_pos[pos].get(rep[t.name], 0) for t in tensors) for pos in range(tp)]
    # Worker staging: num_rdt_buffers ring slots, each buffer_alloc_bytes of the largest
    # chunk (sharded_rdt_engine._issue_pull). A chunk is one (group, owner class); with one
    # owner per name the largest chunk is at most the worker's largest group pull.
    ring = ShardedRDTWeightTransferInitInfo.__dataclass_fields__["num_rdt_buffers"].default
    max_chunk = max(
        sum(per_pos[pos].get(rep[n], 0) for n in g) for g in groups for pos in range(tp)
    )
    # Trainer: every name gathered full on its owner (iter_full); least gather: one
    # owner per name, the rank holding most of it. Resident on an owner: at most
    # gather_lookahead + 1 groups (sharded_rdt_trainer.DEFAULT_GATHER_LOOKAHEAD).
    rdt_gather = 0
    owned_in_group: dict[tuple[int, int], int] = defaultdict(int)
    gi_of = {n: gi for gi, g in enumerate(groups) for n in g}
    for t in tensors:
        full = ((0,) * len(t.shape), tuple(t.shape))
        have = [held_numel(h.get(t.name, []), *full) for h in case.held]
        owner = max(range(case.num_sources), key=lambda r: (have[r], -r))
        rdt_gather += case.nbytes[t.name] - have[owner] * case.dtype[t.name].itemsize
        owned_in_group[(owner, gi_of[t.name])] += case.nbytes[t.name]
    per_owner: dict[int, list[int]] = defaultdict(list)
    for (owner, _gi), b in owned_in_group.items():
        per_owner[owner].append(b)
    trainer_rdt = max(
        sum(sorted(v, reverse=True)[: DEFAULT_GATHER_LOOKAHEAD + 1]) for v in per_owner.values()
    )
    return Figures(
        max(pulls),
        sum(pulls) * case.replicas,
        rdt_gather,
        ring * buffer_alloc_bytes(max_chunk),
        trainer_rdt,
        [f"unbaked live names: {len(set(unbaked))}"] if unbaked else [],
    )
