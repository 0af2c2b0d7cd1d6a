"""``reshard``: a veRL checkpoint engine that moves only each rollout GPU's shard.

veRL (0.9.1) runs one checkpoint-engine object in every actor worker and in every rollout
GPU's ``CheckpointEngineWorker``; its ``CheckpointEngineManager`` drives them each
update: ``prepare`` on all, ``build_topology`` on the driver, ``init_process_group``
on all (concurrently), then ``send_weights`` / ``receive_weights``, ``finalize``.

Here ``build_topology`` builds the plan once per world size (the first update; config
errors fail there, before any transfer) and hands each rank its slice;
``init_process_group`` joins our refit group (a stateless gloo or CuPy NCCL group of its
own, independent of veRL's process groups) and compiles, once per group. The group
changes when veRL's ``remove_replicas`` / ``add_replicas`` change the rollout ranks or an
update failed: every rank then joins the new group actor rank 0 offered in ``prepare``.
Sending and receiving are
:class:`~nemo_refit_reshard.integrations.checkpoint_engine.CheckpointEngineRank`'s.
With ``delta: true`` in the settings every endpoint carries the delta options
(``engine/delta/program.py``): each update sends each message in its smallest form. A rollout
rank re-packs from its own receive buffers (they persist across updates, whatever vLLM
does with its weights), so vLLM's sleep needs nothing here.

With ``infer_engine: sglang`` (``rollout.name=sglang``) the plan delivers SGLang's shards
and every yield is a distinct tensor: veRL's SGLang adapter holds whole buckets of them
(``rollout_engine.py``). veRL's own SGLang calls around an update (abort, kv-cache
release and resume, ``flush_cache``) are the manager's and the adapter's; this engine
adds none.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from ...engine.rendezvous import Rendezvous
from ...plan import RankPlan
from ..checkpoint_engine import (
    CheckpointEngineRank,
    ReshardEngineConfig,
    cached_plan,
    check_same_settings,
    group_rendezvous,
    planning_settings,
    worker_metadata,
)
from ..worker import RefitEndpoint
from .rollout_engine import check_rollout_engine, loaded_rollout_engines, reuses_scratch

WHERE = "checkpoint_engine.engine_kwargs.reshard"


@CheckpointEngineRegistry.register("reshard")
class ReshardCheckpointEngine(CheckpointEngine):
    """veRL checkpoint engine ``reshard`` (``custom_backend_module:
    nemo_refit_reshard.integrations.verl``; settings in ``engine_kwargs.reshard``)."""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.rank = CheckpointEngineRank(
            ReshardEngineConfig.from_engine_kwargs(engine_kwargs, bucket_size, WHERE)
        )
        self.config = self.rank.config
        self.is_master = is_master
        self.rendezvous: Rendezvous | None = None  # the master's group's
        self.spare: Rendezvous | None = None  # the master's offer of a new group

    @property
    def bytes_received(self) -> int:
        return self.rank.bytes_received

    # -- setup (every update; the group and program are made once per group) ---------
    def prepare(self) -> dict[str, Any]:
        # The master offers the group it is in and a new one (``build_topology`` picks):
        # the replicas can change between updates (veRL's add_replicas/remove_replicas)
        # and a failed update leaves the group unusable; either way everyone joins anew.
        spare = None
        if self.is_master:
            if self.rendezvous is None:
                self.rendezvous = group_rendezvous(self.config.host)
            spare = self.spare = group_rendezvous(self.config.host)
        r = self.rendezvous
        return worker_metadata(
            self.rank,
            master=self.is_master,
            address=[r.ip, r.port] if r else None,
            secret=r.secret if r else None,
            spare_address=[spare.ip, spare.port] if spare else None,
            spare_secret=spare.secret if spare else None,
            group=self.rank.group_identity(),
            rollout_engines=loaded_rollout_engines(),
        )

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list
    ) -> tuple[dict[str, list], dict[str, list]]:
        a, r = actor_wg_world_size, rollout_world_size
        text = planning_settings(check_same_settings(metadata, WHERE), metadata[a:])
        masters = [m for m in metadata[:a] if m["master"]]
        if len(masters) != 1:
            raise ValueError(f"expected one master actor rank, found {len(masters)}")
        config = ReshardEngineConfig(**json.loads(text))
        check_rollout_engine(config.infer_engine, metadata[a:], WHERE)
        # The first update plans; later ones reuse the plan and its slices' JSON.
        slices = cached_plan(text, a, r).slices_json
        # The group stays from update to update while every rank is in it, whole, with
        # this world size; otherwise (a replica added or removed, an update that failed)
        # every rank joins the master's new one. Shipped with each endpoint.
        master = masters[0]
        (ip, port), secret = master["address"], master["secret"]
        # (each rank at the refit rank its place in the metadata gives it: a replica
        # removed and added back may come back elsewhere in the list)
        if any(m.get("group") != [ip, port, a + r, g] for g, m in enumerate(metadata)):
            (ip, port), secret = master["spare_address"], master["spare_secret"]

        delta = config.delta_options  # delta refit travels with every rank's endpoint

        def endpoints(ranks: Iterable[int]) -> list[str]:
            return [
                RefitEndpoint(
                    ip, port, a + r, g, config.transport, config.timeout_s, secret=secret,
                    delta=delta,
                ).to_json()
                for g in ranks
            ]  # fmt: skip

        actor = {"endpoint": endpoints(range(a)), "plan": list(slices[:a]), "settings": [text] * a}
        rollout = {
            "endpoint": endpoints(range(a, a + r)),
            "plan": list(slices[a:]),
            "settings": [text] * r,
        }
        return actor, rollout

    def init_process_group(self, endpoint: str, plan: str, settings: str) -> None:
        """Join the group (kept while it stays the same: the program is made once per
        group)."""
        point = RefitEndpoint.from_json(endpoint)
        if self.rank.joined and self.rank.worker.endpoint == point and self.rank.group_usable:  # type: ignore[union-attr]
            return
        if self.is_master and self.spare is not None and point.port == self.spare.port:
            self.rendezvous = self.spare  # the master's store serves the new group
        self.rank.join(point, RankPlan.from_json(plan), settings)

    def delta_stats(self) -> dict[str, Any] | None:
        """This rank's last delta update (``DeltaStats`` fields: ``sent_bytes``,
        ``dense_bytes``, ``forms``, ``received``, ...); None without ``delta``. veRL's
        metrics carry one actor rank's (``reshard/delta_sent_bytes``, ...); ask every
        rank with ``execute_checkpoint_engine(["delta_stats"] * n)``."""
        return self.rank.delta_stats()

    def finalize(self) -> None:
        """Keeps the group and buffers: the next update replays the same plan."""

    def close(self) -> None:
        self.rank.close()

    # -- every update ------------------------------------------------------------------
    async def send_weights(self, weights, global_steps: int | None = None) -> dict[str, Any]:
        self.rank.take(weights)  # in veRL's thread: the generator runs collectives
        return await asyncio.get_running_loop().run_in_executor(None, self.rank.replay_send)

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        receive = functools.partial(self.rank.receive, reuse_scratch=self.reuse_scratch)
        tensors = await asyncio.get_running_loop().run_in_executor(None, receive)
        for name, tensor in tensors:
            yield name, tensor

    @property
    def reuse_scratch(self) -> bool:
        """Whether the rollout's adapter copies each yield before asking for the next
        (vLLM's) or holds buckets of them (SGLang's): ``rollout_engine.reuses_scratch``."""
        return reuses_scratch(self.rank.config.infer_engine)
