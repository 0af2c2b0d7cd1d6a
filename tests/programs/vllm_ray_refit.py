"""Megatron-core trainer ranks refit vLLM worker ranks through vLLM's weight-transfer API
with the ``reshard`` backend, every party a Ray actor (vLLM's Python, CPU).

    python -m tests.programs.vllm_ray_refit SPEC.json RESULT.json

SPEC: ``{"config", "train_tp", "infer": [EngineRank fields per worker rank], "initial",
"checkpoints": [one safetensors path per step], "fail_after"}``.

* Trainer ranks: live megatron-core ``GPTModel``s (tensor parallel over gloo), filled
  from each step's checkpoint through Megatron's own ``sharded_state_dict`` placement
  (``megatron_cpu.load_hf_through_sharded_state_dict``), never through our layout. Each
  builds the trainer engine with vLLM's ``WeightTransferTrainerFactory.trainer_init``
  from a ``MegatronSource`` over its model; rank 0 drives the engine with vLLM's own
  ``RayVLLMWeightSyncClient``.
* The ``LLM`` actor: vLLM's ``RLOfflineMixin`` methods over the stand-in engine core
  (``tests/helpers/vllm_control_plane.py``).
* Worker ranks: vLLM's own model class with real float32 storage, the engine from vLLM's
  ``WeightTransferEngineFactory`` for ``WeightTransferConfig(backend="reshard")``, the
  phases run by vLLM's own ``Worker`` methods. After every committed update each
  parameter must equal, bit for bit, what vLLM's own ``load_weights`` makes of that
  step's checkpoint, and no parameter storage may move.

With ``fail_after`` = n, trainer rank 1 leaves after n updates and rank 0 tries update
n+1, which must fail and commit nothing. With ``colocated_steps`` = k, every party then
starts again colocated (worker rank d sharing trainer rank d's "GPU": the trainer's
staging in OS shared memory), the workers' weights poisoned, and k updates follow.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import traceback
from typing import Any

import ray
import torch

# Every call waits at most this long: a hung party fails the test with a message.
WAIT_S = 480


@ray.remote(num_cpus=0)
class VllmWorkerRank:
    """One vLLM worker rank: its model, the engine vLLM's factory makes, vLLM's methods."""

    def __init__(
        self, config: dict[str, Any], rank: dict[str, Any], initial: str, checkpoints: list[str]
    ) -> None:
        torch.set_num_threads(1)
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        from nemo_refit_reshard.integrations.vllm import plugin
        from tests.helpers import vllm_cpu
        from tests.helpers.vllm_control_plane import StandInWorker, install_vllm_worker_methods

        install_vllm_worker_methods()
        plugin.register()  # what vLLM's load_general_plugins() does via the entry point
        self.config, self.rank = config, vllm_cpu.EngineRank.from_dict(rank)
        self.checkpoints = checkpoints  # step n's truth: vLLM's load_weights of entry n-1
        # A block-FP8 engine (its quantization_config): bfloat16 besides the e4m3 weights
        self.dtype = "bfloat16" if config.get("quantization_config") else "float32"
        self.model, vllm_config = vllm_cpu.build_model(config, self.rank, "cpu", self.dtype)
        self.model.load_weights(vllm_cpu.checkpoint_tensors(initial))
        self.engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="reshard"), vllm_config, torch.device("cpu"), self.model
        )
        self.worker = StandInWorker(self.engine, vllm_config, self.rank.tp_rank)
        self.pointers = {n: p.data_ptr() for n, p in self.model.named_parameters()}
        self.pending: dict[str, Any] = {}
        self.result: dict[str, Any] = {"engine": type(self.engine).__name__, "committed": []}
        self.result["steps"] = []

    def execute(self, method: str, **kwargs: Any) -> Any:
        if method == "status":
            return {**self.engine.status(), "active": self.worker._weight_update_active}
        if method == "engine_finish":  # the engine alone, past vLLM's own guard
            return self.engine.finish_weight_update()
        if method == "poison":  # every element a refit writes must be written again
            from nemo_refit_reshard.integrations.vllm.worker import KV_CACHE_SCALES

            vocab = int(self.config["vocab_size"])
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if name.endswith(KV_CACHE_SCALES):
                        continue  # an FP8 engine's KV-cache scales: constants, not refit
                    if name in ("model.embed_tokens.weight", "lm_head.weight"):
                        # vLLM's vocabulary padding rows: no refit writes them
                        start = self.rank.tp_rank * p.shape[0]
                        p[: max(0, vocab - start)].fill_(float("nan"))
                    else:
                        p.fill_(float("nan"))
            return None
        if method == "update_weights":
            self.pending = dict(kwargs["update_info"])
        value = getattr(self.worker, method)(**kwargs)
        if method == "finish_weight_update":
            self.result["committed"].append(self.engine.weight_version)
            self.check(int(self.pending["step"]), self.engine.weight_version)
        return value

    def check(self, step: int, version: str) -> None:
        """The live parameters against vLLM's ``load_weights`` of the checkpoint the
        committed version names (``v3``, ``c3``: checkpoint entry 2); ``step`` is the refit
        group's own count (a group made for a newcomer starts again at 1)."""
        from tests.helpers import vllm_cpu

        truth, _ = vllm_cpu.build_model(self.config, self.rank, "cpu", self.dtype)
        truth.load_weights(vllm_cpu.checkpoint_tensors(self.checkpoints[int(version[1:]) - 1]))
        want = dict(truth.named_parameters())
        params = list(self.model.named_parameters())
        self.result["steps"].append(
            {
                "step": step,
                "version": version,
                "differ": [n for n, p in params if not torch.equal(p, want[n])],
                "moved": [n for n, p in params if p.data_ptr() != self.pointers[n]],
            }
        )

    def ready(self) -> int:
        return len(self.pointers)

    def report(self) -> dict[str, Any]:
        self.engine.shutdown()
        return self.result


@ray.remote(num_cpus=0)
class MegatronTrainerRank:
    """One Megatron-core tensor-parallel rank of a live ``GPTModel`` on gloo."""

    def __init__(self, config: dict[str, Any], tp: int, rank: int, init_file: str) -> None:
        import warnings

        warnings.filterwarnings("ignore")  # megatron's TE/Apex fallback notices
        torch.set_num_threads(1)
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from nemo_refit_reshard.spec import TrainParallel, spec_from_hf_config
        from tests.helpers import megatron_cpu as mc

        mc.apply_cpu_patches()
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        model_parallel_cuda_manual_seed(1234)
        self.hf, self.rank = config, rank
        self.spec = spec_from_hf_config(config, name="test")
        self.parallel = TrainParallel(tp=tp)
        self.vocab = mc.padded_vocab(self.spec.arch.vocab_size, tp)
        self.chunks = mc.build_gpt(config, self.spec, self.parallel, self.vocab)
        self.storage: dict[str, int] = {}
        # One trainer engine per vLLM engine (each its own refit group), by name
        self.engines: dict[str, Any] = {}

    def load(self, checkpoint: str) -> int:
        """The optimizer step's stand-in: new values in the same storage, placed by
        Megatron's sharded state dict."""
        from safetensors.torch import load_file

        from tests.helpers import megatron_cpu as mc

        canonical = load_file(checkpoint)
        n = mc.load_hf_through_sharded_state_dict(
            self.chunks, 1, self.spec.arch, canonical, self.vocab
        )
        pointers = {k: v.data_ptr() for k, v in mc.local_tensors(self.chunks, 1).items()}
        assert not self.storage or pointers == self.storage, "Megatron's storage moved"
        self.storage = pointers
        return n

    def init_transfer(
        self,
        llm: Any,
        infer_tp: int,
        colocated: bool = False,
        quantization: dict | None = None,
        name: str = "llm",
        timeout_s: float = 60,
    ) -> str:
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from nemo_refit_reshard.integrations.vllm import plugin
        from nemo_refit_reshard.integrations.vllm.transfer_sources import MegatronSource
        from nemo_refit_reshard.integrations.vllm.transfer_trainer import ReshardTrainerInitInfo

        plugin.register()  # a trainer is not a vLLM process: vLLM loads no plugins here
        info = ReshardTrainerInitInfo(
            rank=self.rank,
            vllm_parallel={"tp": infer_tp},
            params_dtype="bfloat16" if quantization else "float32",
            quantization=quantization,
            # port and secret None: rank 0 picks them and shares them over Megatron's
            # own torch.distributed world (engine.rendezvous.broadcast_text)
            timeout_s=timeout_s,
            connect_timeout_s=WAIT_S,
            bucket_mb=1,
            colocated=colocated,
        )
        source = MegatronSource(self.chunks, self.spec, self.parallel, self.rank)
        self.engines[name] = WeightTransferTrainerFactory.trainer_init(
            info, client=RayVLLMWeightSyncClient(llm), source=source
        )
        return self.engines[name].plan.fingerprint

    def sync(self, version: str, name: str = "llm") -> None:
        self.engines[name].send_weights(weight_version=version)

    def try_sync(self, version: str, name: str = "llm") -> str | None:
        try:
            self.sync(version, name)
        except Exception as err:
            return f"{type(err).__name__}: {err}"[:600]
        return None

    def leave(self, name: str = "llm") -> None:
        """Shut the trainer engine of vLLM engine ``name`` (its refit group) down, if it
        is still up."""
        engine = self.engines.pop(name, None)
        if engine is not None:
            engine.shutdown()


def run(spec: dict[str, Any], work: str) -> dict[str, Any]:
    from tests.helpers.vllm_control_plane import cpu_llm_class

    cfg, tp, checkpoints = spec["config"], spec["train_tp"], spec["checkpoints"]
    fail_after = spec.get("fail_after")
    # A block-FP8 engine: vLLM builds the quantized config and loads (and is checked
    # against) the quantized checkpoints; the trainer holds the BF16 model.
    quant = spec.get("quantization")
    engine_cfg = {**cfg, "quantization_config": quant} if quant else cfg
    loads = spec.get("fp8_checkpoints") or checkpoints
    initial = spec.get("fp8_initial") or spec["initial"]
    workers = [VllmWorkerRank.remote(engine_cfg, r, initial, loads) for r in spec["infer"]]
    ray.get([w.ready.remote() for w in workers], timeout=WAIT_S)
    llm = ray.remote(num_cpus=0)(cpu_llm_class()).remote(workers)
    trainers = [MegatronTrainerRank.remote(cfg, tp, r, f"{work}/init") for r in range(tp)]
    out: dict[str, Any] = {}
    out["sharded_tensors"] = ray.get(
        [t.load.remote(checkpoints[0]) for t in trainers], timeout=WAIT_S
    )
    infer_tp = spec["infer"][0]["tp"]
    out["fingerprints"] = ray.get(
        [t.init_transfer.remote(llm, infer_tp, False, quant) for t in trainers], timeout=WAIT_S
    )
    for step, path in enumerate(checkpoints):
        if fail_after is not None and step == fail_after:
            break
        ray.get([t.load.remote(path) for t in trainers], timeout=WAIT_S)
        ray.get([t.sync.remote(f"v{step + 1}") for t in trainers], timeout=WAIT_S)
    out["llm_version"] = ray.get(llm.get_weight_version.remote(), timeout=WAIT_S)
    if fail_after is not None:
        ray.get(trainers[1].leave.remote(), timeout=WAIT_S)  # the next update cannot complete
        out["failed_update"] = ray.get(
            trainers[0].try_sync.remote(f"v{fail_after + 1}"), timeout=WAIT_S
        )
        out["llm_version_after_failure"] = ray.get(llm.get_weight_version.remote())
        out["status"] = ray.get(llm.rpc.remote("status"), timeout=WAIT_S)
        try:
            ray.get(llm.rpc.remote("engine_finish"), timeout=WAIT_S)
            out["engine_finish"] = None
        except ray.exceptions.RayTaskError as err:
            out["engine_finish"] = str(err)[-800:]
    if spec.get("colocated_steps"):
        out["colocated"] = colocated_phase(spec, llm, trainers, checkpoints, infer_tp)
    out["workers"] = ray.get([w.report.remote() for w in workers], timeout=WAIT_S)
    return out


def colocated_phase(
    spec: dict[str, Any], llm: Any, trainers: list[Any], checkpoints: list[str], infer_tp: int
) -> dict[str, Any]:
    """The same parties again, colocated: worker rank d on trainer rank d's "GPU" (the
    staging shared through OS shared memory); the workers' weights poisoned first."""
    ray.get([t.leave.remote() for t in trainers], timeout=WAIT_S)
    ray.get(llm.shutdown_weight_transfer_engine.remote(), timeout=WAIT_S)
    ray.get(llm.rpc.remote("poison"), timeout=WAIT_S)
    out: dict[str, Any] = {}
    out["fingerprints"] = ray.get(
        [t.init_transfer.remote(llm, infer_tp, True, spec.get("quantization")) for t in trainers],
        timeout=WAIT_S,
    )
    for step, path in enumerate(checkpoints[: spec["colocated_steps"]]):
        ray.get([t.load.remote(path) for t in trainers], timeout=WAIT_S)
        ray.get([t.sync.remote(f"c{step + 1}") for t in trainers], timeout=WAIT_S)
    out["llm_version"] = ray.get(llm.get_weight_version.remote(), timeout=WAIT_S)
    out["status"] = ray.get(llm.rpc.remote("status"), timeout=WAIT_S)
    return out


def main(spec_path: str, result_path: str, job: Any = run) -> None:
    """Run ``job(spec, work)`` in a Ray of its own; its result (or the error) to RESULT."""
    import os

    spec = json.load(open(spec_path))
    result: dict[str, Any] = {"ok": False}
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
        result.update(job(spec, os.path.dirname(os.path.abspath(spec_path))))
        result["ok"] = True
    except BaseException as err:  # reported to the test, which asserts on it
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
    finally:
        with open(result_path, "w") as f:
            json.dump(result, f)
        ray.shutdown()


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # a hung driver's stacks: kill -USR1 <pid>
    main(sys.argv[1], sys.argv[2])
