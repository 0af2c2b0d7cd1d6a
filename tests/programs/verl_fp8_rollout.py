"""veRL's FP8 rollout loading what the ``reshard`` checkpoint engine yields (vLLM's Python).

    python -m tests.programs.verl_fp8_rollout SPEC.json RESULT.json

SPEC: ``{"config": the trained model's config.json, "engine": ReshardEngineConfig fields
(``model`` is filled in here), "actors": A, "infer": one replica's vLLM parallelism, as
``EngineRank`` fields without the rank, "checkpoints": [one BF16 safetensors path per
step], "verl": veRL's package directory, "ranks": optional, the rollout ranks to check}``.

veRL's ``rollout.quantization: fp8`` starts vLLM from the BF16 model with a 128×128
block-FP8 ``quantization_config`` that leaves every MoE router unquantized
(``vllm_async_server._apply_quantization``, veRL 0.9.1) and installs its patches
(``apply_vllm_quant_patches``); each update its worker extension
(``vLLMColocateWorkerExtension.update_weights_from_ipc``) runs
``prepare_quanted_weights_for_loading``, then ``load_quanted_weights`` on every bucket of
BF16 tensors it receives (it quantizes each full tensor, then calls vLLM's
``load_weights``), then ``process_quanted_weights_after_loading``. Those three veRL
functions run here, in that order, on vLLM 0.33's own FP8 model classes, for two models
of every rollout rank:

* the truth: fed the step's full BF16 tensors (what veRL's own engines hand over);
* ours: fed what the reshard engine yields on that rank — the full-shape tensors
  ``rebuild.canonical_tensors`` makes from the rank's slice of the plan — with every
  element outside the rank's boxes overwritten by noise (they are unspecified), each
  tensor copied as veRL's bucket sender copies it.

After every step each parameter of the two (e4m3 weights and their scales included) must
be bit-equal. Stand-ins: vLLM's worker (a model-runner namespace, as in
``vllm_refit_rank.py``) and its one-process ``torch.distributed`` group, the FP8 kernel
choice (``vllm_cpu.allow_fp8_block_kernel_on_cpu``), and veRL's package ``__init__`` (it
imports veRL's trainer stack; the quantization modules themselves are veRL's, imported
from its installed package).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import traceback
import types
from types import SimpleNamespace
from typing import Any

import torch

from nemo_refit_reshard.integrations.checkpoint_engine import (
    ReshardEngineConfig,
    canonical_tensors,
    plan_full_tensors,
)
from nemo_refit_reshard.layouts import Box, VllmOptions, vllm_layouts
from nemo_refit_reshard.spec import InferParallel, load_model_spec
from tests.helpers import vllm_cpu
from tests.helpers.vllm_reference import materialize


def import_verl_quantization(root: str) -> types.ModuleType:
    """veRL's ``verl.utils.vllm.vllm_quant_utils`` without running ``verl/__init__``."""
    for name, path in (("verl", root), ("verl.utils", os.path.join(root, "utils"))):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package
    import verl.utils.vllm.vllm_quant_utils as quant_utils

    return quant_utils


def verl_fp8_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config vLLM sees under veRL's ``rollout.quantization: fp8``."""
    layers = config["num_hidden_layers"]
    quantization = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "ignored_layers": [f"model.layers.{i}.mlp.gate" for i in range(layers)],
    }
    return {**config, "quantization_config": quantization}


def poisoned(
    tensors: Any, boxes: dict[str, list[Box]], generator: torch.Generator
) -> list[tuple[str, torch.Tensor]]:
    """Each yielded tensor copied (veRL's bucket sender copies), noise outside ``boxes``."""
    out = []
    for name, tensor in tensors:
        noise = torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
        for box in boxes[name]:
            noise[box.slices()] = tensor[box.slices()]
        out.append((name, noise))
    return out


def boxes_of(slice_: Any) -> dict[str, list[Box]]:
    """The canonical boxes a rollout rank receives, per canonical tensor."""
    boxes: dict[str, list[Box]] = {}
    for m in slice_.messages:
        for t in m.transfers:
            if m.dst == slice_.group_rank:
                boxes.setdefault(t.canonical, []).append(t.canonical_box)
    return boxes


def control(spec: dict[str, Any], quant: types.ModuleType, slice_: Any, boxes: dict) -> list:
    """The comparison can fail: rollout rank 0 fed the first step with one element of one
    received box changed loads differently (that weight and its scale)."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    r = vllm_cpu.EngineRank(**spec["infer"])
    runners = []
    for _ in range(2):
        model, config = vllm_cpu.build_model(
            verl_fp8_config(spec["config"]), r, device="cpu", dtype="bfloat16"
        )
        with set_current_vllm_config(config):
            process_weights_after_loading(model, config.model_config, torch.device("cpu"))
        runners.append(SimpleNamespace(model=model, vllm_config=config))
    canonical = {n: t.to(torch.bfloat16) for n, t in load_file(spec["checkpoints"][0]).items()}
    name = "model.layers.0.self_attn.o_proj.weight"
    changed = dict(canonical)
    changed[name] = canonical[name].clone()
    changed[name][boxes[name][0].offsets] += 1.0
    with set_current_vllm_config(runners[0].vllm_config):
        verl_update(quant, runners[0], list(canonical.items()))
        verl_update(quant, runners[1], list(changed.items()))
    want, got = dict(runners[0].model.named_parameters()), dict(runners[1].model.named_parameters())
    return sorted(
        n for n, p in want.items() if not torch.equal(got[n].view(torch.uint8), p.view(torch.uint8))
    )


def verl_update(quant: types.ModuleType, runner: SimpleNamespace, weights: list) -> None:
    """One update as veRL's worker extension runs it (one bucket)."""
    state = quant.prepare_quanted_weights_for_loading(runner.model)
    quant.load_quanted_weights(weights, runner)
    quant.process_quanted_weights_after_loading(runner.model, state)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    quant = import_verl_quantization(spec["verl"])
    # veRL's quantizer logs from global rank 0: a vLLM worker has torch.distributed up.
    fd, store = tempfile.mkstemp(prefix="verl-fp8-pg-")
    os.close(fd)
    # FileStore removes it when the group is destroyed; this is for when it is not.
    atexit.register(lambda: os.path.exists(store) and os.unlink(store))
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    quant.apply_vllm_quant_patches()  # veRL does this before the engine builds
    model_dir = tempfile.mkdtemp(prefix="verl-fp8-model-")
    atexit.register(shutil.rmtree, model_dir, ignore_errors=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(spec["config"], f)
    engine = ReshardEngineConfig(**{**spec["engine"], "model": model_dir})
    one = vllm_cpu.EngineRank(**spec["infer"])
    actors, rollout = spec["actors"], one.tp * one.pp * one.engine_dp
    full = plan_full_tensors(engine, actors, rollout)
    trained = load_model_spec(model_dir)
    layouts = vllm_layouts(
        trained, InferParallel.parse(engine.infer), VllmOptions(vllm_version="0.33.0")
    )
    shapes = {t.name: t.shape for t in trained}
    generator = torch.Generator().manual_seed(7)
    result: dict[str, Any] = {"ranks": []}
    for rank in spec.get("ranks", range(rollout)):
        r = dataclasses.replace(one, tp_rank=rank % one.tp, pp_rank=rank // one.tp)
        slice_ = full.slices[actors + rank]
        boxes = boxes_of(slice_)
        runners = []
        for _ in range(2):  # the truth, ours
            model, config = vllm_cpu.build_model(
                verl_fp8_config(spec["config"]), r, device="cpu", dtype="bfloat16"
            )
            with set_current_vllm_config(config):
                process_weights_after_loading(model, config.model_config, torch.device("cpu"))
            runners.append(SimpleNamespace(model=model, vllm_config=config))
        steps = []
        for path in spec["checkpoints"]:
            canonical = load_file(path)
            local = {
                name: value.to(torch.bfloat16)
                for name, value in materialize(layouts[rank], canonical).items()
            }
            rebuilt = poisoned(canonical_tensors(slice_, local, shapes), boxes, generator)
            truth, ours = runners
            with set_current_vllm_config(truth.vllm_config):
                verl_update(quant, truth, [(n, t.to(torch.bfloat16)) for n, t in canonical.items()])
                verl_update(quant, ours, rebuilt)
            want = dict(truth.model.named_parameters())
            got = dict(ours.model.named_parameters())
            steps.append(
                {
                    "params": len(want),
                    "fp8": sorted(n for n, p in want.items() if p.dtype == torch.float8_e4m3fn),
                    "mismatch": sorted(
                        n
                        for n, p in want.items()
                        if n not in got
                        or got[n].dtype != p.dtype
                        or not torch.equal(got[n].view(torch.uint8), p.view(torch.uint8))
                    ),
                    "yielded": sorted(boxes),
                }
            )
        result["ranks"].append(steps)
    result["control"] = control(spec, quant, full.slices[actors], boxes_of(full.slices[actors]))
    return result


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        result = run(spec)
    except Exception as err:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
