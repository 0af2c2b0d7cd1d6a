"""Drive ``refit.backend: reshard`` with NeMo RL's SGLang generation on CPU (NeMo RL's Python).

    python -m tests.programs.nemo_rl_sglang_driver SPEC.json RESULT.json

SPEC: ``{"config": <HF config>, "model_dir", "name", "train": Megatron TrainParallel text,
"megatron_cfg", "sglang_tp", "servers", "checkpoints": [safetensors per step; step 0 is
what SGLang loads at start-up], "policy_gpus", "sglang_gpus" (the GPU each SGLang rank
stands for, in server order), "sglang_python", "refit"}``.

Real NeMo RL: ``grpo.refit_policy_generation`` (GRPO's refit, calling our
synchronizer), ``Policy`` (``set_rollout_num_gpus_per_engine``, the offload and
``prepare_for_training`` calls over its worker group) and ``SGLangGeneration``
(``engines``, ``prepare_for_generation``, ``finish_generation``,
``invalidate_kv_cache``; made with ``object.__new__`` as NeMo RL's unit tests do: its
``__init__`` starts a placement group, a router and servers on GPUs), and
``SGLangGenerationWorker`` — our subclass of it, each a Ray actor whose NeMo RL ``init``
computes the server arguments (ours add the loader) and launches the server, and whose
NeMo RL methods make every HTTP call. Real Megatron-core models in the policy workers
(``nemo_rl_reshard_driver.MegatronPolicyProcess``).

Stand-ins: the SGLang server that NeMo RL's ``_launch_server_process`` would start with
SGLang's ``launch_server`` is ``tests/programs/sglang_http_stand_in.py`` under SGLang's
venv (SGLang's own model classes, weight-update manager and weight updater behind a
stand-in HTTP front; its docstring lists the rest); ``_apply_sglang_compat_patches``
(it edits SGLang's installed files, absent from NeMo RL's CPU venv) is a no-op; and
``sglang.srt.constants`` (imported by NeMo RL's memory calls) is a module holding
SGLang's three tag strings. No router: NeMo RL registers servers with it only when it
has one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import types
from typing import Any

import ray
import requests

from tests.programs.nemo_rl_driver import WorkerGroup, main
from tests.programs.nemo_rl_reshard_driver import MegatronPolicyProcess


def _sglang_constants() -> None:
    """SGLang's ``srt/constants.py`` tags, for NeMo RL's memory calls (SGLang itself lives in
    another venv here)."""
    names = ["sglang", "sglang.srt", "sglang.srt.constants"]
    for name in names:
        sys.modules.setdefault(name, types.ModuleType(name))
    constants = sys.modules["sglang.srt.constants"]
    constants.GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"  # type: ignore[attr-defined]
    constants.GPU_MEMORY_TYPE_WEIGHTS = "weights"  # type: ignore[attr-defined]
    constants.GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"  # type: ignore[attr-defined]


def _cpu_worker_class() -> type:
    from nemo_rl.models.generation.sglang import sglang_worker

    from nemo_refit_reshard.integrations.nemo_rl.sglang_worker import (
        ReshardSGLangGenerationWorker,
    )

    class CpuReshardSGLangWorker(ReshardSGLangGenerationWorker):  # type: ignore[misc, valid-type]
        """Our NeMo RL SGLang worker; only the server it launches is the CPU stand-in."""

        def __init__(self, *args: Any, stand_in: dict[str, Any], **kwargs: Any) -> None:
            sglang_worker._apply_sglang_compat_patches = lambda: None
            _sglang_constants()
            self.stand_in = stand_in
            super().__init__(*args, **kwargs)

        def _launch_server_process(self, server_args_dict: dict[str, Any]) -> None:
            self.server_args = server_args_dict
            job = {**self.stand_in, "server_args": server_args_dict}
            path = os.path.join(tempfile.mkdtemp(prefix="nrr-sglang-"), "job.json")
            with open(path, "w") as f:
                json.dump(job, f)
            # SGLang's venv, not this one's packages: only the repository on the path
            env = {**os.environ, "PYTHONPATH": job["repo"]}
            self.log = path.replace("job.json", "server.log")
            with open(self.log, "w") as log:
                self.process = subprocess.Popen(
                    [job["python"], "-m", "tests.programs.sglang_http_stand_in", path],
                    cwd=job["repo"], env=env, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            # NeMo RL's own wait: /health_generate, then /flush_cache
            try:
                self._wait_server_healthy(
                    base_url=self.server_base_url,
                    api_key=None,
                    process_alive_fn=lambda: self.process.poll() is None,
                )
            except Exception as err:
                with open(self.log) as log:
                    err.add_note(log.read()[-4000:])
                raise

        def computed_server_args(self) -> dict[str, Any]:
            return self.server_args

        def stand_in_call(self, path: str, body: dict[str, Any]) -> Any:
            response = requests.post(f"{self.server_base_url}/{path}", json=body)
            response.raise_for_status()
            return response.json()

        def stop_server(self) -> int:
            requests.post(f"{self.server_base_url}/nrr_test/shutdown", json={})
            return self.process.wait()

    return CpuReshardSGLangWorker


def master_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The parts of NeMo RL's ``MasterConfig`` (its ``grpo_math_1B_sglang.yaml``) our
    code and NeMo RL's SGLang classes read."""
    tp = spec["sglang_tp"]
    return {
        "refit": spec["refit"],
        "policy": {
            "model_name": spec["model_dir"],
            "megatron_cfg": {"enabled": True, **spec["megatron_cfg"]},
            "generation": {
                "backend": "sglang",
                "colocated": {"enabled": True},
                "refit_transport": None,
                "sglang_cfg": {
                    "model_path": spec["model_dir"],
                    "dtype": "float32",
                    "tp_size": tp,
                    "dp_size": 1,
                    "pp_size": 1,
                    "ep_size": 1,
                    "random_seed": 42,
                    "skip_server_warmup": True,
                    "sglang_server_config": {
                        "needs_offload": True,
                        "cpu_weight_backup": True,
                        "num_gpus": tp * spec["servers"],
                        "num_gpus_per_engine": tp,
                    },
                },
            },
        },
    }


def _run(spec: dict[str, Any], result: dict[str, Any]) -> None:
    from nemo_rl.algorithms.grpo import refit_policy_generation
    from nemo_rl.models.generation.sglang import sglang_generation
    from nemo_rl.models.generation.sglang.sglang_generation import SGLangGeneration
    from nemo_rl.models.policy.lm_policy import Policy

    from nemo_refit_reshard.engine.rendezvous import free_port
    from nemo_refit_reshard.integrations.nemo_rl.grpo import (
        check_reshard_config,
        install_synchronizer,
        policy_factory,
        refit_config,
    )
    from nemo_refit_reshard.spec import TrainParallel

    shm_before = _staging_segments()
    ray.init(num_cpus=16, include_dashboard=False)
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}}
    config = master_config(spec)
    refit = refit_config(config)
    check_reshard_config(config)
    policy_factory(refit, config)  # what examples/nemo_rl/run_grpo.py does before setup
    installed = sglang_generation.SGLangGenerationWorker
    result["installed_worker"] = getattr(installed, "__ray_actor_class__", installed).__qualname__

    world = TrainParallel.parse(spec["train"]).world_size
    port = free_port()
    policy_actors = [
        MegatronPolicyProcess.options(runtime_env=env).remote(
            r, world, port, spec["config"], spec["train"], spec["policy_gpus"][r]
        )
        for r in range(world)
    ]
    ray.get([a.load.remote(spec["checkpoints"][0]) for a in policy_actors])
    policy = object.__new__(Policy)
    policy.worker_group = WorkerGroup(policy_actors, world)

    tp, servers = spec["sglang_tp"], spec["servers"]
    sglang_cfg = config["policy"]["generation"]
    worker_cls = ray.remote(_cpu_worker_class())
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    actors = []
    for i in range(servers):
        stand_in = {
            "python": spec["sglang_python"],
            "repo": repo,
            "model_dir": spec["model_dir"],
            "name": spec["name"],
            "config": spec["config"],
            "tp": tp,
            "initial": spec["checkpoints"][0],
            "gpus": spec["sglang_gpus"][i * tp : (i + 1) * tp],
        }
        actors.append(
            worker_cls.options(runtime_env=env).remote(
                8, sglang_cfg, rank=i, base_gpu_id=i * tp, num_gpus_per_engine=tp,
                stand_in=stand_in,
            )
        )  # fmt: skip
    # NeMo RL's own SGLangGenerationWorker.init: server arguments, then the launch
    ray.get(
        [
            a.init.remote(
                dist_init_addr=f"127.0.0.1:{free_port()}",
                port=free_port(),
                nccl_port=free_port(),
                host="127.0.0.1",
                router_ip=None,
                router_port=None,
            )
            for a in actors
        ]
    )
    result["server_args"] = ray.get(actors[0].computed_server_args.remote())
    generation = object.__new__(SGLangGeneration)
    generation.all_engines = actors
    generation.num_gpus_per_engine = tp
    generation.num_gpus_per_node = 8
    generation.needs_offload = True
    generation.sglang_cfg = sglang_cfg
    generation.weight_synchronizer = None
    try:
        generation.finish_generation()  # NeMo RL's init_sglang ends with it
        # GRPO's setup for backend sglang: our policy worker records the size
        policy.set_rollout_num_gpus_per_engine(generation.num_gpus_per_engine)
        try:
            sync = install_synchronizer(refit, policy, generation, config)
        except Exception as err:
            result["init_error"] = f"{type(err).__name__}: {err}"
            result["init_status"] = _status(actors, spec["checkpoints"][0])
            # the policy ranks live on: what they opened must be closed already
            result["shm_left"] = sorted(_staging_segments() - shm_before)
            return
        result["synchronizer"] = type(sync).__name__
        result["plan"] = str(sync.plan)
        steps: list[dict[str, Any]] = []
        result["steps"] = steps
        for checkpoint in spec["checkpoints"][1:]:
            generation.finish_generation()  # after every generation: SGLang releases memory
            policy.prepare_for_training()
            ray.get([a.load.remote(checkpoint) for a in policy_actors])  # a training step
            record: dict[str, Any] = {"stale_before": sync.is_stale}
            start = time.perf_counter()
            try:
                record["metrics"] = refit_policy_generation(
                    policy, generation, colocated_inference=True
                )
            except Exception as err:
                record["error"] = f"{type(err).__name__}: {err}"
            record["seconds"] = time.perf_counter() - start
            record["stale_after"] = sync.is_stale
            record["report"] = _status(actors, checkpoint)
            steps.append(record)
            if "error" in record:
                break
        result["policy_calls"] = ray.get([a.calls_made.remote() for a in policy_actors])
        sync.shutdown()
        result["closed"] = True
        result["shm_left"] = sorted(_staging_segments() - shm_before)
        result["final"] = _status(actors, spec["checkpoints"][-1])
    finally:
        result["exit_codes"] = ray.get([a.stop_server.remote() for a in actors])


def _staging_segments() -> set[str]:
    """Our colocated staging in OS shared memory (``nrr-*``): a segment left after its
    owner closed outlives the process (Ray kills workers without exit handlers)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("nrr-")}


def _status(actors: list, checkpoint: str) -> list[Any]:
    """Each server's report: per rank the parameters that differ from ``checkpoint``,
    its refit status and versions; the requests the server received, in order."""
    body = {"checkpoint": checkpoint}
    return ray.get([a.stand_in_call.remote("nrr_test/report", body) for a in actors])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], _run)
