"""The Ray actors of the GRPO run: training ranks and generation ranks.

Plain classes (``ray.remote`` is applied by the driver, so this module imports without
Ray). Each actor is one process with one torch thread. Training actors form one gloo
world (Megatron's tp/pp/dp groups live inside it); the tp ranks of each generation
replica form their own gloo world, which is the generator's tp group. All of them also
join one refit group (a stateless gloo group over a ``TCPStore``, see
``integrations/worker``): training rank ``r`` is refit rank ``r``, inference rank
``d`` is refit rank ``S + d``.

Setup is a method, not ``__init__``: an error while building a model then comes back to
the driver as an ordinary exception naming the actor, instead of a dead actor.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..engine.checksum import Checksums, receiver_checksums, sender_checksums
from ..engine.program import TORCH_DTYPES
from ..engine.refit import Refitter
from ..integrations.worker import RefitEndpoint, RefitWorker, describe_tensors
from ..plan import RankPlan
from ..spec.parallel import InferParallel, TrainParallel
from .plans import broadcast_plan_from_json
from .task import policy_spec
from .trainer import GrpoConfig


def _quiet_process() -> None:
    # One thread per actor: several actors share two cores, and oversubscribed torch
    # thread pools make every collective wait on descheduled peers.
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # megatron's Transformer-Engine/Apex fallback notices


def _init_world(port: int, rank: int, world_size: int, timeout_s: float) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


class _RefitMember:
    """What training and generation actors share: refit group, plans, checksums."""

    def __init__(self) -> None:
        self.group_rank = -1
        self.worker: RefitWorker | None = None
        self.slice: RankPlan | None = None
        self.refitters: dict[str, Refitter] = {}
        self.exit_at_step: int | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}

    def _tensors(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return describe_tensors(self._tensors())

    def join(self, endpoint_json: str) -> None:
        endpoint = RefitEndpoint.from_json(endpoint_json)
        self.group_rank = endpoint.group_rank
        self.worker = RefitWorker(endpoint, self._tensors())
        self.worker.join()

    def load_plans(self, slice_json: str, broadcast_json: str | None, backends: list[str]) -> None:
        """Compile one program per backend over the same live tensors (collective)."""
        if self.worker is None:
            raise RuntimeError("join() the refit group before load_plans()")
        self.slice = RankPlan.from_json(slice_json)
        bplan = broadcast_plan_from_json(broadcast_json) if broadcast_json else None
        for backend in backends:
            self.worker.load_plan(self.slice, backend, bplan)
            assert self.worker.refitter is not None
            self.refitters[backend] = self.worker.refitter

    def enter(self, endpoint_json: str, slice_json: str, version: int | None = None) -> None:
        """Join a refit group of a run whose engines come and go (``elastic.py``) and
        load its plan (collective over that group): the first group joined, or the next
        one after a membership change (``RefitWorker.rejoin``; ``version``: the step
        every party holds whole, from which a delta refit goes on)."""
        endpoint = RefitEndpoint.from_json(endpoint_json)
        self.group_rank = endpoint.group_rank
        self.slice = RankPlan.from_json(slice_json)
        if self.worker is None:
            self.worker = RefitWorker(endpoint, self._tensors())
            self.worker.join()
            self.worker.load_plan(self.slice)
        else:
            self.worker.rejoin(endpoint, self.slice, version)
        assert self.worker.refitter is not None
        self.refitters = {"reshard": self.worker.refitter}

    def weights(self) -> dict[str, Any]:
        """This rank's weights version (``WeightsState``): what the driver's view must say."""
        return self.worker.weights.as_dict() if self.worker is not None else {}

    def refit(self, backend: str, step: int, verify: bool) -> dict[str, Any]:
        """One refit with ``backend`` (collective over the refit group): barrier, replay,
        and with ``verify`` this rank's checksums (see ``engine/checksum.py``); a delta
        refit's bytes (``engine/delta/program.py``) under ``"delta"``."""
        if backend not in self.refitters:
            raise ValueError(f"backend {backend!r} was not loaded; loaded: {list(self.refitters)}")
        if self.exit_at_step == step:
            os._exit(1)  # test-only fault injection: die mid-refit, no cleanup
        assert self.worker is not None
        self.worker.barrier()  # every rank starts together: timings measure the refit only
        timing = self.worker.refit(step, self.refitters[backend])  # versioned: stale till done
        out: dict[str, Any] = {
            "seconds": timing.seconds,
            "exchange_seconds": timing.exchange_seconds,
        }
        delta = self.refitters[backend].delta
        if delta is not None:  # what this step sent, and what it would have sent dense
            out["delta"] = {
                "sent_bytes": delta.last.sent_bytes,
                "dense_bytes": delta.last.dense_bytes,
            }
        if verify:
            out["checksums"] = self._checksums()
        return out

    def _checksums(self) -> Checksums:
        raise NotImplementedError

    def local_state(self) -> dict[str, Tensor]:
        """Copies of the live tensors (for canonical comparisons in tests)."""
        return {n: t.detach().clone() for n, t in self._tensors().items()}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainingActor(_RefitMember):
    """One Megatron training rank (``MegatronPolicyTrainer``)."""

    def setup(
        self,
        policy: dict[str, Any],
        rank: int,
        train: str,
        grpo: GrpoConfig,
        seed: int,
        world_port: int,
        timeout_s: float,
    ) -> None:
        from .trainer import MegatronPolicyTrainer

        _quiet_process()
        par = TrainParallel.parse(train)
        _init_world(world_port, rank, par.world_size, timeout_s)
        spec = policy_spec(policy)
        self.shapes = {t.name: t.shape for t in spec}
        self.trainer = MegatronPolicyTrainer(spec, par, grpo, seed=seed)

    def _tensors(self) -> dict[str, Tensor]:
        if not hasattr(self, "trainer"):
            raise RuntimeError("TrainingActor: call setup() before anything else")
        return self.trainer.local_tensors()

    def score_and_train(
        self, tokens: Tensor, prompt_len: int, rewards: Tensor, group_size: int
    ) -> tuple[Tensor, dict[str, float]]:
        """The policy's log-probabilities of the sampled tokens *before* the update, then
        one GRPO step with them as the old log-probabilities (as NeMo RL recomputes them)."""
        logprobs = self.trainer.logprobs(tokens, prompt_len)
        metrics = self.trainer.train_step(tokens, prompt_len, rewards, logprobs, group_size)
        return logprobs, metrics

    def _checksums(self) -> Checksums:
        assert self.slice is not None
        # From the reshard plan's transfers whichever backend ran: they say which source
        # element belongs at which destination element, so the baseline is checked too.
        return sender_checksums(self.slice.messages, self.group_rank, self._tensors(), self.shapes)


class GenerationActor(_RefitMember):
    """One tensor-parallel rank of one generation replica (``VllmLayoutGenerator``)."""

    def setup(
        self,
        policy: dict[str, Any],
        replica: int,
        tp_rank: int,
        infer: str,
        dtype: str,
        world_port: int,
        timeout_s: float,
        exit_at_step: int | None = None,
    ) -> None:
        from .generator import ForwardConfig, VllmLayoutGenerator

        _quiet_process()
        par = InferParallel.parse(infer)
        group = None
        if par.tp > 1:
            _init_world(world_port, tp_rank, par.tp, timeout_s)
            group = dist.group.WORLD
        self.tp_rank = tp_rank
        self.replica = replica
        self.exit_at_step = exit_at_step
        rank = replica * par.engine_world_size + tp_rank  # vLLM rank order (pp = engine_dp = 1)
        spec = policy_spec(policy)
        self.shapes = {t.name: t.shape for t in spec}
        self.generator = VllmLayoutGenerator(
            spec,
            par,
            rank,
            group,
            TORCH_DTYPES[dtype],
            config=ForwardConfig.from_hf_config(policy),
        )

    def _tensors(self) -> dict[str, Tensor]:
        if not hasattr(self, "generator"):
            raise RuntimeError("GenerationActor: call setup() before anything else")
        return self.generator.local_tensors()

    def generate(
        self, prompts: Tensor, max_new_tokens: int, temperature: float, seed: int
    ) -> tuple[Tensor, Tensor] | None:
        """Sample completions (collective over the replica's tp ranks, which all get the
        same arguments); tp rank 0 returns ``(tokens, logprobs)``, the others ``None``
        (their results are identical by construction)."""
        if self.worker is not None:  # never from torn weights (a failed or cut-off refit)
            self.worker.weights.require_fresh(f"generation on refit rank {self.group_rank}")
        gen = torch.Generator().manual_seed(seed)
        out = self.generator.generate(prompts, max_new_tokens, temperature, gen)
        return out if self.tp_rank == 0 else None

    def _checksums(self) -> Checksums:
        return receiver_checksums(
            self.generator.layout, self.group_rank, self._tensors(), self.shapes
        )
