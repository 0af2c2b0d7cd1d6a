"""Delta refit through veRL's real manager on CPU (veRL's Python): ``verl_driver``'s parties,
each update's delta statistics read from every rank's engine.

    python -m tests.programs.verl_delta_driver SPEC.json RESULT.json

SPEC: as ``tests.programs.verl_driver`` (``engine_kwargs`` with ``delta: true``). Real
veRL: ``CheckpointEngineManager``, ``RayWorkerGroup``, ``CheckpointEngineWorker``,
``RolloutReplica``, the registry and its ``custom_backend_module`` import; the same
stand-ins as there (the actor worker, the server adapter). After each
``manager.update_weights`` every rollout GPU's yields are checked against the step's
checkpoint (``RolloutWorker.check_received``) and every rank's engine reports its
``delta_stats()`` through veRL's own ``execute_checkpoint_engine``.
"""

from __future__ import annotations

import asyncio
import json
import sys

import ray
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig, RolloutConfig

from tests.helpers.driver_report import report_to
from tests.programs.verl_driver import MODULE, ActorStandIn, Replica, RolloutWorker


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
    actors = spec["actors"]
    actor_wg = RayWorkerGroup(
        RayResourcePool([actors], use_gpu=False, max_colocate_count=1),
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
    from verl.checkpoint_engine import CheckpointEngineManager

    manager = CheckpointEngineManager(config=config, actor_wg=actor_wg, replicas=replicas)
    full_infer = f"{spec['infer']},dp={spec['replicas']}"
    steps = []
    for step in range(spec["steps"]):
        metrics = await manager.update_weights(global_steps=step)
        checks = rollout_wg.check_received(spec["checkpoints"][step], full_infer)
        stats = ray.get(
            actor_wg.execute_checkpoint_engine(["delta_stats"] * actors)
            + rollout_wg.execute_checkpoint_engine(["delta_stats"] * rollout_world)
        )
        steps.append({"metrics": metrics, "checks": checks, "delta": stats})
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
