"""Drive ``refit.backend: reshard`` through NeMo RL's GRPO refit on CPU (NeMo RL's Python).

    python -m tests.programs.nemo_rl_reshard_driver SPEC.json RESULT.json

SPEC: ``{"config": <HF config>, "model_dir", "train": Megatron TrainParallel text (what
the workers run), "megatron_cfg": what the NeMo RL config claims, "vllm_tp", "vllm_pp",
"engines", "checkpoints": [safetensors per step], "refit": the refit block, "scenario":
"refit" | "dead_worker", "async_grpo": optional {"in_flight_weight_updates": bool}}``.

With ``async_grpo`` the vLLM engines are async (``vllm_cfg.async_engine: true``: NeMo RL's
``VllmAsyncCheckpointEngineRpcMixin`` awaits ``AsyncLLM.collective_rpc``) and every refit
is ``async_grpo_train``'s: NeMo RL's own ``AsyncTrajectoryCollector`` (a Ray actor, built
from NeMo RL's ``MasterConfig`` of our overlay with async GRPO on) is told
``prepare_for_refit`` (pause new generations; drain pending ones unless in-flight
updates), then ``refit_policy_generation``, ``set_weight_version(v + 1)``,
``resume_after_refit``.

Real NeMo RL: ``grpo.refit_policy_generation`` (GRPO's refit; it calls
``policy_generation.weight_synchronizer.sync_weights``), the ``WeightSynchronizer``
base of our synchronizer, ``MegatronPolicyWorkerImpl`` (the base of our policy worker;
its ``__init__`` needs GPUs and Megatron-Bridge, so the object is made with
``object.__new__`` as NeMo RL's own unit tests do, and given a real Megatron-core
``GPTModel`` on CPU — tensor parallel over gloo — as ``self.model``),
``VllmCheckpointEngineRpcMixin`` (NeMo RL's generation worker forwarding our callables
to ``llm.collective_rpc``), and vLLM 0.25.1's own model classes. Stand-ins as in
``nemo_rl_driver.py``: Ray actors for NeMo RL's worker groups and vLLM's worker
processes, vLLM's ``Worker`` object, ``llm.collective_rpc``, CUDA-only calls.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import Any

import ray

from tests.programs.nemo_rl_driver import (
    GenerationWorker,
    VllmWorkerProcess,
    WorkerGroup,
    _cpu_stand_ins,
    main,
)


@ray.remote
class MegatronPolicyProcess:
    """One NeMo RL Megatron policy worker: our subclass of NeMo RL's worker, holding a
    real Megatron-core GPTModel shard (tensor parallel over gloo, float32, CPU)."""

    def __init__(
        self, rank: int, world: int, port: int, hf: dict, train: str, gpu: str | None = None
    ) -> None:
        _cpu_stand_ins()
        if gpu is not None:  # the GPU this CPU process stands for (Ray would assign one)
            from nemo_refit_reshard.integrations.worker import DEVICE_ENV

            os.environ[DEVICE_ENV] = gpu
        import torch.distributed as dist

        from nemo_refit_reshard.grpo_cpu.trainer import GrpoConfig, MegatronPolicyTrainer
        from nemo_refit_reshard.integrations.megatron import cpu as megatron_cpu
        from nemo_refit_reshard.spec import TrainParallel, spec_from_hf_config

        megatron_cpu.apply_cpu_patches()
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        spec = spec_from_hf_config(hf)
        self.trainer = MegatronPolicyTrainer(spec, TrainParallel.parse(train), GrpoConfig())
        try:
            from nemo_refit_reshard.integrations.nemo_rl.megatron_worker import (
                ReshardMegatronPolicyWorkerImpl as Worker,
            )
        except ImportError as err:  # no Megatron-Bridge: say so, the test decides
            from nemo_refit_reshard.integrations.nemo_rl.policy_worker import (
                ReshardPolicyWorkerMixin as Worker,
            )

            self.import_error = f"{type(err).__name__}: {err}"
        else:
            self.import_error = None
        self.worker = object.__new__(Worker)
        self.worker.model = self.trainer.model
        self.worker.rank = rank
        self.calls: list[str] = []
        self.offloaded: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        mro = [f"{c.__module__}.{c.__qualname__}" for c in type(self.worker).__mro__]
        return {"mro": mro, "import_error": self.import_error}

    def load(self, checkpoint: str) -> int:
        """The training step's result: new weights in the live parameters, in place,
        placed by Megatron's own sharded state dict (never through our layout)."""
        from safetensors.torch import load_file

        from tests.helpers import megatron_cpu as mc

        t = self.trainer
        return mc.load_hf_through_sharded_state_dict(
            [t.model], 1, t.spec.arch, load_file(checkpoint), t.padded_vocab
        )

    # NeMo RL's colocated lifecycle on its Megatron worker. Its offload moves the DDP
    # buffers (megatron-core's ``offload_to_cpu`` / ``reload_from_cpu``: a CPU copy, then
    # the parameters' storage resized to 0 in place, and back). The CPU model here has no
    # DDP wrapper: the same resize, per parameter.
    def offload_before_refit(self) -> None:
        self.calls.append("offload_before_refit")  # grads and optimizer: none here

    def offload_after_refit(self) -> None:
        self.calls.append("offload_after_refit")
        for name, p in self.trainer.model.named_parameters():
            if p.untyped_storage().nbytes() > 0:  # as megatron-core: offloaded ones stay
                self.offloaded[name] = p.detach().clone()
                p.untyped_storage().resize_(0)

    def prepare_for_training(self) -> None:
        self.calls.append("prepare_for_training")
        for name, p in self.trainer.model.named_parameters():
            if name in self.offloaded:
                p.untyped_storage().resize_(self.offloaded[name].untyped_storage().nbytes())
                p.data.copy_(self.offloaded.pop(name))

    def calls_made(self) -> list[str]:
        return list(self.calls)

    # NeMo RL's RayWorkerGroup calls worker methods by name.
    def set_rollout_num_gpus_per_engine(self, num_gpus_per_engine: int) -> int:
        self.worker.set_rollout_num_gpus_per_engine(num_gpus_per_engine)
        return self.worker.rollout_num_gpus_per_engine

    def reshard_describe(self) -> dict[str, Any]:
        return self.worker.reshard_describe()

    def reshard_address(self, host: str | None = None) -> tuple[str, int]:
        return self.worker.reshard_address(host)

    def reshard_join(self, endpoint_json: str) -> int:
        return self.worker.reshard_join(endpoint_json)

    def reshard_load_plan(self, slice_json: str) -> int:
        return self.worker.reshard_load_plan(slice_json)

    def reshard_step(self) -> dict[str, float]:
        self.calls.append("reshard_step")
        return self.worker.reshard_step()

    def reshard_colocated_listen(self, endpoint_json: str, slices: dict[str, str]) -> str | None:
        return self.worker.reshard_colocated_listen(endpoint_json, slices)

    def reshard_colocated_join(self) -> int:
        return self.worker.reshard_colocated_join()

    def guest(self) -> int | None:
        return self.worker._reshard.worker.guest_rank

    def reshard_close(self) -> None:
        self.worker.reshard_close()


def master_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The parts of NeMo RL's ``MasterConfig`` the synchronizer reads."""
    return {
        "refit": spec["refit"],
        "policy": {
            "model_name": spec["model_dir"],
            "megatron_cfg": {"enabled": True, **spec["megatron_cfg"]},
            "generation": {
                "backend": "vllm",
                "colocated": {"enabled": bool(spec.get("gpus"))},
                "refit_transport": None,
                "vllm_cfg": {
                    "tensor_parallel_size": spec["vllm_tp"],
                    "pipeline_parallel_size": spec["vllm_pp"],
                    "expert_parallel_size": 1,
                    "precision": "fp8" if spec.get("fp8") else "float32",
                    "kv_cache_dtype": "auto",
                    "async_engine": bool(spec.get("async_engine")),
                },
            },
        },
    }


def grpo_refit(
    policy: Any, generation: Any, sync: Any, processes: list, checkpoint: str, colocated: bool
) -> dict[str, Any]:
    """One GRPO refit (NeMo RL's ``refit_policy_generation``): staleness before and
    after, the metrics or the error, and, when it succeeded, the vLLM parameters that
    differ from vLLM's own load of ``checkpoint``."""
    from nemo_rl.algorithms.grpo import refit_policy_generation

    record: dict[str, Any] = {"stale_before": sync.is_stale}
    try:
        record["metrics"] = refit_policy_generation(
            policy, generation, colocated_inference=colocated
        )
    except Exception as err:
        record["error"] = f"{type(err).__name__}: {err}"
    record["stale_after"] = sync.is_stale
    if "error" not in record:
        record["differ"] = ray.get([p.compare.remote(checkpoint) for ps in processes for p in ps])
    return record


def trajectory_collector(spec: dict[str, Any]) -> Any:
    """NeMo RL's ``AsyncTrajectoryCollector`` actor for the overlay with async GRPO on."""
    import importlib.util

    from nemo_rl.algorithms.async_utils import AsyncTrajectoryCollector
    from nemo_rl.algorithms.grpo import MasterConfig

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    module_spec = importlib.util.spec_from_file_location(
        "run_grpo", os.path.join(repo, "examples/nemo_rl/run_grpo.py")
    )
    assert module_spec is not None and module_spec.loader is not None
    run_grpo = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(run_grpo)
    in_flight = spec["async_grpo"]["in_flight_weight_updates"]
    raw = run_grpo.load(
        os.path.join(repo, "configs/nemo_rl/grpo_math_qwen3_8B_megatron_reshard.yaml"),
        [
            "grpo.async_grpo.enabled=true",
            f"grpo.async_grpo.in_flight_weight_updates={str(in_flight).lower()}",
            "policy.generation.vllm_cfg.async_engine=true",
            "loss_fn.use_importance_sampling_correction=true",
        ],
        None,
    )
    return AsyncTrajectoryCollector.remote(
        policy_generation=None,
        tokenizer=None,
        task_to_env={},
        master_config=MasterConfig(**raw),
        replay_buffer=None,
    )


def async_grpo_refit(
    collector: Any, policy: Any, generation: Any, sync: Any, processes: list, checkpoint: str
) -> dict[str, Any]:
    """One refit as ``async_grpo_train`` makes it, around :func:`grpo_refit`."""
    version = ray.get(collector.get_weight_version.remote())
    ray.get(collector.prepare_for_refit.remote())
    record = grpo_refit(policy, generation, sync, processes, checkpoint, colocated=False)
    if "error" not in record:
        ray.get(collector.set_weight_version.remote(version + 1))
        ray.get(collector.resume_after_refit.remote())
    record["weight_version"] = [version, ray.get(collector.get_weight_version.remote())]
    return record


def _run(spec: dict[str, Any], result: dict[str, Any]) -> None:

    from nemo_refit_reshard.engine.rendezvous import free_port
    from nemo_refit_reshard.integrations.nemo_rl.grpo import refit_config
    from nemo_refit_reshard.integrations.nemo_rl.synchronizer import ReshardWeightSynchronizer

    ray.init(num_cpus=16, include_dashboard=False)
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path), "VLLM_TARGET_DEVICE": "cpu"}}
    from nemo_refit_reshard.spec import TrainParallel

    world = TrainParallel.parse(spec["train"]).world_size
    port = free_port()
    policy_actors = [
        MegatronPolicyProcess.options(runtime_env=env).remote(
            r, world, port, spec["config"], spec["train"]
        )
        for r in range(world)
    ]
    result["policy_worker"] = ray.get(policy_actors[0].info.remote())
    tp, pp, engines = spec["vllm_tp"], spec["vllm_pp"], spec["engines"]
    fp8 = None
    if spec.get("fp8"):  # vLLM loads and is compared with the quantized checkpoints
        vllm_cfg = master_config(spec)["policy"]["generation"]["vllm_cfg"]
        fp8 = {"vllm_cfg": vllm_cfg, "model_dir": spec["model_dir"]}
    loads = spec.get("fp8_checkpoints") or spec["checkpoints"]
    processes = [  # per engine, in vLLM's rank order (pp_rank, tp_rank)
        [
            VllmWorkerProcess.options(runtime_env=env).remote(
                spec["config"], tp, t, p, pp, s, None, fp8
            )
            for s in range(pp)
            for t in range(tp)
        ]
        for p in [free_port() for _ in range(engines)]
    ]
    ray.get([p.load.remote(loads[0]) for ps in processes for p in ps])
    async_engine = bool(spec.get("async_engine"))
    generation_actors = [
        GenerationWorker.options(runtime_env=env).remote(p, async_engine=async_engine)
        for p in processes
    ]
    policy = SimpleNamespace(worker_group=WorkerGroup(policy_actors, world))
    generation = SimpleNamespace(
        worker_group=WorkerGroup(generation_actors, tp * pp * engines),
        cfg={"vllm_cfg": {"async_engine": async_engine}},
        weight_synchronizer=None,
    )
    config = master_config(spec)
    refit = refit_config(config)
    sync = ReshardWeightSynchronizer(policy, generation, config, refit)
    try:
        sync.init_communicator()
    except Exception as err:
        result["init_error"] = f"{type(err).__name__}: {err}"
        return
    generation.weight_synchronizer = sync
    result["plan"] = str(sync.plan)
    steps: list[dict[str, Any]] = []
    result["steps"] = steps
    collector = trajectory_collector(spec) if spec.get("async_grpo") else None
    for step, checkpoint in enumerate(spec["checkpoints"][1:], start=1):
        ray.get([a.load.remote(checkpoint) for a in policy_actors])
        if spec["scenario"] == "dead_worker" and step == 2:
            ray.kill(processes[-1][-1])  # the last vLLM worker of the last engine
        if collector is not None:
            record = async_grpo_refit(collector, policy, generation, sync, processes, loads[step])
        else:
            record = grpo_refit(policy, generation, sync, processes, loads[step], colocated=False)
        steps.append(record)
        if "error" in record:
            # the surviving engine's workers: stale, naming the failed step
            from nemo_refit_reshard.integrations.vllm import refit_status

            result["surviving_status"] = ray.get(
                generation_actors[0].checkpoint_engine_rpc.remote(refit_status, ())
            )
            break
    if spec["scenario"] == "refit":
        sync.shutdown()
        result["closed"] = True


def _run_colocated(spec: dict[str, Any], result: dict[str, Any]) -> None:
    """NeMo RL's colocated GRPO loop around each refit: ``finish_generation`` (vLLM
    sleeps), ``prepare_for_training`` (the policy back on its GPU), a training step (new
    weights), GRPO's ``refit_policy_generation(colocated_inference=True)``. ``spec["gpus"]``
    names each worker's GPU: ``{"policy": [...], "vllm": [...]}``, vLLM in global rank
    order. ``scenario``: ``"refit"`` or ``"offloaded"`` (step 2 refits with no
    ``prepare_for_training`` and no training step: the policy is still offloaded)."""
    from nemo_rl.models.generation.vllm.vllm_generation import VllmGeneration
    from nemo_rl.models.policy.lm_policy import Policy

    from nemo_refit_reshard.engine.rendezvous import free_port
    from nemo_refit_reshard.integrations.nemo_rl.grpo import check_reshard_config, refit_config
    from nemo_refit_reshard.integrations.nemo_rl.synchronizer import ReshardWeightSynchronizer
    from nemo_refit_reshard.spec import TrainParallel

    ray.init(num_cpus=16, include_dashboard=False)
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path), "VLLM_TARGET_DEVICE": "cpu"}}
    world = TrainParallel.parse(spec["train"]).world_size
    gpus = spec["gpus"]
    port = free_port()
    policy_actors = [
        MegatronPolicyProcess.options(runtime_env=env).remote(
            r, world, port, spec["config"], spec["train"], gpus["policy"][r]
        )
        for r in range(world)
    ]
    tp, pp, engines = spec["vllm_tp"], spec["vllm_pp"], spec["engines"]
    size = tp * pp
    processes = [  # per engine, in vLLM's rank order (pp_rank, tp_rank)
        [
            VllmWorkerProcess.options(runtime_env=env).remote(
                spec["config"], tp, t, p, pp, s, gpus["vllm"][e * size + s * tp + t]
            )
            for s in range(pp)
            for t in range(tp)
        ]
        for e, p in enumerate([free_port() for _ in range(engines)])
    ]
    ray.get([p.load.remote(spec["checkpoints"][0]) for ps in processes for p in ps])
    ray.get([a.load.remote(spec["checkpoints"][0]) for a in policy_actors])
    generation_actors = [
        GenerationWorker.options(runtime_env=env).remote(p, colocated=True) for p in processes
    ]
    # NeMo RL's own Policy and VllmGeneration (their __init__ starts GPU workers; made
    # with object.__new__ as NeMo RL's unit tests do): their offload, wake and sleep
    # methods run as written, over the worker groups.
    config = master_config(spec)
    policy = object.__new__(Policy)
    policy.worker_group = WorkerGroup(policy_actors, world)
    generation = object.__new__(VllmGeneration)
    generation.worker_group = WorkerGroup(generation_actors, size * engines)
    generation.cfg = config["policy"]["generation"]
    generation.weight_synchronizer = None
    refit = refit_config(config)
    check_reshard_config(config)
    sync = ReshardWeightSynchronizer(policy, generation, config, refit)
    try:
        sync.init_communicator()
    except Exception as err:
        result["init_error"] = f"{type(err).__name__}: {err}"
        return
    generation.weight_synchronizer = sync
    result["plan"] = str(sync.plan)
    result["guests"] = ray.get([a.guest.remote() for a in policy_actors])
    steps: list[dict[str, Any]] = []
    result["steps"] = steps
    for step, checkpoint in enumerate(spec["checkpoints"][1:], start=1):
        assert generation.finish_generation()  # vLLM sleeps: weights off the GPU
        if not (spec["scenario"] == "offloaded" and step == 2):
            policy.prepare_for_training()
            ray.get([a.load.remote(checkpoint) for a in policy_actors])  # a training step
        record = grpo_refit(policy, generation, sync, processes, checkpoint, colocated=True)
        steps.append(record)
        if "error" in record:
            break
    result["policy_calls"] = ray.get([a.calls_made.remote() for a in policy_actors])
    result["vllm_calls"] = ray.get([p.calls_made.remote() for ps in processes for p in ps])
    sync.shutdown()
    result["closed"] = True


def _dispatch(spec: dict[str, Any], result: dict[str, Any]) -> None:
    (_run_colocated if spec.get("gpus") else _run)(spec, result)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], _dispatch)
