"""One vLLM generation rank in a refit test (run with vLLM's Python).

    python -m tests.programs.vllm_refit_rank SPEC.json RESULT.json

SPEC: ``{"config", "rank": EngineRank fields, "endpoint", "first_rank", "plan",
"initial": the start-up checkpoint, "checkpoints": [one safetensors path per step],
"route": "extension"|"function", "mode": "refit"|"wrong_plan"|"flashinfer_backend",
"dtype": the engine's (default float32; bfloat16 for FP8)}``. An FP8 engine's result also
has ``deepgemm``: the refusal its worker gives once its layers use kernels that rework
weights after loading.

The model is vLLM's own class, built on CPU with real float32 storage. vLLM's worker
process cannot start without its kernels, so a stand-in worker object carries the
model runner and config the functions read; the operations are dispatched with
vLLM's own ``run_method`` (what ``collective_rpc`` runs in each worker), once through
:class:`ReshardWorkerExtension` methods by name and once as plain callables.

After every refit step each parameter must equal, bit for bit, what vLLM's own
``load_weights`` makes of that step's checkpoint in a second model, and no parameter
storage may have moved.
"""

from __future__ import annotations

import json
import sys
import traceback
from types import SimpleNamespace

import torch

from nemo_refit_reshard.integrations import vllm as refit_vllm
from nemo_refit_reshard.integrations.vllm import ReshardWorkerExtension
from tests.helpers import vllm_cpu


class StandInWorker:
    """What the refit functions read from vLLM's ``Worker``: model runner and config."""

    def __init__(self, model: torch.nn.Module, vllm_config: object) -> None:
        self.model_runner = SimpleNamespace(model=model)
        self.vllm_config = vllm_config


class ExtendedWorker(StandInWorker, ReshardWorkerExtension):
    """As vLLM does with ``worker_extension_cls``: the extension joins the worker's bases."""


def load(model: torch.nn.Module, config: object, path: str) -> None:
    """vLLM's load: ``load_weights``, then, for a quantized engine, its
    ``process_weights_after_loading`` (what its model loader runs; FP8 attention drops
    its KV-cache scale parameters there)."""
    model.load_weights(vllm_cpu.checkpoint_tensors(path))
    if config.model_config.quantization:  # type: ignore[attr-defined]
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        with set_current_vllm_config(config):
            process_weights_after_loading(model, config.model_config, torch.device("cpu"))  # type: ignore[attr-defined]


def refused_kernels(model: torch.nn.Module, config: object) -> str:
    """The error a worker gives when its FP8 layers use kernels that rework weights after
    loading: what a Hopper GPU with DeepGEMM and FlashInfer picks (set on this model's
    layers, after its refit), seen by a fresh worker."""
    from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import (
        DeepGemmFp8BlockScaledMMKernel,
    )
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if hasattr(method, "fp8_linear"):
            method.fp8_linear = object.__new__(DeepGemmFp8BlockScaledMMKernel)
        if hasattr(method, "fp8_backend"):
            method.fp8_backend = Fp8MoeBackend.FLASHINFER_CUTLASS
    try:
        refit_vllm.refit_describe(StandInWorker(model, config))
    except Exception as err:  # noqa: BLE001 - the test asserts on its text
        return f"{type(err).__name__}: {err}"
    return "not refused"


def refused_at_creation(model: torch.nn.Module, config: object) -> str:
    """The error vLLM's engine factory meets when it creates our weight-transfer engine
    on the model ``refused_kernels`` left with re-laying kernels (vLLM start-up)."""
    from vllm.config import WeightTransferConfig

    from nemo_refit_reshard.integrations.vllm.transfer_worker import (
        ReshardWeightTransferEngine,
    )

    try:
        ReshardWeightTransferEngine(
            WeightTransferConfig(backend="reshard"), config, torch.device("cpu"), model
        )
    except Exception as err:  # noqa: BLE001 - the test asserts on its text
        return f"{type(err).__name__}: {err}"
    return "not refused"


def main(spec_path: str, result_path: str) -> None:
    from vllm.v1.serial_utils import run_method

    spec = json.load(open(spec_path))
    rank = vllm_cpu.EngineRank.from_dict(spec["rank"])
    result: dict[str, object] = {"ok": False}
    try:
        dtype = spec.get("dtype", "float32")  # bfloat16 for a block-FP8 engine
        model, config = vllm_cpu.build_model(spec["config"], rank, "cpu", dtype)
        worker_cls = ExtendedWorker if spec["route"] == "extension" else StandInWorker
        worker = worker_cls(model, config)

        def call(op: str, *args: object) -> object:
            if spec["route"] == "extension":
                return run_method(worker, op, args, {})
            return run_method(worker, getattr(refit_vllm, op), args, {})

        if spec["mode"] == "flashinfer_backend":
            from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
                UnquantizedMoeBackend,
            )

            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if hasattr(method, "unquantized_backend"):
                    method.unquantized_backend = UnquantizedMoeBackend.FLASHINFER_CUTLASS
            call("refit_describe")
            return
        if spec["mode"] == "wrong_plan":
            call("refit_check_plan", spec["plan"], spec["first_rank"])
            return
        # vLLM loads a checkpoint at start-up (its loader zeroes the vocabulary padding,
        # which no refit writes); then every step's refit replaces the rest.
        load(model, config, spec["initial"])
        described = call("refit_describe")
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        group_rank = call("refit_join", spec["endpoint"], spec["first_rank"])
        written = call("refit_load_plan", spec["plan"])
        steps = []
        for path in spec["checkpoints"]:
            timing = call("refit_step")
            truth, truth_config = vllm_cpu.build_model(spec["config"], rank, "cpu", dtype)
            load(truth, truth_config, path)
            want = dict(truth.named_parameters())
            differ = [n for n, p in model.named_parameters() if not torch.equal(p, want[n])]
            moved = [n for n, p in model.named_parameters() if p.data_ptr() != pointers[n]]
            steps.append({"differ": differ, "moved": moved, "timing": timing})
        call("refit_close")
        if config.model_config.quantization:  # type: ignore[attr-defined]
            result["deepgemm"] = refused_kernels(model, config)
            result["deepgemm_at_creation"] = refused_at_creation(model, config)
        result.update(
            ok=True,
            group_rank=group_rank,
            written=written,
            params=len(pointers),
            described=described,
            steps=steps,
        )
    except BaseException as err:  # reported to the test, which asserts on it
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
    finally:
        with open(result_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
