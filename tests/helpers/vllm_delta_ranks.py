"""The Ray actors of ``tests/programs/vllm_delta_refit.py`` (delta refit through vLLM's
weight-transfer API): importable, so Ray ships them by reference (a class of the
program's ``__main__`` would be pickled whole, with whatever its globals drag in)."""

from __future__ import annotations

from typing import Any

import ray

WAIT_S = 480


@ray.remote(num_cpus=0)
class VllmWorkerRank:
    def __init__(self, config: dict[str, Any], rank: dict[str, Any], seed: int) -> None:
        import torch
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        from nemo_refit_reshard.integrations.vllm import ReshardWorkerExtension, plugin
        from tests.helpers import vllm_cpu
        from tests.helpers.vllm_control_plane import StandInWorker, install_vllm_worker_methods

        torch.set_num_threads(1)
        install_vllm_worker_methods()
        plugin.register()

        class Worker(StandInWorker, ReshardWorkerExtension):
            """vLLM's worker with the extension in its bases; ``sleep`` as a GPU's."""

            def sleep(self, level: int = 1) -> None:
                if level >= 2:  # the weights' memory is released: its content is lost
                    owner.poison()

            def wake_up(self, tags: list[str] | None = None) -> None:
                pass  # level 1: restored as they were; level 2: re-backed, content lost

        owner = self
        self.config, self.seed = config, seed
        self.rank = vllm_cpu.EngineRank.from_dict(rank)
        self.model, vllm_config = vllm_cpu.build_model(config, self.rank, "cpu", "bfloat16")
        from tests.helpers.delta_updates import bf16_policy

        self.model.load_weights(iter(bf16_policy(config, 0, seed).items()))
        self.engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="reshard"), vllm_config, torch.device("cpu"), self.model
        )
        self.worker = Worker(self.engine, vllm_config, self.rank.tp_rank)
        hook = ReshardWorkerExtension.init_worker_extension  # as vLLM's init_device
        hook(self.worker)

    def execute(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.serial_utils import run_method

        if method == "poison":
            return self.poison()
        if method == "check":
            return self.check(*args)
        if method == "delta":
            from nemo_refit_reshard.integrations.vllm import refit_delta_stats

            return refit_delta_stats(self.worker)
        return run_method(self.worker, method, args, kwargs)

    def poison(self) -> None:
        import torch

        from nemo_refit_reshard.integrations.vllm.worker import KV_CACHE_SCALES

        vocab = int(self.config["vocab_size"])
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name.endswith(KV_CACHE_SCALES):
                    continue
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    start = self.rank.tp_rank * p.shape[0]  # no refit writes vocabulary padding
                    p[: max(0, vocab - start)].fill_(float("nan"))
                else:
                    p.fill_(float("nan"))

    def check(self, policy_step: int) -> list[str]:
        """The parameters that differ from vLLM's load of the trainer's policy."""
        import torch

        from tests.helpers import vllm_cpu
        from tests.helpers.delta_updates import bf16_policy

        truth, _ = vllm_cpu.build_model(self.config, self.rank, "cpu", "bfloat16")
        truth.load_weights(iter(bf16_policy(self.config, policy_step, self.seed).items()))
        want = dict(truth.named_parameters())
        return [n for n, p in self.model.named_parameters() if not torch.equal(p, want[n])]


@ray.remote(num_cpus=0)
class TrainerRank:
    def __init__(self, config: dict[str, Any], rank: int, seed: int, init_file: str) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        self.config, self.rank, self.seed = config, rank, seed
        from tests.helpers.delta_updates import bf16_policy

        # FSDP2 on 2 ranks (every tensor Shard(0)): this rank's shards are views of the
        # policy, so an update in place reaches what it sends.
        self.full = bf16_policy(config, 0, seed)
        self.tensors = {n: t.chunk(2)[rank] for n, t in self.full.items()}

    def update(self, step: int) -> int:
        from tests.helpers.delta_updates import change_some

        return change_some(self.full, step, self.seed)

    def init_transfer(self, llm: Any, infer_tp: int, colocated: bool) -> str:
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from nemo_refit_reshard.integrations.vllm import plugin
        from nemo_refit_reshard.integrations.vllm.transfer_sources import DTensorSource
        from nemo_refit_reshard.integrations.vllm.transfer_trainer import ReshardTrainerInitInfo
        from nemo_refit_reshard.layouts import fsdp2_placements
        from nemo_refit_reshard.spec import spec_from_hf_config

        plugin.register()
        info = ReshardTrainerInitInfo(
            rank=self.rank,
            vllm_parallel={"tp": infer_tp},
            params_dtype="bfloat16",
            timeout_s=60,
            connect_timeout_s=WAIT_S,
            bucket_mb=1,
            colocated=colocated,
            delta=True,
            delta_check=True,  # on CPU ranks too: the unforgotten worker goes dense
        )
        spec = spec_from_hf_config(self.config, name="test")
        source = DTensorSource(self.tensors, spec, (2,), self.rank, fsdp2_placements((2,)))
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=RayVLLMWeightSyncClient(llm), source=source
        )
        return self.engine.plan.fingerprint

    def sync(self, version: str) -> dict[str, Any] | None:
        self.engine.send_weights(weight_version=version)
        return self.engine.delta_stats()

    def leave(self) -> None:
        self.engine.shutdown()
