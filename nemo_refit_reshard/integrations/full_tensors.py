"""Plans for checkpoint engines that are handed full tensors (veRL's, NeMo RL's).

veRL and NeMo RL's checkpoint-engine route hand every training rank the *full* HF
tensors (FSDP ``full_tensor()``, Megatron-Bridge ``export_hf_weights``) and expect
every rollout GPU's engine to yield named tensors for vLLM's ``load_weights``. The
plan therefore has:

* sources: ``A`` actor ranks, each holding every canonical tensor whole — replicas of
  one another, so the planner spreads the sending over all of them;
* destinations: the rollout GPUs' vLLM shards (``vllm_layouts``), ``R`` ranks.

A rollout rank receives only its shard's elements and rebuilds, per canonical
tensor it holds a piece of, a full-shape tensor whose pieces hold the received
values (:func:`canonical_tensors`): vLLM's loader reads exactly those elements
(``tests/test_vllm_truth.py`` proves it for every piece).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..engine.program import TORCH_DTYPES
from ..layouts import Replicate, VllmOptions, dtensor_layout, vllm_layouts
from ..layouts.base import Box, RankLayout
from ..plan import BroadcastPlan, RankPlan, RefitPlan, plan_broadcast, plan_refit, rank_plan
from ..spec import InferParallel, ModelSpec, load_model_spec
from .worker import TRANSPORTS

MODES = ("reshard", "broadcast")


@dataclass(frozen=True)
class ReshardEngineConfig:
    """The engine's settings (veRL: ``checkpoint_engine.engine_kwargs.reshard``; NeMo RL:
    ``policy.generation.refit_cfg["<module>:<Class>"]``).

    ``model``: HF model directory (or its config.json, or a preset name).
    ``infer``: one rollout replica's vLLM parallelism, ``tp=,pp=,engine_dp=,ep=``; the
    number of replicas follows from the rollout world size. ``train_dtype``: dtype of
    the tensors the actor yields; ``infer_dtype``: vLLM's parameter dtype (both default
    to the checkpoint's). ``transport``: ``gloo`` (CPU) or ``cupy-nccl`` (GPUs).
    ``bucket_mb``: bytes per round (default: ``update_weights_bucket_megabytes``).
    """

    model: str
    infer: str = "tp=1"
    train_dtype: str | None = None
    infer_dtype: str | None = None
    vllm_version: str | None = None
    transport: str = "gloo"
    timeout_s: float = 600.0
    bucket_mb: float | None = None
    host: str | None = None
    mode: str = "reshard"  # or "broadcast": the gather-broadcast baseline, for comparison

    @classmethod
    def from_engine_kwargs(
        cls,
        kwargs: Mapping[str, Any],
        bucket_size: int,
        where: str = "checkpoint_engine.engine_kwargs.reshard",
    ) -> ReshardEngineConfig:
        """``where`` names the settings' place in the framework's config, for errors."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"{where} has unknown key(s) {unknown}; known: {sorted(known)}")
        if "model" not in kwargs:
            raise ValueError(
                f"{where}.model is required: the HF model path (the policy's model) or a "
                "preset name"
            )
        config = cls(**kwargs)
        if config.transport not in TRANSPORTS:
            raise ValueError(f"{where}.transport={config.transport!r}; choose from {TRANSPORTS}")
        if config.mode not in MODES:
            raise ValueError(f"{where}.mode={config.mode!r}; choose from {MODES}")
        if config.bucket_mb is None:
            config = dataclasses.replace(config, bucket_mb=bucket_size / 2**20)
        return config

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


def _replicated(spec: ModelSpec, world: int, rank: int, dtype: str | None) -> RankLayout:
    layout = dtensor_layout(spec, (world,), rank, lambda _t: (Replicate(),))
    if dtype is None:
        return layout
    return dataclasses.replace(
        layout, tensors=tuple(dataclasses.replace(t, dtype=dtype) for t in layout.tensors)
    )


def rollout_parallel(config: ReshardEngineConfig, rollout_world: int) -> InferParallel:
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


def engine_spec(model: str) -> ModelSpec:
    """The model the engine plans for: a preset, a ``config.json`` path or folder, or a
    HuggingFace repo id (its ``config.json`` through the local HuggingFace cache, as the
    framework itself loaded the model)."""
    try:
        return load_model_spec(model)
    except ValueError as err:
        if model.count("/") != 1 or model.startswith((".", "/")):
            raise
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(model, "config.json")
        except Exception as hub_err:
            raise ValueError(f"{err}; as a HuggingFace repo id: {hub_err}") from None
        return load_model_spec(path)


def _layouts(
    config: ReshardEngineConfig, actor_world: int, rollout_world: int
) -> tuple[ModelSpec, InferParallel, list[RankLayout], list[RankLayout]]:
    spec = engine_spec(config.model)
    infer = rollout_parallel(config, rollout_world)
    sources = [_replicated(spec, actor_world, r, config.train_dtype) for r in range(actor_world)]
    opts = VllmOptions(params_dtype=config.infer_dtype, vllm_version=config.vllm_version)
    return spec, infer, sources, vllm_layouts(spec, infer, opts)


def build_broadcast_plan(
    config: ReshardEngineConfig, actor_world: int, rollout_world: int
) -> BroadcastPlan:
    """The gather-broadcast baseline over the same layouts (every worker builds it: it is
    deterministic). With every actor rank holding every tensor, actor rank 0 roots them
    all and sends each full tensor to every rollout GPU that needs part of it — what
    veRL's ``nccl`` engine does."""
    spec, _, sources, destinations = _layouts(config, actor_world, rollout_world)
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
    spec, infer, sources, destinations = _layouts(config, actor_world, rollout_world)
    plan = plan_refit(spec, sources, destinations, bucket_mb=config.bucket_mb or 512)
    slices = [rank_plan(plan, r) for r in range(actor_world + rollout_world)]
    slices[:actor_world] = [_sent_only(s) for s in slices[:actor_world]]
    dtype = config.infer_dtype or spec.arch.dtype
    item = torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
    per_gpu = sum(t.numel for t in spec) * item
    return FullTensorPlan(plan, infer, tuple(slices), broadcast_bytes=rollout_world * per_gpu)


def canonical_tensors(
    slice_: RankPlan, local: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """For a rollout rank: each canonical tensor it received a piece of, full-shape, with
    the received values at their canonical boxes. Other elements are unspecified (zeros,
    or a previous tensor's values): vLLM's loader never reads them for this rank. One
    scratch tensor per shape and dtype is reused: the consumer must copy or load each
    tensor before asking for the next, as veRL's and NeMo RL's do."""
    boxes: dict[str, list[tuple[Box, str, Box]]] = {}
    me = slice_.group_rank
    for m in slice_.messages:
        if m.dst != me:
            continue
        for t in m.transfers:
            boxes.setdefault(t.canonical, []).append((t.canonical_box, t.dst_tensor, t.dst_box))
    scratch: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
    for name in sorted(boxes):
        first = local[boxes[name][0][1]]
        key = (tuple(shapes[name]), first.dtype)
        out = scratch.get(key)
        if out is None:
            out = scratch[key] = torch.zeros(key[0], dtype=first.dtype, device=first.device)
        for cbox, tensor, dbox in boxes[name]:
            out[cbox.slices()] = local[tensor][dbox.slices()].reshape(cbox.sizes)
        yield name, out
