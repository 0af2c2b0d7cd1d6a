"""Drive the ``reshard`` checkpoint engine through veRL's real manager on CPU (veRL's Python).

    python -m tests.programs.verl_driver SPEC.json RESULT.json

SPEC: ``{"model", "actors", "infer", "replicas", "steps", "checkpoints": [one
safetensors path per step], "engine_kwargs", "kill_rollout_before_step": int|null}``.

Real veRL: ``CheckpointEngineManager``, ``RayWorkerGroup``, ``CheckpointEngineWorker``,
``RolloutReplica``, the registry and its ``custom_backend_module`` import. Stand-ins
(no GPU, no vLLM server here): the actor worker, which yields each step's full HF
tensors as FSDP's ``get_per_tensor_param`` does, and the server adapter, which
records what the engine yields instead of passing it to vLLM over CUDA IPC.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import ray
import torch
from safetensors.torch import load_file
from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig, RolloutConfig
from verl.workers.rollout import BaseRollout, RolloutReplica

from tests.helpers.driver_report import report_to

MODULE = "nemo_refit_reshard.integrations.verl"


class ActorStandIn(Worker):
    """The actor side of veRL's ``ActorRolloutRefWorker`` as far as the engine sees it."""

    def __init__(self, config: CheckpointEngineConfig, checkpoints: list[str]) -> None:
        super().__init__()
        import_external_libs(config.custom_backend_module)  # as engine_workers.py does
        self.checkpoints = checkpoints
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend,
            is_master=self.rank == 0,
            bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}),
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        full = load_file(self.checkpoints[global_steps])
        weights = ((name, tensor) for name, tensor in full.items())
        return await self.checkpoint_engine.send_weights(weights, global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class RecordingServerAdapter(BaseRollout):
    """Records the engine's yields (vLLM's adapter would hand them to load_weights)."""

    def __init__(self, config: RolloutConfig) -> None:
        super().__init__(config, None, device_mesh=None)
        self.received: dict[str, torch.Tensor] = {}

    async def resume(self, tags: list[str]):
        raise NotImplementedError

    async def release(self):
        raise NotImplementedError

    async def update_weights(self, weights, **kwargs):
        self.received = {}
        async for name, weight in weights:
            self.received[name] = weight.clone()  # the buffer is reused, as vLLM's IPC copy


class RolloutWorker(CheckpointEngineWorker):
    def __init__(self, rollout_config: RolloutConfig) -> None:
        super().__init__(rollout_config, None, RecordingServerAdapter(rollout_config))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def check_received(self, checkpoint: str, infer: str) -> dict:
        """Every piece of this GPU's vLLM shard holds the checkpoint's values; nothing
        else is yielded."""
        from nemo_refit_reshard.layouts import VllmOptions, vllm_layout
        from nemo_refit_reshard.spec import InferParallel, load_model_spec

        engine = self.checkpoint_engine
        spec = load_model_spec(engine.config.model)
        layout = vllm_layout(
            spec,
            InferParallel.parse(infer),
            self.rank,
            VllmOptions(params_dtype=engine.config.infer_dtype),
        )
        truth = load_file(checkpoint)
        got = self.server_adapter.received
        wrong = []
        for piece in layout.pieces():
            want = truth[piece.canonical][piece.canonical_box.slices()]
            have = got[piece.canonical][piece.canonical_box.slices()]
            if not torch.equal(have, want.to(have.dtype)):
                wrong.append(piece.canonical)
        expected = {p.canonical for p in layout.pieces()}
        return {
            "rank": self.rank,
            "wrong": sorted(set(wrong)),
            "extra": sorted(set(got) - expected),
            "missing": sorted(expected - set(got)),
            "yielded": len(got),
            "bytes_received": engine.bytes_received,
        }


class Replica(RolloutReplica):
    async def init_hybrid(self, worker_group: RayWorkerGroup) -> None:
        n = self.world_size
        self.workers = worker_group.workers[n * self.replica_rank : n * (self.replica_rank + 1)]

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        raise NotImplementedError

    async def launch_servers(self):
        raise NotImplementedError


async def run(spec: dict) -> dict:
    from nemo_refit_reshard.spec import InferParallel

    infer = InferParallel.parse(spec["infer"])
    config = CheckpointEngineConfig(
        backend="reshard",
        custom_backend_module=MODULE,
        update_weights_bucket_megabytes=1,
        engine_kwargs={"reshard": spec["engine_kwargs"]},
    )
    rollout_config = RolloutConfig(
        name="vllm",
        tensor_model_parallel_size=infer.tp,
        pipeline_model_parallel_size=infer.pp,
        data_parallel_size=infer.engine_dp,
        checkpoint_engine=config,
    )
    actor_wg = RayWorkerGroup(
        RayResourcePool([spec["actors"]], use_gpu=False, max_colocate_count=1),
        RayClassWithInitArgs(
            cls=ray.remote(ActorStandIn), config=config, checkpoints=spec["checkpoints"]
        ),
        name_prefix="actor",
    )
    rollout_world = infer.engine_world_size * spec["replicas"]
    rollout_wg = RayWorkerGroup(
        RayResourcePool([rollout_world], use_gpu=False, max_colocate_count=1),
        RayClassWithInitArgs(cls=ray.remote(RolloutWorker), rollout_config=rollout_config),
        name_prefix="rollout",
    )
    replicas = [Replica(i, rollout_config, None) for i in range(spec["replicas"])]
    await asyncio.gather(*[r.init_hybrid(rollout_wg) for r in replicas])
    manager = CheckpointEngineManager(config=config, actor_wg=actor_wg, replicas=replicas)
    full_infer = f"{spec['infer']},dp={spec['replicas']}"
    steps = []
    for step in range(spec["steps"]):
        if spec.get("kill_rollout_before_step") == step:
            ray.kill(rollout_wg.workers[-1])
        t0 = time.perf_counter()
        try:
            metrics = await manager.update_weights(global_steps=step)
        except Exception as err:
            steps.append(
                {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - t0}
            )
            break
        checks = rollout_wg.check_received(spec["checkpoints"][step], full_infer)
        steps.append({"metrics": metrics, "checks": checks, "seconds": time.perf_counter() - t0})
    return {"steps": steps}


def main(spec_path: str, result_path: str) -> None:
    spec = json.load(open(spec_path))
    try:
        with report_to(result_path) as result:
            ray.init(num_cpus=spec["actors"] + 8, include_dashboard=False, log_to_driver=True)
            result.update(asyncio.run(run(spec)))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
