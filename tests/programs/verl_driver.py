"""Drive the ``reshard`` checkpoint engine through veRL's real manager on CPU (veRL's Python).

    python -m tests.programs.verl_driver SPEC.json RESULT.json

SPEC: ``{"model", "actors", "infer", "replicas", "steps", "checkpoints": [one
safetensors path per step], "engine_kwargs", "kill_rollout_before_step": int|null,
"rollout_name": "vllm"|"sglang", "membership": {step: [replica indices serving from that
step on]} (veRL's ``remove_replicas`` / ``add_replicas`` before it), "remove_dead_and_retry":
bool (a failed update: the replica of the killed worker is removed, the update retried)}``.

Real veRL: ``CheckpointEngineManager``, ``RayWorkerGroup``, ``CheckpointEngineWorker``,
``RolloutReplica``, the registry and its ``custom_backend_module`` import, and (SGLang)
``sglang_rollout.utils.get_named_tensor_buckets``. Stand-ins (no GPU, no vLLM or
SGLang server here): the actor worker, which yields each step's full HF tensors as
FSDP's ``get_per_tensor_param`` does, and the server adapter, which records what the
engine yields instead of passing it to the engine over CUDA IPC: for vLLM a copy per
yield (:class:`RecordingServerAdapter`), for SGLang veRL's bucket holding and naming
(:class:`SGLangBucketAdapter`).
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


class SGLangBucketAdapter(RecordingServerAdapter):
    """What veRL 0.9.1's ``sglang_rollout.ServerAdapter.update_weights`` does with the
    yields (``wire_format="named_tensors"``, no LoRA, no FP8; its module imports sglang,
    so it cannot run here). Its mesh: ``_init_server_adapter``'s ``(dp, infer_tp,
    infer_pp)`` over the rollout workers' gloo group. Per bucket of veRL's own
    ``get_named_tensor_buckets`` (a list of references, no copy):
    ``sglang.srt.weight_sync.utils.update_weights`` CUDA-IPC-serializes every tensor
    (a handle, no copy), gathers each rank's list to TP rank 0 and names the i-th tensor
    of every rank by rank 0's i-th name (``zip(*gathered, strict=True)``); SGLang's TP
    rank r loads rank r's tensor under that name. Here every rank gathers the names
    (``all_gather_object``: each rank checks its own values) and keeps the references;
    the values are read once the whole stream is drained — the latest moment SGLang
    could read them (ranks other than TP rank 0 do not wait for the load before
    pulling the next bucket). ``_strip_lora_base_layer`` and ``_to_ipc_device`` do
    nothing to these names and CPU tensors."""

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kw):
        # imported here: Ray pickles this __main__ class by value, globals included
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from verl.workers.rollout.sglang_rollout.utils import get_named_tensor_buckets

        assert wire_format == "named_tensors", wire_format
        c = self.config
        infer_tp = c.tensor_model_parallel_size * c.data_parallel_size
        infer_pp = c.pipeline_model_parallel_size
        if self.device_mesh is None:
            dp = dist.get_world_size() // (infer_tp * infer_pp)
            dims = ["dp", "infer_tp", "infer_pp"]
            self.device_mesh = init_device_mesh(
                "cpu", (dp, infer_tp, infer_pp), mesh_dim_names=dims
            )
        tp = self.device_mesh["infer_tp"]
        bucket_bytes = int(c.checkpoint_engine.update_weights_bucket_megabytes) << 20
        held: list[tuple[str, torch.Tensor]] = []
        self.buckets = []
        async for batch in get_named_tensor_buckets(weights, bucket_bytes, fusion_groups=()):
            gathered: list = [None] * tp.size()
            dist.all_gather_object(gathered, [n for n, _ in batch], group=tp.get_group())
            named = [group[0] for group in zip(*gathered, strict=True)]  # rank 0's names
            held += [(name, tensor) for name, (_, tensor) in zip(named, batch, strict=True)]
            self.buckets.append(len(batch))
        self.received = {name: tensor.clone() for name, tensor in held}


class RolloutWorker(CheckpointEngineWorker):
    def __init__(self, rollout_config: RolloutConfig) -> None:
        adapter = SGLangBucketAdapter if rollout_config.name == "sglang" else RecordingServerAdapter
        super().__init__(rollout_config, None, adapter(rollout_config))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def check_received(self, checkpoint: str, infer: str) -> dict:
        """Every piece of this GPU's vLLM shard holds the checkpoint's values; nothing
        else is yielded."""
        from nemo_refit_reshard.layouts import VllmOptions
        from nemo_refit_reshard.layouts.refit import engine_layouts
        from nemo_refit_reshard.spec import InferParallel, load_model_spec

        engine = self.checkpoint_engine
        spec = load_model_spec(engine.config.model)
        opts = VllmOptions(params_dtype=engine.config.infer_dtype)
        parallel = InferParallel.parse(infer)
        layout = engine_layouts(spec, parallel, self.rollout_config.name, opts)[self.rank]
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
            "buckets": getattr(self.server_adapter, "buckets", None),
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
        name=spec.get("rollout_name", "vllm"),
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
    membership = spec.get("membership", {})  # step -> the replicas serving from then on
    dead: set[int] = set()
    for step in range(spec["steps"]):
        if str(step) in membership:  # veRL's elastic calls, between updates
            serving = [replicas[i] for i in membership[str(step)]]
            manager.remove_replicas([r for r in manager.replicas if r not in serving])
            manager.add_replicas([r for r in serving if r not in manager.replicas])
        if spec.get("kill_rollout_before_step") == step:
            ray.kill(rollout_wg.workers[-1])
            dead.add(len(replicas) - 1)
        for attempt in range(2):
            t0 = time.perf_counter()
            try:
                metrics = await manager.update_weights(global_steps=step)
                break
            except Exception as err:
                steps.append(
                    {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - t0}
                )
                if not spec.get("remove_dead_and_retry") or attempt:
                    return {"steps": steps}
                # the caller's recovery: the replica with the dead worker leaves
                manager.remove_replicas([replicas[i] for i in dead])
        serving_workers = [w for r in manager.replicas for w in r.workers]
        checks = ray.get(
            [
                w.check_received.remote(spec["checkpoints"][step], full_infer)
                for w in serving_workers
            ]
        )
        steps.append(
            {
                "metrics": metrics,
                "checks": checks,
                "replicas": [r.replica_rank for r in manager.replicas],
                "seconds": time.perf_counter() - t0,
            }
        )
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
