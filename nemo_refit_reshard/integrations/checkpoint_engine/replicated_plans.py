"""Plans for checkpoint engines that are handed full tensors (veRL's, NeMo RL's).

veRL and NeMo RL's checkpoint-engine route hand every training rank the *full* HF
tensors (FSDP ``full_tensor()``, Megatron-Bridge ``export_hf_weights``) and expect
every rollout GPU's engine to yield named tensors for vLLM's ``load_weights``. The
plan therefore has:

* sources: ``A`` actor ranks, each holding every canonical tensor whole — replicas of
  one another (:func:`replicated_layout`), so the planner spreads the sending over all
  of them;
* destinations: the rollout GPUs' shards, ``R`` ranks: vLLM's (``vllm_layouts``), or
  SGLang's with ``infer_engine: sglang`` (``layouts.refit.engine_layouts``;
  :func:`sglang_rollout_layouts` adds what veRL's SGLang adapter can carry).

A rollout rank receives only its shard's elements and rebuilds the full-shape tensors
vLLM's loader takes from them (``rebuild.py``).

A rollout that serves FP8 (veRL's ``rollout.quantization: fp8``, or a block-FP8
checkpoint) still loads the trained tensors: its loader quantizes each full-shape
tensor it is handed in 128×128 blocks (veRL's ``load_quanted_weights``) and keeps its
shard's blocks. A block's e4m3 values and scale depend on that block alone, so the
rebuilt tensor quantizes to the right blocks iff the rank's shard is whole blocks:
vLLM's own FP8 layouts (``vllm_fp8.py``) require exactly that, and planning checks
them (:func:`check_fp8_shards`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from ...engine.program import TORCH_DTYPES
from ...layouts import RankLayout, Replicate, VllmOptions, dtensor_layout, vllm_layouts
from ...layouts.refit import engine_layouts as infer_engine_layouts
from ...plan import BroadcastPlan, RankPlan, RefitPlan, plan_broadcast, plan_refit, rank_plan
from ...spec import InferParallel, ModelSpec
from ...spec.quantization import BlockFp8, quantized_module
from .config import ReshardEngineConfig, engine_spec


@dataclass(frozen=True)
class FullTensorPlan:
    """The plan for ``A`` actor ranks and ``R`` rollout GPUs, and each rank's slice."""

    plan: RefitPlan
    infer: InferParallel
    slices: tuple[RankPlan, ...]  # refit rank order: actors 0..A-1, then rollout GPUs
    broadcast_bytes: int  # what a full-tensor broadcast to every rollout GPU moves

    @property
    def bytes(self) -> int:
        return sum(m.nbytes for s in self.slices for m in s.messages if m.src == s.group_rank)

    @cached_property
    def slices_json(self) -> tuple[str, ...]:
        """Every slice as JSON, made once (a driver ships them to the workers every
        update)."""
        return tuple(s.to_json() for s in self.slices)


def replicated_layout(spec: ModelSpec, world: int, rank: int, dtype: str | None) -> RankLayout:
    """Actor rank ``rank`` of ``world`` holding every canonical tensor whole (a DTensor
    replicated over the actors), in ``dtype`` (None: the checkpoint's)."""
    layout = dtensor_layout(spec, (world,), rank, lambda _t: (Replicate(),))
    if dtype is None:
        return layout
    return dataclasses.replace(
        layout, tensors=tuple(dataclasses.replace(t, dtype=dtype) for t in layout.tensors)
    )


def rollout_parallel(config: ReshardEngineConfig, rollout_world: int) -> InferParallel:
    """The rollout's whole parallelism: one replica's (``config.infer``) times the
    replicas ``rollout_world`` GPUs make."""
    one = InferParallel.parse(config.infer)
    if one.dp != 1:
        raise ValueError(
            f"infer={config.infer!r}: give one replica's parallelism "
            "without dp; the number of replicas follows from the rollout workers"
        )
    if rollout_world % one.engine_world_size:
        raise ValueError(
            f"{rollout_world} rollout workers are not a whole number of replicas of "
            f"infer={config.infer!r} ({one.engine_world_size} GPUs each); set the engine's "
            "infer to the rollout's tensor/pipeline/data parallel sizes"
        )
    return dataclasses.replace(one, dp=rollout_world // one.engine_world_size)


def _sent_only(slice_: RankPlan) -> RankPlan:
    """An actor rank keeps only the tensors it sends (it is handed all of them)."""
    used = {
        t.src_tensor for m in slice_.messages if m.src == slice_.group_rank for t in m.transfers
    }
    return dataclasses.replace(
        slice_, tensors={k: v for k, v in slice_.tensors.items() if k in used}
    )


def served_quantization(spec: ModelSpec, config: ReshardEngineConfig) -> BlockFp8 | None:
    """How the rollout quantizes what it loads: the checkpoint's block FP8, else, with
    ``quantization: fp8``, veRL's (128×128 blocks, every MoE router left unquantized:
    ``vllm_async_server._apply_quantization``); None for an unquantized rollout."""
    if spec.arch.quant is not None:
        return spec.arch.quant
    if config.quantization != "fp8":
        return None
    routers = {
        m
        for t in spec
        if (m := quantized_module(t.name, spec.arch.family)) and m.endswith(".mlp.gate")
    }
    return BlockFp8((128, 128), frozenset(routers))


def check_fp8_shards(
    spec: ModelSpec, quant: BlockFp8, infer: InferParallel, opts: VllmOptions
) -> None:
    """Refuse an FP8 rollout whose shards are not whole blocks (its loader's blocks would
    mix this rank's elements with others' it never received)."""
    try:
        vllm_layouts(spec.quantized(quant), infer, opts)
    except ValueError as err:
        raise ValueError(f"the rollout serves {spec.name} as {quant} at {infer}: {err}") from None


def sglang_rollout_layouts(
    checkpoint: ModelSpec, infer: InferParallel, opts: VllmOptions
) -> list[RankLayout]:
    """The rollout GPUs' SGLang layouts of ``checkpoint``'s trained tensors, refusing what
    veRL's SGLang adapter cannot carry. That adapter (``sglang_rollout.ServerAdapter.
    update_weights`` -> ``sglang.srt.weight_sync.utils.update_weights``) gathers every TP
    rank's bucket to TP rank 0 and names the i-th tensor of every rank by rank 0's i-th
    name (``zip(*gathered, strict=True)``): every rank of a replica must yield the same
    names in the same order. :func:`~.rebuild.canonical_tensors` yields, sorted by
    name, the canonical tensors a rank holds pieces of, so the rule is: every rank of
    a replica holds pieces of the same canonical tensors."""
    if checkpoint.arch.quant is not None:
        raise ValueError(
            f"{checkpoint.name} is a block-FP8 checkpoint: FP8 SGLang rollouts are not "
            "covered by the reshard engine; serve BF16 weights, or use a vLLM rollout"
        )
    if infer.expert_parallel:
        raise ValueError(
            f"SGLang expert parallelism (ep={infer.ep}) cannot go through veRL's SGLang "
            "adapter: it names every TP rank's tensors by TP rank 0's names (sglang's "
            "weight_sync update_weights zips them), and under ep each rank receives "
            "other experts; set rollout.expert_parallel_size=1 and drop ep from the "
            "engine's infer (SGLang then slices every expert over tp)"
        )
    if infer.engine_dp > 1:
        raise ValueError(
            f"SGLang data-parallel attention (engine_dp={infer.engine_dp}: veRL passes "
            "rollout.data_parallel_size as SGLang's dp_size, with tp_size = tp·dp) is not "
            "covered; set rollout.data_parallel_size=1 and drop engine_dp from the engine's "
            "infer (more rollout GPUs make more replicas)"
        )
    if infer.pp > 1:
        raise ValueError(
            f"SGLang pipeline parallelism (pp={infer.pp}) cannot go through veRL's SGLang "
            "adapter: it names a replica's tensors by TP rank 0's over its TP group, and "
            "pipeline stages hold other tensors; drop pp for SGLang"
        )
    spec = checkpoint.unquantized()
    try:
        layouts = infer_engine_layouts(spec, infer, "sglang", opts)
    except ValueError as err:
        raise ValueError(f"SGLang rollout at {infer}: {err}") from None
    n = infer.engine_world_size  # a replica: its ranks in order (pp and engine_dp are 1)
    first = [sorted({p.canonical for p in lay.pieces()}) for lay in layouts[:n]]
    for rank, names in enumerate(first[1:], 1):
        if names != first[0]:
            odd = sorted(set(names) ^ set(first[0]))
            raise ValueError(
                f"SGLang at {infer}: tp rank {rank} holds pieces of other tensors than tp "
                f"rank 0 (e.g. {odd[:3]}), and veRL's SGLang adapter names every rank's "
                "tensors by rank 0's; use a tp whose every rank holds part of every tensor"
            )
    return layouts


def engine_layouts(
    config: ReshardEngineConfig, actor_world: int, rollout_world: int
) -> tuple[ModelSpec, InferParallel, list[RankLayout], list[RankLayout]]:
    """The model as trained, the rollout's parallelism, the replicated actor layouts
    (sources) and the rollout GPUs' layouts of the trained tensors (destinations: what
    their loader takes, FP8 vLLM rollouts included): vLLM's, or SGLang's with
    ``infer_engine: sglang``."""
    checkpoint = engine_spec(config.model)
    spec = checkpoint.unquantized()
    infer = rollout_parallel(config, rollout_world)
    sources = [
        replicated_layout(spec, actor_world, r, config.train_dtype) for r in range(actor_world)
    ]
    opts = VllmOptions(params_dtype=config.infer_dtype, vllm_version=config.vllm_version)
    if config.infer_engine == "sglang":
        return spec, infer, sources, sglang_rollout_layouts(checkpoint, infer, opts)
    quant = served_quantization(checkpoint, config)
    if quant is not None:
        check_fp8_shards(spec, quant, infer, opts)
    return spec, infer, sources, vllm_layouts(spec, infer, opts)


def build_broadcast_plan(
    config: ReshardEngineConfig, actor_world: int, rollout_world: int
) -> BroadcastPlan:
    """The gather-broadcast baseline over the same layouts (every worker builds it: it is
    deterministic). With every actor rank holding every tensor, actor rank 0 roots them
    all and sends each full tensor to every rollout GPU that needs part of it — what
    veRL's ``nccl`` engine does."""
    spec, _, sources, destinations = engine_layouts(config, actor_world, rollout_world)
    return plan_broadcast(spec, sources, destinations, bucket_mb=config.bucket_mb or 512)


def broadcast_tensors(
    bp: BroadcastPlan, group_rank: int, shapes: Mapping[str, tuple[int, ...]], dtype: str
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Source tensors an actor rank needs for the baseline: those it gathers from."""
    names = {
        name
        for steps in bp.rounds
        for st in steps
        for holder, name, _, _ in st.gathers
        if holder == group_rank
    }
    return {n: (tuple(shapes[n]), dtype) for n in names}


def broadcast_bytes(bp: BroadcastPlan, group_rank: int) -> tuple[int, int]:
    """Bytes ``group_rank`` sends and receives in the baseline (its gathers are local)."""
    d = group_rank - bp.num_sources
    rounds = [st for steps in bp.rounds for st in steps]
    sent = sum(st.nbytes * len(st.readers) for st in rounds if st.root == group_rank)
    received = sum(st.nbytes for st in rounds if any(r == d for r, _ in st.readers))
    return sent, received


def plan_full_tensors(
    config: ReshardEngineConfig, actor_world: int, rollout_world: int
) -> FullTensorPlan:
    """Plan once (on veRL's driver): every config error surfaces here, before any transfer."""
    spec, infer, sources, destinations = engine_layouts(config, actor_world, rollout_world)
    plan = plan_refit(spec, sources, destinations, bucket_mb=config.bucket_mb or 512)
    slices = [rank_plan(plan, r) for r in range(actor_world + rollout_world)]
    slices[:actor_world] = [_sent_only(s) for s in slices[:actor_world]]
    dtype = config.infer_dtype or spec.arch.dtype
    item = torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
    per_gpu = sum(t.numel for t in spec) * item
    return FullTensorPlan(plan, infer, tuple(slices), broadcast_bytes=rollout_world * per_gpu)
