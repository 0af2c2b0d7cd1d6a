"""Drive the drop-in NeMo RL engine through NeMo RL's real classes on CPU (NeMo RL's Python).

    python -m tests.programs.nemo_rl_driver SPEC.json RESULT.json

SPEC: ``{"config": <HF config>, "policy": T, "tp": vLLM tp, "engines": n, "steps": k,
"checkpoints": [safetensors per step], "engine_kwargs": {...}}``.

Real NeMo RL: ``CheckpointEngineWeightSynchronizer`` (the driver's refit; metadata
ordering, rank prefixes), ``PolicyCheckpointEngineMixin`` +
``MegatronCheckpointEngineSendMixin`` (policy workers), ``VllmCheckpointEngineRpcMixin``
(the generation worker forwarding to ``llm.collective_rpc``) and
``VllmInternalWorkerExtensionWithCheckpointEngine`` (inside each vLLM worker, loading
through vLLM 0.25.1's own ``load_weights`` into vLLM's own model classes on CPU).
Ray actors stand for NeMo RL's worker groups and vLLM's worker processes. Stand-ins:
the Megatron export (a policy worker yields each step's full HF tensors, as
``_iter_params_with_optional_kv_scales`` would), the vLLM ``Worker`` object (model
runner and config), ``llm.collective_rpc`` (one Ray call per vLLM worker, dispatched by
vLLM's own ``run_method``), and CUDA calls (NVTX ranges, stream synchronisation).
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

import ray
import torch

from tests.helpers import broken_rules
from tests.helpers.driver_report import report_to

# A negative control's broken Megatron rule, in the driver and in every Ray actor (each
# imports this module; Ray's local workers inherit the driver's environment).
broken_rules.install_from_env()

ENGINE = "nemo_refit_reshard.integrations.nemo_rl:ReshardCheckpointEngine"


def _cpu_stand_ins() -> None:
    """CUDA-only calls NeMo RL makes around a refit, as no-ops on a CPU-only torch."""
    torch.cuda.nvtx.range_push = lambda *_: None  # type: ignore[assignment]
    torch.cuda.nvtx.range_pop = lambda *_: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *_: SimpleNamespace(synchronize=lambda: None)  # type: ignore


@ray.remote
class PolicyWorker:
    def __init__(self, rank: int, checkpoints: list[str]) -> None:
        _cpu_stand_ins()
        from nemo_rl.models.policy.workers.checkpoint_engine import (
            MegatronCheckpointEngineSendMixin,
            PolicyCheckpointEngineMixin,
        )

        class Worker(MegatronCheckpointEngineSendMixin, PolicyCheckpointEngineMixin):
            def __init__(self, rank: int, checkpoints: list[str]) -> None:
                self.rank, self.checkpoints, self.step = rank, checkpoints, 0

            def _iter_params_with_optional_kv_scales(self, kv_scales=None):
                from safetensors.torch import load_file

                yield from load_file(self.checkpoints[self.step]).items()

        self.worker = Worker(rank, checkpoints)

    def set_step(self, step: int) -> None:
        self.worker.step = step

    async def checkpoint_engine_rpc(self, checkpoint_method: str, method_kwargs=None):
        return await self.worker.checkpoint_engine_rpc(checkpoint_method, method_kwargs)

    def delta_stats(self) -> dict | None:
        """The engine's last delta step on this rank (None without delta)."""
        return self.worker.checkpoint_engine.rank.delta_stats()

    def metrics(self) -> dict:
        return self.worker.checkpoint_engine.last_metrics


@ray.remote
class VllmWorkerProcess:
    """One vLLM worker process: vLLM's model class on CPU with NeMo RL's extension."""

    def __init__(
        self,
        config: dict,
        tp: int,
        tp_rank: int,
        port: int,
        pp: int = 1,
        pp_rank: int = 0,
        gpu: str | None = None,
        fp8: dict | None = None,
    ) -> None:
        """``fp8``: ``{"vllm_cfg", "model_dir"}`` — NeMo RL's FP8 generation: the engine
        is what NeMo RL's own ``init_fp8`` makes vLLM build (its ``hf_overrides``)."""
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        if gpu is not None:  # the GPU this CPU process stands for (colocated runs)
            os.environ["NRR_DEVICE"] = gpu
        _cpu_stand_ins()
        import torch.distributed as dist

        from tests.helpers import vllm_cpu

        vllm_cpu.use_cpu_platform()  # before NeMo RL's vllm_backend imports vLLM's layers
        from nemo_rl.models.generation.vllm.vllm_backend import (
            VllmInternalWorkerExtensionWithCheckpointEngine as Extension,
        )

        # vLLM's own world (NeMo RL reads torch.distributed's rank and size).
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=pp_rank * tp + tp_rank,
            world_size=tp * pp,
        )
        self.dtype = "float32"
        if fp8 is not None:
            from nemo_rl.models.generation.vllm.quantization.fp8 import init_fp8

            kwargs = init_fp8(fp8["vllm_cfg"], fp8["model_dir"], tp * pp)
            config = {**config, **kwargs["hf_overrides"]}  # as vLLM applies hf_overrides
            self.dtype = "bfloat16"  # vLLM's Fp8Config refuses float32
        self.config = config
        self.rank = vllm_cpu.EngineRank(tp=tp, pp=pp, tp_rank=tp_rank, pp_rank=pp_rank)
        model, vllm_config = vllm_cpu.build_model(config, self.rank, "cpu", self.dtype)

        class Worker(Extension):  # as vLLM adds worker_extension_cls to its Worker
            pass

        self.worker = Worker()
        self.worker.model_runner = SimpleNamespace(
            model=model, vllm_config=vllm_config, model_config=vllm_config.model_config
        )
        self.worker.vllm_config = vllm_config  # as vLLM's Worker has it
        self.model = model
        self.calls: list[str] = []

    def load(self, checkpoint: str) -> None:
        """vLLM's start-up load (its loader also zeroes the vocabulary padding)."""
        from tests.helpers import vllm_cpu

        self.model.load_weights(vllm_cpu.checkpoint_tensors(checkpoint))

    def run(self, method: str, args: tuple) -> Any:
        from vllm.v1.serial_utils import run_method

        return run_method(self.worker, method, args, {})

    # vLLM's sleep mode, level 1 (NeMo RL's ``sleep``): the weights leave the GPU for a
    # CPU copy, their device memory is released, and ``wake_up(tags=["weights"])``
    # re-backs it (same addresses: vLLM's cumem pool) and copies the CPU copy back. The
    # CPU stand-in: the copy, then the live values lost (NaN), then restored in place.
    def sleep(self, level: int) -> None:
        assert level == 1, level
        self.asleep = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        for p in self.model.parameters():
            p.data.fill_(float("nan"))
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up({tags})")
        if tags is None or "weights" in tags:
            for n, p in self.model.named_parameters():
                p.data.copy_(self.asleep[n])

    def delta_stats(self) -> dict | None:
        """The engine's last delta step on this rank (None without delta)."""
        return self.worker.checkpoint_engine.rank.delta_stats()

    def calls_made(self) -> list[str]:
        return list(self.calls)

    def compare(self, checkpoint: str) -> list[str]:
        """Parameters that differ from vLLM's own load of ``checkpoint``."""
        from tests.helpers import vllm_cpu

        truth, _ = vllm_cpu.build_model(self.config, self.rank, "cpu", self.dtype)
        truth.load_weights(vllm_cpu.checkpoint_tensors(checkpoint))
        want = dict(truth.named_parameters())
        return [n for n, p in self.model.named_parameters() if not torch.equal(p, want[n])]


@ray.remote
class GenerationWorker:
    """NeMo RL's generation worker for one vLLM engine (its rank 0 receives the calls)."""

    def __init__(
        self, processes: list, colocated: bool = False, async_engine: bool = False
    ) -> None:
        from types import SimpleNamespace  # Ray ships this class by value: no module globals

        from nemo_rl.models.generation.vllm.checkpoint_engine import (
            VllmAsyncCheckpointEngineRpcMixin,
            VllmCheckpointEngineRpcMixin,
        )

        class Llm:
            """vLLM's ``LLM``: RPCs and sleep mode fan out to the engine's workers."""

            llm_engine = SimpleNamespace(reset_prefix_cache=lambda: None)

            def collective_rpc(self, method: str, args: tuple = ()) -> list:
                return ray.get([p.run.remote(method, tuple(args)) for p in processes])

            def sleep(self, level: int = 1) -> None:
                ray.get([p.sleep.remote(level) for p in processes])

            def wake_up(self, tags: list[str] | None = None) -> None:
                ray.get([p.wake_up.remote(tags) for p in processes])

        class AsyncLlm:
            """vLLM's ``AsyncLLM`` (``async_engine: true``): ``collective_rpc`` is a
            coroutine whose results NeMo RL resolves (``resolve_collective_rpc_result``)."""

            async def collective_rpc(self, method: str, args: tuple = ()) -> list:
                return [p.run.remote(method, tuple(args)) for p in processes]

        if colocated:  # NeMo RL's own generation worker: its sleep and wake_up
            from nemo_rl.models.generation.vllm.vllm_worker import VllmGenerationWorkerImpl

            class Worker(VllmGenerationWorkerImpl):
                def __init__(self) -> None:  # NeMo RL's starts vLLM on a GPU
                    self.llm = Llm()
                    self.cfg = {"vllm_cfg": {"async_engine": False}}
        elif async_engine:

            class Worker(VllmAsyncCheckpointEngineRpcMixin):  # type: ignore[no-redef]
                llm = AsyncLlm()
        else:

            class Worker(VllmCheckpointEngineRpcMixin):  # type: ignore[no-redef]
                llm = Llm()

        self.worker = Worker()

    def checkpoint_engine_rpc(self, checkpoint_method: str, method_args=()) -> Any:
        return self.worker.checkpoint_engine_rpc(checkpoint_method, method_args)

    def checkpoint_engine_rpc_async(self, checkpoint_method: str, method_args=()) -> Any:
        """NeMo RL's async worker awaits this on its engine's event loop; the actor stays
        synchronous (its other calls block on ``ray.get``), so the coroutine runs here."""
        import asyncio

        call = self.worker.checkpoint_engine_rpc_async(checkpoint_method, method_args)
        return asyncio.run(call)

    def sleep(self) -> None:
        return self.worker.sleep()

    def wake_up(self, **kwargs: Any) -> None:
        return self.worker.wake_up(**kwargs)


class WorkerGroup:
    """NeMo RL's ``RayWorkerGroup`` calls the synchronizer makes."""

    def __init__(self, actors: list, workers: int) -> None:
        self.actors, self.workers = actors, list(range(workers))

    def run_all_workers_single_data(self, method: str, run_rank_0_only_axes=None, **kwargs):
        return [getattr(a, method).remote(**kwargs) for a in self.actors]

    def run_single_worker_single_data(self, method: str, worker_idx: int, **kwargs):
        return getattr(self.actors[worker_idx], method).remote(**kwargs)

    def run_all_workers_multiple_data(
        self, method: str, run_rank_0_only_axes=None, common_kwargs=None, **kwargs
    ):
        return [
            getattr(a, method).remote(
                **(common_kwargs or {}), **{k: v[i] for k, v in kwargs.items()}
            )
            for i, a in enumerate(self.actors)
        ]


def main(spec_path: str, result_path: str, run: Any = None) -> None:
    """Run ``run(spec, result)`` (default: this driver's), reporting to RESULT.json."""
    spec = json.load(open(spec_path))
    try:
        with report_to(result_path) as result:
            (run or _run)(spec, result)
    finally:
        ray.shutdown()


def _run(spec: dict[str, Any], result: dict[str, Any]) -> None:
    ray.init(num_cpus=16, include_dashboard=False)
    from nemo_rl.weight_sync.checkpoint_engine_weight_synchronizer import (
        CheckpointEngineWeightSynchronizer,
    )

    from nemo_refit_reshard.engine.rendezvous import free_port

    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path), "VLLM_TARGET_DEVICE": "cpu"}}
    policy = [
        PolicyWorker.options(runtime_env=env).remote(r, spec["checkpoints"])
        for r in range(spec["policy"])
    ]
    tp, engines = spec["tp"], spec["engines"]
    processes = [
        [
            VllmWorkerProcess.options(runtime_env=env).remote(spec["config"], tp, r, port)
            for r in range(tp)
        ]
        for port in [free_port() for _ in range(engines)]
    ]
    generation = [GenerationWorker.options(runtime_env=env).remote(p) for p in processes]
    sync = CheckpointEngineWeightSynchronizer(
        _policy=SimpleNamespace(
            worker_group=WorkerGroup(policy, len(policy)), prepare_refit_info=lambda: None
        ),
        _generation=SimpleNamespace(
            worker_group=WorkerGroup(generation, tp * engines),
            cfg={"vllm_cfg": {"async_engine": False}},
            dp_size=engines,
            prepare_refit_info=lambda _info: None,
        ),
        _checkpoint_engine_config={
            "backend": ENGINE,
            "update_weights_bucket_memory_ratio": 0.05,
            "engine_kwargs": {ENGINE: {**spec["engine_kwargs"], "release_after_refit": False}},
        },
        _bucket_size_bytes=1 << 20,
    )
    sync.init_communicator()
    steps = []
    for step in range(spec["steps"]):
        ray.get([p.set_step.remote(step) for p in policy])
        t0 = time.perf_counter()
        stale_before = sync.is_stale
        sync.sync_weights()
        differ = ray.get(
            [p.compare.remote(spec["checkpoints"][step]) for ps in processes for p in ps]
        )
        delta = ray.get(
            [p.delta_stats.remote() for p in policy]
            + [p.delta_stats.remote() for ps in processes for p in ps]
        )
        steps.append(
            {
                "seconds": time.perf_counter() - t0,
                "stale_before": stale_before,
                "stale_after": sync.is_stale,
                "differ": differ,
                "delta": delta,
                "metrics": ray.get(policy[0].metrics.remote()),
            }
        )
    result["steps"] = steps


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
