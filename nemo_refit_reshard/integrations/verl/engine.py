"""``reshard``: a veRL checkpoint engine that moves only each rollout GPU's shard.

veRL (0.9.1) runs one engine object in every actor worker and in every rollout
GPU's ``CheckpointEngineWorker``; its ``CheckpointEngineManager`` drives them each
update: ``prepare`` on all, ``build_topology`` on the driver, ``init_process_group``
on all (concurrently), then ``send_weights`` / ``receive_weights``, ``finalize``.

Here ``build_topology`` builds the plan once (the first update; config errors fail
there, before any transfer) and hands each rank its slice; ``init_process_group``
joins our refit group (a stateless gloo or CuPy NCCL group of its own, independent
of veRL's process groups) and compiles, once. ``send_weights`` keeps the yielded
full tensors this actor rank sends (every rank must drain veRL's generator, which
is collective) and replays the plan; ``receive_weights`` replays it and yields, per
canonical tensor this rollout GPU holds a piece of, a full-shape tensor carrying
exactly the received elements.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from ...engine.program import TORCH_DTYPES
from ...integrations.worker import RefitEndpoint, RefitWorker
from ...plan.baseline import BroadcastPlan
from ...plan.overlap import PlanError
from ...plan.rank_plan import RankPlan
from ...spec import load_model_spec
from ..full_tensors import (
    FullTensorPlan,
    ReshardEngineConfig,
    broadcast_bytes,
    broadcast_tensors,
    build_broadcast_plan,
    canonical_tensors,
    plan_full_tensors,
)

_PLANS: dict[tuple[str, int, int], FullTensorPlan] = {}  # driver side: built once per setup


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # not inside Ray: a local run
        return "127.0.0.1"


@CheckpointEngineRegistry.register("reshard")
class ReshardCheckpointEngine(CheckpointEngine):
    """veRL checkpoint engine ``reshard`` (``custom_backend_module:
    nemo_refit_reshard.integrations.verl``; settings in ``engine_kwargs.reshard``)."""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.config = ReshardEngineConfig.from_engine_kwargs(engine_kwargs, bucket_size)
        self.is_master = is_master
        self.address: tuple[str, int] | None = None
        self.worker: RefitWorker | None = None
        self.slice: RankPlan | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.baseline: BroadcastPlan | None = None  # mode "broadcast" only
        self.bytes_sent = self.bytes_received = 0  # per update, this rank
        self.steps = 0

    # -- setup (every update; the group and program are made once) -------------------
    def prepare(self) -> dict[str, Any]:
        if self.is_master and self.address is None:
            host = self.config.host or _node_ip()
            self.address = (host, _free_port(host))
        return {
            "master": self.is_master,
            "address": list(self.address) if self.address else None,
            "config": json.dumps(self.config.as_dict(), sort_keys=True),
        }

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list
    ) -> tuple[dict[str, list], dict[str, list]]:
        a, r = actor_wg_world_size, rollout_world_size
        configs = {m["config"] for m in metadata}
        if len(configs) != 1:
            raise ValueError(
                "checkpoint_engine.engine_kwargs.reshard differs between actor and rollout "
                f"workers ({len(configs)} variants); give every worker the same settings"
            )
        masters = [m["address"] for m in metadata[:a] if m["master"]]
        if len(masters) != 1:
            raise ValueError(f"expected one master actor rank, found {len(masters)}")
        (text,) = configs
        key = (text, a, r)
        if key not in _PLANS:
            _PLANS[key] = plan_full_tensors(ReshardEngineConfig(**json.loads(text)), a, r)
        plan = _PLANS[key]
        config = ReshardEngineConfig(**json.loads(text))
        host, port = masters[0]

        def endpoints(ranks: Iterable[int]) -> list[str]:
            return [
                RefitEndpoint(host, port, a + r, g, config.transport, config.timeout_s).to_json()
                for g in ranks
            ]

        slices = [s.to_json() for s in plan.slices]
        actor = {"endpoint": endpoints(range(a)), "plan": slices[:a]}
        rollout = {"endpoint": endpoints(range(a, a + r)), "plan": slices[a:]}
        return actor, rollout

    def init_process_group(self, endpoint: str, plan: str) -> None:
        ep = RefitEndpoint.from_json(endpoint)
        if self.worker is not None:
            if self.worker.endpoint != ep:
                raise PlanError(
                    f"refit group changed from {self.worker.endpoint} to {ep}; the reshard "
                    "engine keeps one group for the whole run"
                )
            return
        self.slice = rp = RankPlan.from_json(plan)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.config.transport == "cupy-nccl"
            else torch.device("cpu")
        )
        spec = load_model_spec(self.config.model)
        self.shapes = {t.name: t.shape for t in spec}
        me, actor = rp.group_rank, rp.group_rank < rp.num_sources
        wanted = rp.tensors
        if self.config.mode == "broadcast":
            self.baseline = build_broadcast_plan(self.config, rp.num_sources, rp.num_destinations)
            if actor:
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
        self.worker = RefitWorker(ep, self.tensors, device)
        self.worker.join()
        self.worker.load_plan(rp, self.config.mode, self.baseline)

    def finalize(self) -> None:
        """Keeps the group and buffers: the next update replays the same plan."""

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    # -- every update ------------------------------------------------------------------
    async def send_weights(self, weights, global_steps: int | None = None) -> dict[str, Any]:
        if self.worker is None or self.slice is None:
            raise RuntimeError("init_process_group has not run on this actor rank")
        filled: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:  # drain: the generator is collective
                if name not in self.shapes:
                    raise PlanError(
                        f"the actor yielded {name!r}, which {self.config.model!r} has not; "
                        "is engine_kwargs.reshard.model the actor's model?"
                    )
                buf = self.tensors.get(name)
                if buf is not None:
                    buf.copy_(tensor.reshape(buf.shape))
                    filled.add(name)
        missing = sorted(set(self.tensors) - filled)
        if missing:
            raise PlanError(
                f"the actor did not yield {len(missing)} tensor(s) this rank sends, e.g. "
                f"{missing[:4]}; refusing to send stale weights"
            )
        t0 = time.perf_counter()
        timing = await asyncio.get_running_loop().run_in_executor(None, self.worker.refit)
        self.steps += 1
        return {
            "reshard/bytes_sent": float(self.bytes_sent),
            "reshard/seconds": time.perf_counter() - t0,
            "reshard/exchange_seconds": timing.exchange_seconds,
            "reshard/plan": self.slice.fingerprint[:16],
        }

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self.worker is None or self.slice is None:
            raise RuntimeError("init_process_group has not run on this rollout worker")
        await asyncio.get_running_loop().run_in_executor(None, self.worker.refit)
        self.steps += 1
        for name, tensor in canonical_tensors(self.slice, self.tensors, self.shapes):
            yield name, tensor
