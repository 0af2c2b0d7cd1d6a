"""Drive ``refit.backend: reshard`` through NeMo RL's GRPO refit on CPU (NeMo RL's Python).

    python -m tests.programs.nemo_rl_reshard_driver SPEC.json RESULT.json

SPEC: ``{"config": <HF config>, "model_dir", "train": Megatron TrainParallel text (what
the workers run), "megatron_cfg": what the NeMo RL config claims, "vllm_tp", "vllm_pp",
"engines", "checkpoints": [safetensors per step], "refit": the refit block, "scenario":
"refit" | "dead_worker"}``.

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

    def __init__(self, rank: int, world: int, port: int, hf: dict, train: str) -> None:
        _cpu_stand_ins()
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

    def info(self) -> dict[str, Any]:
        mro = [f"{c.__module__}.{c.__qualname__}" for c in type(self.worker).__mro__]
        return {"mro": mro, "import_error": self.import_error}

    def load(self, checkpoint: str) -> None:
        """The training step's result: new weights in the live parameters, in place."""
        from safetensors.torch import load_file

        from nemo_refit_reshard.integrations.megatron import load_canonical

        params = dict(self.trainer.model.named_parameters())
        load_canonical(params, self.trainer.layout, load_file(checkpoint))

    # NeMo RL's RayWorkerGroup calls worker methods by name.
    def reshard_describe(self) -> dict[str, Any]:
        return self.worker.reshard_describe()

    def reshard_join(self, endpoint_json: str) -> int:
        return self.worker.reshard_join(endpoint_json)

    def reshard_load_plan(self, slice_json: str) -> int:
        return self.worker.reshard_load_plan(slice_json)

    def reshard_step(self) -> dict[str, float]:
        return self.worker.reshard_step()

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
                "colocated": {"enabled": False},
                "refit_transport": None,
                "vllm_cfg": {
                    "tensor_parallel_size": spec["vllm_tp"],
                    "pipeline_parallel_size": spec["vllm_pp"],
                    "expert_parallel_size": 1,
                    "precision": "float32",
                    "async_engine": False,
                },
            },
        },
    }


def _run(spec: dict[str, Any], result: dict[str, Any]) -> None:
    from nemo_rl.algorithms.grpo import refit_policy_generation

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
    processes = [  # per engine, in vLLM's rank order (pp_rank, tp_rank)
        [
            VllmWorkerProcess.options(runtime_env=env).remote(spec["config"], tp, t, p, pp, s)
            for s in range(pp)
            for t in range(tp)
        ]
        for p in [free_port() for _ in range(engines)]
    ]
    ray.get([p.load.remote(spec["checkpoints"][0]) for ps in processes for p in ps])
    generation_actors = [GenerationWorker.options(runtime_env=env).remote(p) for p in processes]
    policy = SimpleNamespace(worker_group=WorkerGroup(policy_actors, world))
    generation = SimpleNamespace(
        worker_group=WorkerGroup(generation_actors, tp * pp * engines),
        cfg={"vllm_cfg": {"async_engine": False}},
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
    for step, checkpoint in enumerate(spec["checkpoints"][1:], start=1):
        ray.get([a.load.remote(checkpoint) for a in policy_actors])
        if spec["scenario"] == "dead_worker" and step == 2:
            ray.kill(processes[-1][-1])  # the last vLLM worker of the last engine
        record: dict[str, Any] = {"stale_before": sync.is_stale}
        try:
            record["metrics"] = refit_policy_generation(
                policy, generation, colocated_inference=False
            )
        except Exception as err:
            record["error"] = f"{type(err).__name__}: {err}"
        record["stale_after"] = sync.is_stale
        if "error" not in record:
            record["differ"] = ray.get(
                [p.compare.remote(checkpoint) for ps in processes for p in ps]
            )
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], _run)
