"""vLLM's weight-transfer engines side by side with ``reshard``: bytes and staging memory.

    .venv-vllm/bin/python benchmarks/vllm_engines_bytes.py            # the table
    python benchmarks/vllm_engines_bytes.py   # re-runs itself under .venv-vllm

Per case (a model, Megatron's layout, vLLM's layout), bf16 both sides, and per engine:

- **worker receives** — bytes each vLLM worker receives in one refit (max over workers;
  the total over all workers in the next column);
- **trainer gathers** — bytes the training ranks must move among themselves before they
  can serve (full tensors materialized on ranks that did not hold them), summed over
  training ranks;
- **peak staging** — transfer buffers one rank holds at once (worker side / trainer side).

What is vLLM's own code and what is reproduced:

- ``nccl_m2n``: which parameters resolve *direct* (each worker receives its shard) and
  which take the full-tensor *fallback* is vLLM's ``m2n_layout.resolve_parameter_
  destinations`` run on vLLM's own model class for each rank (meta device), with the
  arguments ``m2n_engine._prepare_destination_plan`` passes it. The trainer's source
  layouts are checked with vLLM's ``m2n_common.check_plan_limits`` /
  ``validate_layout``; choosing them (the rule in :func:`m2n_source`) is ours.
- ``sharded_rdt``: the op chains are baked by vLLM's own
  ``ShardedRDTWeightTransferEngine._bake`` (its ``FakeRDTTensor`` / ``BakeSink``
  recording through the model's own ``load_weights``) on the meta device; each worker's
  pull is the distinct ``FetchKey`` slices of that bake, sized as
  ``_build_call_plan`` sizes them; its ring slot is vLLM's ``buffer_alloc_bytes``.
- ``nccl``: every worker receives every tensor (``nccl_engine.receive_weights``); packed
  chunks follow ``packed_tensor.pack_tensors`` (reproduced: it needs CUDA streams).
- ``reshard``: our plan (``plan_refit``); staging from its per-round traffic.

vLLM's rank builds use symmetry: inference replicas (vLLM ``dp``) are identical, so one
rank per TP position is built; and layers of one kind are identical, so vLLM's model is
built with one layer per kind (DeepSeek-V3: its 3 dense layers + 1 MoE layer; the
others: 1 layer) and every checkpoint name of layer ``L`` is counted as its
representative layer's. Our plan is built at full depth, all ranks.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

# (model preset, Megatron, vLLM, Megatron's first/last stage layers): the common
# layouts the table reports (DeepSeek-V3's 61 layers at pp=16: 3 + 14 x 4 + 2, the
# published split, as benchmarks/published.py).
CASES = [
    ("qwen3-8b", "tp=4,pp=2,dp=2", "tp=2,dp=4", None),
    ("qwen3-30b-a3b", "pp=2,dp=8,ep=8", "tp=8,dp=2", None),
    ("deepseek-v3", "pp=16,dp=16,ep=16", "tp=32,dp=8", (3, 2)),
]


def _reexec_under_vllm_venv() -> None:
    """Run under ``.venv-vllm`` (vLLM's model classes, CPU torch) if vLLM is not here."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if not VENV_PYTHON.exists():
        sys.exit(f"vLLM is not installed here and {VENV_PYTHON} is missing")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    os.execve(str(VENV_PYTHON), [str(VENV_PYTHON), *sys.argv], env)


@dataclass
class Figures:
    """One engine's figures for one case (bytes). ``None``: not obtainable on CPU."""

    worker_max: int
    worker_total: int
    trainer_gather: int | None
    worker_staging: int | None
    trainer_staging: int | None
    notes: list[str] = field(default_factory=list)
    whole: frozenset[str] = frozenset()  # nccl_m2n: names some worker receives whole


# ---------------------------------------------------------------------------------------
# Names: every checkpoint name, and the representative layer vLLM is built with.

_LAYER = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")


def kept_layers(hf_config: dict) -> int:
    """Layers vLLM's model is built with: one per kind (DeepSeek: dense ones, then 1 MoE)."""
    return int(hf_config.get("first_k_dense_replace", 0) or 0) + 1


def representative(name: str, keep: int) -> str:
    m = _LAYER.match(name)
    if m is None or int(m.group(2)) < keep:
        return name
    return f"{m.group(1)}{keep - 1}{m.group(3)}"


_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def truncated_config(hf_config: dict) -> dict:
    """The preset's config.json with one layer per kind, transformers' defaults filled."""
    import transformers

    cfg = copy.deepcopy(hf_config)
    cfg["num_hidden_layers"] = kept_layers(hf_config)
    cfg.pop("num_nextn_predict_layers", None)  # MTP layers: not in vLLM's main model
    model_type = cfg.pop("model_type", None) or _MODEL_TYPES[cfg["architectures"][0]]
    full = transformers.AutoConfig.for_model(model_type, **cfg).to_dict()
    full["architectures"] = cfg["architectures"]
    return full


# ---------------------------------------------------------------------------------------
# Training side: what each Megatron rank holds of each checkpoint tensor.


def held_boxes(sources) -> list[dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]]:
    """Per training rank: canonical name -> distinct boxes it holds."""
    out = []
    for layout in sources:
        boxes: dict[str, set] = defaultdict(set)
        for t in layout.tensors:
            for p in t.pieces:
                b = p.canonical_box
                boxes[p.canonical].add((tuple(b.offsets), tuple(b.sizes)))
        out.append({k: sorted(v) for k, v in boxes.items()})
    return out


def overlap(box, offsets, sizes) -> int:
    n = 1
    for o, s, bo, bs in zip(box[0], box[1], offsets, sizes):
        lo, hi = max(o, bo), min(o + s, bo + bs)
        if hi <= lo:
            return 0
        n *= hi - lo
    return n


def held_numel(boxes, offsets, sizes) -> int:
    return sum(overlap(b, offsets, sizes) for b in boxes)


# ---------------------------------------------------------------------------------------
# nccl_m2n


def native_m2n_layout(shape, boxes_by_rank, num_ranks):
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


def m2n_source(name, shape, itemsize, held, num_ranks, dst):
    """The m2n source layout of one tensor and the bytes the trainer gathers for it.

    ``m2n_common.m2n_param_meta`` needs every parameter owned by every training rank,
    laid out by DTensor placements over a <= 2-D mesh. Megatron's own layout when it is
    one (gather 0); otherwise (our rule, the least we found that vLLM's checks accept) the
    trainer re-lays the tensor out as Shard(0) over ``k`` ranks, replicated over
    ``T / k`` — the largest ``k`` dividing ``T`` and dim 0 that ``check_plan_limits``
    accepts against the destination (it caps one destination shard at
    ``MAX_SOURCE_SHARDS`` = 16 source shards) — and each rank gathers the part of its
    block it did not hold."""
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


def m2n_rank(model, names, dtypes, shapes, num_workers, shard_axis_size, allow_direct):
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


# ---------------------------------------------------------------------------------------
# sharded_rdt


def rdt_bake(model, names, dtype_names, shapes):
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


def rdt_pull_bytes(name_to_plan) -> dict[str, int]:
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


# ---------------------------------------------------------------------------------------
# nccl packed


def packed_chunks(sizes: list[int], buffer_size: int) -> list[int]:
    """Chunk sizes ``packed_tensor.pack_tensors`` forms (packed_tensor.py:126: a chunk
    takes tensors until its total exceeds ``buffer_size_bytes``; the consumer,
    ``packed_nccl_broadcast_consumer``, cuts at the same point)."""
    chunks, cur = [], 0
    for s in sizes:
        cur += s
        if cur > buffer_size:
            chunks.append(cur)
            cur = 0
    if cur:
        chunks.append(cur)
    return chunks


# ---------------------------------------------------------------------------------------


def reshard_staging(plan, num_sources: int) -> tuple[int, int]:
    """Largest per-round (send + receive) bytes of one rank, workers and trainers apart:
    the staging one serial replay set holds (docs/plan_and_engine.md; overlapped: 2x)."""
    per: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    for r, msgs in enumerate(plan.traffic()):
        for src, dst, nbytes in msgs:
            per[(r, src)][0] += nbytes
            per[(r, dst)][1] += nbytes
    worker = trainer = 0
    for (_, rank), (sent, received) in per.items():
        if rank < num_sources:
            trainer = max(trainer, sent + received)
        else:
            worker = max(worker, sent + received)
    return worker, trainer


def run_case(
    model_name: str,
    train_text: str,
    infer_text: str,
    stages: tuple[int, int] | None = None,
) -> dict[str, Figures]:
    from vllm.distributed.weight_transfer.m2n_common import M2NMesh, resolve_layout
    from vllm.distributed.weight_transfer.packed_tensor import (
        DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        DEFAULT_PACKED_NUM_BUFFERS,
    )
    from vllm.distributed.weight_transfer.sharded_rdt_common import buffer_alloc_bytes
    from vllm.distributed.weight_transfer.sharded_rdt_engine import (
        ShardedRDTWeightTransferInitInfo,
    )
    from vllm.distributed.weight_transfer.sharded_rdt_trainer import DEFAULT_GATHER_LOOKAHEAD

    from nemo_refit_reshard.engine.program import TORCH_DTYPES
    from nemo_refit_reshard.plan import plan_refit
    from nemo_refit_reshard.runner import RunConfig, build_layouts
    from nemo_refit_reshard.spec.model import preset_configs
    from tests.helpers.vllm_cpu import EngineRank, build_model

    t0 = time.perf_counter()
    first, last = stages or (None, None)
    cfg = RunConfig(
        model=model_name,
        train=train_text,
        infer=infer_text,
        first_stage_layers=first,
        last_stage_layers=last,
    )
    spec, sources, destinations = build_layouts(cfg)
    train, infer = cfg.parallel()
    T, N = len(sources), len(destinations)
    plan = plan_refit(spec, sources, destinations)
    t_plan = time.perf_counter() - t0

    held = held_boxes(sources)
    stored = {p.canonical for d in destinations for t in d.tensors for p in t.pieces}
    tensors = [t for t in spec if t.name in stored]  # vLLM's main model (no MTP layers)
    dropped = [t.name for t in spec if t.name not in stored]
    dtype = {t.name: TORCH_DTYPES[t.dtype] for t in tensors}
    nbytes = {t.name: t.numel * dtype[t.name].itemsize for t in tensors}
    model_bytes = sum(nbytes.values())
    largest = max(nbytes.values())

    hf = preset_configs()[model_name]
    keep = kept_layers(hf)
    small = truncated_config(hf)
    rep = {t.name: representative(t.name, keep) for t in tensors}
    rep_tensors = {rep[t.name]: t for t in tensors}  # one per representative name
    rnames = list(rep_tensors)
    rdtypes = [dtype[rep_tensors[n].name] for n in rnames]
    rshapes = [tuple(rep_tensors[n].shape) for n in rnames]

    figures: dict[str, Figures] = {}

    # -- reshard (ours) -----------------------------------------------------------
    received = plan.stats.bytes_received[T:]
    assert plan.stats.total_bytes == plan.stats.min_bytes, "reshard moves the floor"
    w_stage, t_stage = reshard_staging(plan, T)
    figures["reshard"] = Figures(max(received), sum(received), 0, w_stage, t_stage)

    # -- nccl (broadcast, packed and not) ----------------------------------------
    # Every worker receives every tensor (nccl_engine.receive_weights); the single
    # sender, trainer rank 0 (NCCLTrainerWeightTransferEngine.trainer_init: owners[0]
    # must be the sender), materializes every full tensor from iter_full().
    rank0 = held[0]
    gather0 = sum(
        nbytes[t.name]
        - held_numel(rank0.get(t.name, []), (0,) * len(t.shape), t.shape) * dtype[t.name].itemsize
        for t in tensors
    )
    chunks = packed_chunks([nbytes[t.name] for t in tensors], DEFAULT_PACKED_BUFFER_SIZE_BYTES)
    packed_stage = DEFAULT_PACKED_NUM_BUFFERS * max(chunks)
    figures["nccl (unpacked)"] = Figures(
        model_bytes, model_bytes * N, gather0, largest, largest, ["staging: >= 1 tensor"]
    )
    figures["nccl (packed)"] = Figures(
        model_bytes, model_bytes * N, gather0, packed_stage, packed_stage, []
    )

    # -- vLLM ranks: one per TP position (replicas are identical) -----------------
    tp = infer.tp
    assert infer.pp == 1, "vLLM pipeline parallel: not covered here"
    m2n_per_pos, rdt_per_pos, unbaked_all = [], [], []
    t1 = time.perf_counter()
    for tp_rank in range(tp):
        rank = EngineRank(
            tp=tp,
            pp=1,
            engine_dp=infer.engine_dp,
            expert_parallel=infer.expert_parallel,
            tp_rank=tp_rank,
        )
        model, _ = build_model(small, rank, "meta", "bfloat16")
        # m2n_engine._prepare_destination_plan: dst mesh (replicas, tp) over all N
        # workers; direct loading only without PP and quantization.
        m2n_per_pos.append(
            m2n_rank(model, rnames, rdtypes, rshapes, N, tp, allow_direct=infer.pp == 1)
        )
        model, _ = build_model(small, rank, "meta", "bfloat16")
        plan_by_name, unbaked = rdt_bake(
            model,
            rnames,
            [str(d).removeprefix("torch.") for d in rdtypes],
            [list(s) for s in rshapes],
        )
        unbaked_all += unbaked
        rdt_per_pos.append(rdt_pull_bytes(plan_by_name))
    t_vllm = time.perf_counter() - t1

    # -- nccl_m2n -------------------------------------------------------------------
    dst_mesh = M2NMesh((N // tp, tp), T)
    w_bytes = [0] * tp
    fallback_names: set[str] = set()
    direct_names: set[str] = set()
    m2n_gather, m2n_trainer_stage = 0, 0
    worker_stage = 0
    placement_of: dict[str, object] = {}
    for t in tensors:
        r = rep[t.name]
        for pos in range(tp):
            direct, placements, b = m2n_per_pos[pos][r]
            w_bytes[pos] += b
            if direct:
                direct_names.add(t.name)
            else:
                fallback_names.add(t.name)
                worker_stage = max(worker_stage, b)
            placement_of[t.name] = placements
    for t in tensors:
        dst = resolve_layout(dst_mesh, placement_of[t.name])
        _, gather, block = m2n_source(t.name, tuple(t.shape), dtype[t.name].itemsize, held, T, dst)
        m2n_gather += gather
        m2n_trainer_stage = max(m2n_trainer_stage, block)
    replicas = N // tp
    figures["nccl_m2n"] = Figures(
        max(w_bytes),
        sum(w_bytes) * replicas,
        m2n_gather,
        worker_stage,
        m2n_trainer_stage,
        [
            f"{len(fallback_names):,} of {len(tensors):,} tensors whole "
            f"({sum(nbytes[n] for n in fallback_names) / model_bytes:.1%} of bytes)"
        ],
        frozenset(fallback_names),
    )

    # -- sharded_rdt ----------------------------------------------------------------
    from vllm.distributed.weight_transfer.base import layerwise_groups

    groups = layerwise_groups([t.name for t in tensors])
    pulls = [sum(rdt_per_pos[pos].get(rep[t.name], 0) for t in tensors) for pos in range(tp)]
    # Worker staging: num_rdt_buffers ring slots, each buffer_alloc_bytes of the largest
    # chunk (sharded_rdt_engine._issue_pull). A chunk is one (group, owner class); with one
    # owner per name the largest chunk is at most the worker's largest group pull.
    ring = ShardedRDTWeightTransferInitInfo.__dataclass_fields__["num_rdt_buffers"].default
    max_chunk = max(
        sum(rdt_per_pos[pos].get(rep[n], 0) for n in g) for g in groups for pos in range(tp)
    )
    # Trainer: every name gathered full on its owner (iter_full); least gather: one
    # owner per name, the rank holding most of it. Resident on an owner: at most
    # gather_lookahead + 1 groups (sharded_rdt_trainer.DEFAULT_GATHER_LOOKAHEAD).
    rdt_gather = 0
    owned_in_group: dict[tuple[int, int], int] = defaultdict(int)
    gi_of = {n: gi for gi, g in enumerate(groups) for n in g}
    for t in tensors:
        full = ((0,) * len(t.shape), tuple(t.shape))
        have = [held_numel(h.get(t.name, []), *full) for h in held]
        owner = max(range(T), key=lambda r: (have[r], -r))
        rdt_gather += nbytes[t.name] - have[owner] * dtype[t.name].itemsize
        owned_in_group[(owner, gi_of[t.name])] += nbytes[t.name]
    per_owner: dict[int, list[int]] = defaultdict(list)
    for (owner, _gi), b in owned_in_group.items():
        per_owner[owner].append(b)
    trainer_rdt = max(
        sum(sorted(v, reverse=True)[: DEFAULT_GATHER_LOOKAHEAD + 1]) for v in per_owner.values()
    )
    figures["sharded_rdt"] = Figures(
        max(pulls),
        sum(pulls) * replicas,
        rdt_gather,
        ring * buffer_alloc_bytes(max_chunk),
        trainer_rdt,
        [f"unbaked live names: {len(set(unbaked_all))}"] if unbaked_all else [],
    )

    minimum = plan.stats.min_bytes
    for f in figures.values():
        f.notes.insert(0, f"{f.worker_total / minimum:.2f}x min")
    print(
        f"<!-- {model_name}: {train_text} -> {infer_text}: T={T}, N={N}, "
        f"min {gib(minimum)}, {len(tensors):,} tensors, dropped (no vLLM rank stores them) "
        f"{len(dropped)}; our plan {t_plan:.0f} s, vLLM builds+bakes {t_vllm:.0f} s "
        f"({tp} ranks, {keep} layer(s)) -->",
        flush=True,
    )
    return figures


def gib(n: int | None) -> str:
    if n is None:
        return "needs a GPU"
    return f"{n / 2**30:,.2f} GiB"


def main() -> None:
    import logging

    logging.getLogger("vllm").setLevel(logging.WARNING)
    which = sys.argv[1:] or [c[0] for c in CASES]
    print(
        "| model | training → inference | engine | worker receives (max) | "
        "all workers | trainer gathers | staging: worker | staging: trainer | notes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model, train, infer, stages in CASES:
        if model not in which:
            continue
        figs = run_case(model, train, infer, stages)
        first = True
        for engine, f in figs.items():
            head = f"| {model} | {train} → {infer} " if first else "| | "
            first = False
            print(
                f"{head}| `{engine}` | {gib(f.worker_max)} | {gib(f.worker_total)} | "
                f"{gib(f.trainer_gather)} | {gib(f.worker_staging)} | "
                f"{gib(f.trainer_staging)} | {'; '.join(f.notes)} |",
                flush=True,
            )


if __name__ == "__main__":
    _reexec_under_vllm_venv()
    sys.path.insert(0, str(ROOT))  # tests.helpers.vllm_cpu builds vLLM's ranks
    main()
