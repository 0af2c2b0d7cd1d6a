"""One rank of a checkpoint engine that is handed full tensors (veRL's, NeMo RL's).

Framework-neutral: the veRL and NeMo RL checkpoint engines are thin wrappers that map their
framework's calls onto :class:`CheckpointEngineRank`:

* :meth:`~CheckpointEngineRank.join` — allocate this rank's buffers from its plan
  slice, join the refit group, compile (once per run);
* :meth:`~CheckpointEngineRank.take` then :meth:`~CheckpointEngineRank.replay_send`
  (training side) — drain the framework's full-tensor iterator in its own thread (it is
  collective: every rank must consume it), keep the tensors this rank sends, replay;
* :meth:`~CheckpointEngineRank.receive` (rollout side) — replay into this GPU's vLLM
  shard, then yield, per canonical tensor it holds a piece of, a full-shape tensor
  carrying exactly the received elements (vLLM's loader reads no others for this rank).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ...engine.program import TORCH_DTYPES
from ...layouts.vllm_releases import installed_vllm_version
from ...plan import BroadcastPlan, PlanError, RankPlan
from ..worker import RefitEndpoint, RefitWorker
from .config import ReshardEngineConfig, engine_spec
from .rebuild import canonical_tensors
from .replicated_plans import broadcast_bytes, broadcast_tensors, build_broadcast_plan


def worker_metadata(rank: CheckpointEngineRank, **extra: Any) -> dict[str, Any]:
    """What every worker reports in ``prepare()``: its settings and its vLLM version."""
    return {"config": rank.settings, "vllm": installed_vllm_version(), **extra}


class CheckpointEngineRank:
    """A training or rollout rank of a full-tensor checkpoint engine."""

    def __init__(self, config: ReshardEngineConfig) -> None:
        self.config = config
        self.settings = json.dumps(config.as_dict(), sort_keys=True)
        self.worker: RefitWorker | None = None
        self.slice: RankPlan | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.baseline: BroadcastPlan | None = None  # mode "broadcast" only
        self.bytes_sent = self.bytes_received = 0  # per refit, this rank
        self.steps = 0

    @property
    def joined(self) -> bool:
        return self.worker is not None

    @property
    def group_usable(self) -> bool:
        """Joined, and no refit of the group failed on this rank (a failed one leaves the
        group unusable until a new one is joined)."""
        return self.worker is not None and self.worker.weights.stale is None

    def group_identity(self) -> list[Any] | None:
        """``[host, port, world size, refit rank]`` of the group this rank is in and can
        refit with; None if it is in none, or its group failed."""
        if not self.group_usable:
            return None
        e = self.worker.endpoint  # type: ignore[union-attr]
        return [e.host, e.port, e.world_size, e.group_rank]

    def join(self, endpoint: RefitEndpoint, slice_: RankPlan, settings: str | None = None) -> None:
        """Allocate, rendezvous and compile (collective over the refit group). ``settings``:
        the settings the plan was built with (:func:`~.config.planning_settings`), if they differ
        from this worker's own."""
        if self.worker is not None:
            if self.worker.endpoint == endpoint and self.group_usable:
                return
            # Another group (replicas added or removed, or this one failed): leave it and
            # join the new one afresh, its plan and buffers included.
            self.close()
        if settings is not None:
            self.config = ReshardEngineConfig(**json.loads(settings))
        self.slice = rp = slice_
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.config.transport == "cupy-nccl"
            else torch.device("cpu")
        )
        spec = engine_spec(self.config.model).unquantized()  # what crosses: the trained tensors
        self.shapes = {t.name: t.shape for t in spec}
        me = rp.group_rank
        wanted = rp.tensors
        if self.config.mode == "broadcast":
            self.baseline = build_broadcast_plan(self.config, rp.num_sources, rp.num_destinations)
            if me < rp.num_sources:
                dtype = self.config.train_dtype or spec.arch.dtype
                wanted = broadcast_tensors(self.baseline, me, self.shapes, dtype)
            self.bytes_sent, self.bytes_received = broadcast_bytes(self.baseline, me)
        else:
            self.bytes_sent = sum(m.nbytes for m in rp.messages if m.src == me)
            self.bytes_received = sum(m.nbytes for m in rp.messages if m.dst == me)
        self.tensors = {
            name: torch.zeros(shape, dtype=TORCH_DTYPES[dtype], device=device)
            for name, (shape, dtype) in wanted.items()
        }
        # Delta refit: every rank's settings are the same text, so every rank of the group
        # turns it on alike; an endpoint that says otherwise was built from other settings.
        delta = self.config.delta_options
        if endpoint.delta != delta:
            raise PlanError(
                f"refit rank {me}: the engine's settings say delta={delta}, its endpoint "
                f"{endpoint.delta}; build the endpoints from the settings every rank reported"
            )
        worker = RefitWorker(endpoint, self.tensors, device, delta=delta)
        try:
            worker.join()
            worker.load_plan(rp, self.config.mode, self.baseline)
        except BaseException:
            worker.close()  # a later join starts afresh instead of reusing a half-made group
            raise
        self.worker = worker

    def _ready(self) -> tuple[RefitWorker, RankPlan]:
        if self.worker is None or self.slice is None:
            raise RuntimeError("the refit group is not joined on this rank yet")
        return self.worker, self.slice

    def take(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Drain ``weights`` (in the caller's thread: the framework's iterator may run
        collectives) and keep the tensors this rank sends."""
        self._ready()
        filled: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:  # drain: the iterator is collective
                if name not in self.shapes:
                    raise PlanError(
                        f"the trainer yielded {name!r}, which {self.config.model!r} has not; "
                        "is the engine's model the policy's model?"
                    )
                buf = self.tensors.get(name)
                if buf is not None:
                    if tuple(tensor.shape) != tuple(buf.shape):
                        raise PlanError(
                            f"the trainer yielded {name!r} with shape {list(tensor.shape)}; "
                            f"the plan expects {list(buf.shape)}"
                        )
                    buf.copy_(tensor)
                    filled.add(name)
        missing = sorted(set(self.tensors) - filled)
        if missing:
            raise PlanError(
                f"the trainer did not yield {len(missing)} tensor(s) this rank sends, e.g. "
                f"{missing[:4]}; refusing to send stale weights"
            )

    def replay_send(self) -> dict[str, Any]:
        """Replay this training rank's program (blocking); its metrics."""
        worker, rp = self._ready()
        t0 = time.perf_counter()
        timing = worker.refit()
        self.steps += 1
        metrics: dict[str, Any] = {
            "reshard/bytes_sent": float(self.bytes_sent),
            "reshard/seconds": time.perf_counter() - t0,
            "reshard/exchange_seconds": timing.exchange_seconds,
            "reshard/plan": rp.fingerprint[:16],
        }
        stats = self.delta_stats()
        if stats is not None:  # what this rank sent, and what it would have sent dense
            metrics["reshard/delta_sent_bytes"] = float(stats["sent_bytes"])
            metrics["reshard/delta_dense_bytes"] = float(stats["dense_bytes"])
            metrics["reshard/delta_version"] = float(stats["version"])
        return metrics

    def delta_stats(self) -> dict[str, Any] | None:
        """This rank's last delta step (``DeltaStats`` as a dict), None without delta."""
        refitter = self.worker.refitter if self.worker is not None else None
        if refitter is None or refitter.delta is None:
            return None
        return dataclasses.asdict(refitter.delta.last)

    def receive(self, reuse_scratch: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Rollout side: replay (blocking), then the rebuilt canonical tensors; one scratch
        tensor per shape and dtype unless ``reuse_scratch`` is False (a consumer that
        holds the yields, as veRL's SGLang adapter does: ``rebuild.canonical_tensors``)."""
        worker, rp = self._ready()
        worker.refit()
        self.steps += 1
        return canonical_tensors(rp, self.tensors, self.shapes, reuse_scratch=reuse_scratch)

    def close(self) -> None:
        """Leave the group and free the buffers (a later :meth:`join` makes them anew)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        self.tensors, self.slice, self.baseline = {}, None, None
