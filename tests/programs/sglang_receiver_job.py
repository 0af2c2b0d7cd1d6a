"""Refit SGLang's own model classes on CPU through SGLang's own weight-update path
(run under the Python of ``scripts/setup_sglang_cpu.sh``).

    python -m tests.programs.sglang_receiver_job JOB.json RESULT.json

JOB: ``{"name", "config", "model_dir", "initial", "initial_seed", "steps": [seed, ...],
"timeout_s", "infer": {InferParallel fields}}``. Two
training ranks (Megatron tp=2 float32 shards materialized from each step's canonical
tensors; this project's sender, ``RefitWorker``) and the ranks of one SGLang engine
(SGLang's model class built and first loaded by SGLang, ``tests/helpers/sglang_cpu.py``:
``tp``, ``pp`` = ``--pp-size``, ``engine_dp`` = ``--dp-size`` with
``--enable-dp-attention`` and ``--tp-size`` engine_dp·tp) join one gloo refit group.
Every SGLang rank drives the receiver through SGLang's own scheduler weight-update
manager (``SchedulerWeightUpdaterManager``: begin the session, update from tensor with
``load_format=LOADER``, end it) over SGLang's own ``WeightUpdater``
(0.5.12.post1, NeMo RL's pin: no session; SGLang's own scheduler mixin, then its
``ModelRunner.update_weights_from_tensor``, ``scheduler_weight_updater_0512``), then
after the training ranks have gone tries a plan of another fingerprint and a third step.
After the good steps, SGLang's own ``load_weights`` of the last step's checkpoint is the
reference for every parameter and every derived tensor (MLA's ``w_kc``/``w_vc``, and the
``w_scale`` SGLang makes beside them from an FP8 ``kv_b_proj`` off CUDA).
RESULT: one entry per SGLang rank.

A block-FP8 config (``quantization_config``): the training ranks hold the model
unquantized (float32) and quantize the weights they send where they hold whole blocks,
the SGLang ranks the rest (``layouts/fp8_wire.py``); the
engine starts from, and each step is checked against, the checkpoint quantized from the
same trained tensors (``QuantizedWeights``), e4m3 compared as bytes. SGLang's session
end (``end_weight_update``) runs every quant method's ``process_weights_after_loading``;
with SGLang's CPU engine off (``SGLANG_USE_CPU_ENGINE`` unset) it takes its GPU branch
without DeepGEMM, which keeps block-FP8 weights and scales as loaded, as on Hopper (and
sets unset KV-cache scales, -1.0, to its default 1.0). Stand-in: the receiver refuses
FP8 parameters off NVIDIA Hopper (``fp8_relayout_problems``: elsewhere that pass re-lays
them); the check is answered here as Hopper answers it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import torch.multiprocessing as mp

TRAIN = 2  # training tp


def _infer(job: dict[str, Any]):
    from nemo_refit_reshard.spec import InferParallel

    return InferParallel(**job["infer"])


def _spec(job: dict[str, Any]):
    from nemo_refit_reshard.spec import spec_from_hf_config

    return spec_from_hf_config(job["config"], name=job["name"])


def _engine_tensors(spec: Any, seed: int) -> dict[str, Any]:
    """The checkpoint the engine would load at ``seed``: the trained tensors, or for a
    block-FP8 engine those quantized (e4m3 weights, float32 scales)."""
    from nemo_refit_reshard.engine.quantize import QuantizedWeights
    from tests.helpers.checkpoints import random_tensors

    trained = random_tensors(spec.unquantized(), seed)
    if spec.arch.quant is None:
        return trained
    fp8 = {t.name for t in spec if t.dtype == "float8_e4m3fn"}
    quantized = QuantizedWeights(trained, fp8, spec.arch.quant.block)
    return {t.name: quantized[t.name].contiguous() for t in spec}


def _bytes(tensors: dict[str, Any]) -> dict[str, Any]:
    """e4m3 tensors as their bytes (``torch.equal`` on values would take -0 for 0)."""
    import torch

    fp8 = torch.float8_e4m3fn
    return {n: t.view(torch.uint8) if t.dtype == fp8 else t for n, t in tensors.items()}


def _same(a: Any, b: Any) -> bool:
    import torch

    a, b = _bytes({"a": a, "b": b}).values()
    return a.dtype == b.dtype and torch.equal(a, b)


def _w_scales(model: Any) -> dict[str, Any]:
    """The per-tensor scales SGLang's post_load_weights makes beside ``w_kc``/``w_vc`` from
    an FP8 ``kv_b_proj`` off CUDA (reassigned on every load: compared, not tracked)."""
    import torch

    return {
        f"{name}.w_scale": m.w_scale
        for name, m in model.named_modules()
        if isinstance(getattr(m, "w_scale", None), torch.Tensor)
    }


def _train(job: dict[str, Any], rank: int) -> None:
    from nemo_refit_reshard.engine.materialize import materialize
    from nemo_refit_reshard.integrations.worker import RefitEndpoint, RefitWorker
    from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout
    from nemo_refit_reshard.spec import TrainParallel
    from tests.helpers.checkpoints import random_tensors

    spec = _spec(job).unquantized()  # the trained model (an FP8 engine's: quantized sends)
    opts = MegatronOptions(params_dtype="float32")
    layout = megatron_layout(spec, TrainParallel(tp=TRAIN), rank, opts)
    endpoint = dataclasses.replace(RefitEndpoint.from_json(job["endpoint"]), group_rank=rank)
    tensors = materialize(layout, random_tensors(spec, job["steps"][0]))
    worker = RefitWorker(endpoint, tensors)
    worker.join()
    worker.load_plan(job["plan"][str(rank)])
    for step, seed in enumerate(job["steps"], start=1):
        # a trainer's optimizer step: new values in the same storage
        for name, value in materialize(layout, random_tensors(spec, seed)).items():
            tensors[name].copy_(value)
        worker.refit(step)
    worker.close()  # gone: the SGLang ranks' third step finds no peer


def _sglang(job: dict[str, Any], rank: int, port: int, out: Any) -> None:
    try:
        out.put((rank, _sglang_rank(job, rank, port), None))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        import traceback

        out.put((rank, None, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def _sglang_rank(job: dict[str, Any], rank: int, port: int) -> dict[str, Any]:
    from importlib.metadata import version

    from safetensors.torch import load_file

    from nemo_refit_reshard.engine.materialize import mismatches
    from nemo_refit_reshard.integrations.sglang import (
        LOADER,
        refit_command,
        refit_describe,
        refit_require_fresh,
        refit_status,
    )
    from nemo_refit_reshard.integrations.worker import StaleWeightsError
    from nemo_refit_reshard.layouts.sglang import SGLANG_KV_CACHE_SCALES, sglang_layout
    from tests.helpers.sglang_cpu import build_model
    from tests.helpers.sglang_scheduler import (
        derived_tensors,
        scheduler_weight_updater,
        scheduler_weight_updater_0512,
    )

    infer = _infer(job)
    tp_size = infer.engine_dp * infer.tp  # SGLang's --tp-size
    model = build_model(job["model_dir"], tp_size, rank, port, pp=infer.pp, dp=infer.engine_dp)
    model.load_weights(iter(load_file(job["initial"]).items()))  # SGLang's own start-up load
    if _spec(job).arch.quant is not None:  # the stand-in for Hopper's answer (docstring)
        from nemo_refit_reshard.integrations.sglang import receiver

        receiver.fp8_relayout_problems = lambda params: []
    from sglang.srt.managers import io_struct as io
    from sglang.srt.utils import MultiprocessingSerializer

    # 0.5.12.post1 (NeMo RL's pin) has no weight-update session and no
    # SchedulerWeightUpdaterManager: its scheduler mixin calls the ModelRunner directly
    session = hasattr(io, "BeginWeightUpdateReqInput")
    build = scheduler_weight_updater if session else scheduler_weight_updater_0512
    manager, versions = build(model, rank, [LOADER])
    spec = _spec(job)
    layout = sglang_layout(spec, infer, rank, params_dtype="float32")
    params = dict(model.named_parameters())
    # an FP8 engine's KV-cache scales: live parameters the refit must leave alone
    kv_scales = {n: p.clone() for n, p in params.items() if n.endswith(SGLANG_KV_CACHE_SCALES)}
    params = {n: p for n, p in params.items() if n not in kv_scales}
    pointers = {n: p.data_ptr() for n, p in params.items()}
    derived = derived_tensors(model)  # what SGLang's post_load_weights made at start-up
    derived_pointers = {n: t.data_ptr() for n, t in derived.items()}
    answers: list[list[Any]] = []

    # Every command, serialized up front as the driver serializes it in its own process
    # (Engine._serialize_tensors_per_rank): SGLang's torch-reduction patch, which the
    # scheduler side installs when it deserializes, cannot reduce a CPU tensor, and here
    # driver and rank share one process.
    last = len(job["steps"]) + 1
    script = {
        "join": ("join", dict(endpoint_json=job["endpoint"], first_rank=TRAIN)),
        "plan": ("load_plan", dict(plan=job["plan"], fingerprint=job["fingerprint"])),
        **{f"step{k}": ("step", dict(step=k)) for k in range(1, last + 1)},
        "bad_plan": ("load_plan", dict(plan=job["plan"], fingerprint="0" * 64)),
        "close": ("close", {}),
    }
    payloads = {
        key: MultiprocessingSerializer.serialize(refit_command(op, **arguments))
        for key, (op, arguments) in script.items()
    }

    def run(key: str) -> None:
        # the driver's sequence per call, as the Engine sends it to each scheduler: begin
        # the session, the loader's command (one copy per tp rank), end the session
        # (0.5.12.post1: the command alone)
        if session:
            assert manager.begin_weight_update(io.BeginWeightUpdateReqInput()).success
        request = io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[payloads[key]] * tp_size,
            load_format=LOADER,
            weight_version=key,
        )
        answer = manager.update_weights_from_tensor(request)
        answers.append([script[key][0], answer.success, answer.message])
        if session:
            assert manager.end_weight_update(io.EndWeightUpdateReqInput()).success

    result: dict[str, Any] = {
        "sglang_version": version("sglang"),
        "described": refit_describe(model),
        "steps": [],
    }
    run("join")
    run("plan")
    for step, seed in enumerate(job["steps"], start=1):
        before = {n: t.clone() for n, t in derived_tensors(model).items()}
        run(f"step{step}")
        canonical = _engine_tensors(spec, seed)
        now = derived_tensors(model)
        result["steps"].append(
            {
                "step": step,
                "differ": mismatches(layout, _bytes(params), _bytes(canonical)),
                "moved": [n for n, p in params.items() if p.data_ptr() != pointers[n]],
                "status": refit_status(model),
                "derived": sorted(now),
                "derived_unchanged": [n for n, t in now.items() if _same(t, before[n])],
                "derived_moved": [n for n, t in now.items() if t.data_ptr() != derived_pointers[n]],
            }
        )
    # the KV-cache scales after both refits (no plan writes them; SGLang's session end
    # sets unset ones, -1.0, to its default 1.0)
    live = dict(model.named_parameters())
    result["kv_scales"] = {n: float(t) for n, t in kv_scales.items()}
    result["kv_scales_changed"] = {
        n: float(live[n]) for n, t in kv_scales.items() if not _same(t, live[n])
    }
    # Reference: SGLang's own load_weights of the last step's checkpoint (it runs
    # post_load_weights itself) must give the same parameters and derived tensors.
    made = {**params, **derived_tensors(model), **_w_scales(model)}
    refit = {n: t.clone() for n, t in made.items()}
    model.load_weights(iter(canonical.items()))
    reloaded = {**params, **derived_tensors(model), **_w_scales(model)}
    result["reload_differ"] = [n for n, t in refit.items() if not _same(t, reloaded[n])]
    result["w_scales"] = sorted(_w_scales(model))

    run("bad_plan")  # another plan's slice
    result["bad_plan"] = refit_status(model)
    run(f"step{last}")  # the training ranks have gone
    result["dead_peer"] = refit_status(model)
    try:
        refit_require_fresh(model)  # what the driver asks before continuing generation
        result["require_fresh"] = None
    except StaleWeightsError as err:
        result["require_fresh"] = str(err)
    result["moved_after_failure"] = [n for n, p in params.items() if p.data_ptr() != pointers[n]]
    run("close")
    result["answers"] = answers  # what SGLang answered each call (plugin.py)
    result["versions"] = versions  # the weight versions SGLang recorded
    return result


def main(job_path: str, result_path: str) -> int:
    from safetensors.torch import save_file

    from nemo_refit_reshard.engine.rendezvous import free_port
    from nemo_refit_reshard.integrations.worker import RefitEndpoint
    from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout
    from nemo_refit_reshard.layouts.fp8_wire import wire_layouts
    from nemo_refit_reshard.layouts.sglang import sglang_layout
    from nemo_refit_reshard.plan import plan_refit, rank_plan
    from nemo_refit_reshard.spec import TrainParallel

    job = json.load(open(job_path))
    spec, infer = _spec(job), _infer(job)
    save_file(_engine_tensors(spec, job["initial_seed"]), job["initial"])
    opts = MegatronOptions(params_dtype="float32")
    sources = [megatron_layout(spec, TrainParallel(tp=TRAIN), r, opts) for r in range(TRAIN)]
    dests = [sglang_layout(spec, infer, r, params_dtype="float32") for r in range(infer.world_size)]
    if spec.arch.quant is not None:
        # the training ranks quantize the weights they hold in whole 128x128 blocks and
        # send e4m3 + scales; the rest (Megatron splits MLA's kv_a_proj_with_mqa over tp)
        # crosses in float32 and the SGLang ranks quantize it
        sources, dests, _ = wire_layouts(spec, sources, dests, "float32")
    plan = plan_refit(spec, sources, dests, bucket_mb=1)
    ranks = range(TRAIN + infer.world_size)
    job["plan"] = {str(r): rank_plan(plan, r).to_json() for r in ranks}
    job["fingerprint"] = plan.fingerprint
    # rendezvous waits for SGLang's slow start-up; every later wait is short, so the
    # step after the training ranks have gone fails within ``timeout_s``
    endpoint = RefitEndpoint(
        "127.0.0.1", free_port(), TRAIN + infer.world_size, 0, "gloo",
        timeout_s=job["timeout_s"], connect_timeout_s=300,
    )  # fmt: skip
    job["endpoint"] = endpoint.to_json()
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_train, args=(job, r)) for r in range(TRAIN)]
    engine = range(infer.world_size)
    procs += [ctx.Process(target=_sglang, args=(job, r, port, out)) for r in engine]
    for p in procs:
        p.start()
    got = sorted((out.get(timeout=600) for _ in engine), key=lambda x: x[0])
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    errors = [e for _, _, e in got if e]
    result = {"error": errors[0]} if errors else {"ranks": [r for _, r, _ in got]}
    result["train_exitcodes"] = [p.exitcode for p in procs[:TRAIN]]
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
