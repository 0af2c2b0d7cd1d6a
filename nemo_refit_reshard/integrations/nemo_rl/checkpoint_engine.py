"""Drop-in NeMo RL checkpoint engine: ``refit_transport: "<this module>:ReshardCheckpointEngine"``.

NeMo RL's checkpoint-engine route (``policy.generation.refit_transport`` naming a
``module:ClassName``) creates one checkpoint engine in every policy worker and in every vLLM
worker. Its ``CheckpointEngineWeightSynchronizer`` calls ``prepare`` on all, then
``init_policy_process_group`` / ``init_rollout_process_group`` with every worker's
metadata (policy ranks first, sorted), and each refit ``send_weights`` (the policy's
full HF tensors, every rank iterating all of them) with
``receive_weight_batches`` (each batch goes to vLLM's ``load_weights``).

Every worker builds the same plan from the same settings (deterministic; the
fingerprints are compared before the first refit) and joins our refit group — a
gloo or CuPy NCCL group of its own at policy rank 0's address. Each vLLM rank
receives only the elements of its shard; what reaches ``load_weights`` writes
exactly those elements.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch
from nemo_rl.utils.checkpoint_engines.base import CheckpointEngine

from ...engine.rendezvous import Rendezvous
from ..checkpoint_engine import (
    CheckpointEngineRank,
    ReshardEngineConfig,
    cached_plan,
    check_same_settings,
    offered_rendezvous,
    planning_settings,
    worker_metadata,
)
from ..worker import RefitEndpoint

ENGINE = "nemo_refit_reshard.integrations.nemo_rl:ReshardCheckpointEngine"
WHERE = f'policy.generation.refit_cfg["{ENGINE}"]'


class ReshardCheckpointEngine(CheckpointEngine):
    """NeMo RL checkpoint engine moving each vLLM rank's shard only."""

    shard_expert_weights = False

    def __init__(
        self, bucket_size: int, release_after_refit: bool = False, **engine_kwargs: Any
    ) -> None:
        self.rank = CheckpointEngineRank(
            # NeMo RL takes a checkpoint engine for its vLLM generation only
            # (``refit_transport`` is refused for its SGLang backend).
            ReshardEngineConfig.from_engine_kwargs(engine_kwargs, bucket_size, WHERE, ("vllm",))
        )
        self.config = self.rank.config
        self.release_after_refit = release_after_refit
        self.rendezvous: Rendezvous | None = None  # offered; policy rank 0's is used
        self.last_metrics: dict[str, Any] = {}

    def prepare(self) -> dict[str, Any]:
        # Every worker offers a rendezvous; policy rank 0's is used (metadata[0]). A worker
        # cannot bind another node's configured IP: it offers none.
        if self.rendezvous is None:
            self.rendezvous = offered_rendezvous(self.config.host)
        # NeMo RL's synchronizer hands every worker all workers' metadata; policy rank 0's
        # address and secret are used.
        r = self.rendezvous
        address = [r.ip, r.port] if r else None
        return worker_metadata(self.rank, address=address, secret=r.secret if r else None)

    def _join(self, group_rank: int, train: int, rollout: int, metadata: list[Any]) -> None:
        if len(metadata) != train + rollout:
            raise ValueError(
                f"expected metadata from {train} policy + {rollout} rollout workers, got "
                f"{len(metadata)}"
            )
        text = planning_settings(check_same_settings(metadata, WHERE), metadata[train:])
        plan = cached_plan(text, train, rollout)  # per process: built once
        if metadata[0]["address"] is None:
            raise ValueError(
                f"{WHERE}.host={self.config.host!r} is not an address of policy rank 0's "
                "node, which hosts the refit group: set it to that node's address, or leave "
                "it unset (each node's own)"
            )
        ip, port = metadata[0]["address"]
        endpoint = RefitEndpoint(
            ip, port, train + rollout, group_rank, self.config.transport, self.config.timeout_s,
            secret=metadata[0]["secret"],
            delta=self.config.delta_options,  # the settings every worker checked alike
        )  # fmt: skip
        self.rank.join(endpoint, plan.slices[group_rank], text)

    def init_policy_process_group(
        self, *, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list
    ) -> None:
        self._join(worker_rank, train_world_size, rollout_world_size, metadata)

    def init_rollout_process_group(
        self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list
    ) -> None:
        self._join(train_world_size + rollout_rank, train_world_size, rollout_world_size, metadata)

    def finalize(self) -> None:
        """Keeps the group for the next refit, unless ``release_after_refit``."""
        if self.release_after_refit:
            self.rank.close()
            self.rendezvous = None

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        self.rank.take(weights)  # in NeMo RL's thread: the export runs collectives
        loop = asyncio.get_running_loop()
        self.last_metrics = await loop.run_in_executor(None, self.rank.replay_send)

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        tensors = await asyncio.get_running_loop().run_in_executor(None, self.rank.receive)
        # One tensor per batch: the rebuilt tensors share scratch buffers, and NeMo RL
        # loads each batch before asking for the next.
        for name, tensor in tensors:
            yield [(name, tensor)]
