"""Build SGLang's own model classes on CPU and load a checkpoint through SGLang's own
``load_weights`` (run under the Python of ``scripts/setup_sglang_cpu.sh``).

    python -m tests.programs.sglang_cpu_job JOB.json RESULT.json

JOB: ``{"builds": [{"id", "model_dir", "tp", "weights", "out"[, "ep", "fuse_shared",
"pp", "pp_layer_partition", "dp"]}]}`` (``pp_layer_partition`` as
``SGLANG_PP_LAYER_PARTITION``; ``dp`` > 1 as ``--dp-size dp --enable-dp-attention``
with ``tp`` SGLang's ``--tp-size``): SGLang
world rank r = pp_rank·tp + tp_rank of every build runs in worker process r, the builds
one after another (``tests/helpers/sglang_cpu.py``; SGLang is imported once per worker
and its parallel state released between builds). Each rank
writes its ``named_parameters()`` to ``out`` with ``_r<rank>`` before ``.safetensors``,
and the tensors SGLang derived after loading (plain tensor attributes of a module, not
parameters or buffers: DeepSeek's ``w_kc``/``w_vc``) with ``_r<rank>_derived``. RESULT:
``{id: [{name: [shape, dtype]} per rank], "derived": {id: [{name: [shape, dtype]} per
rank]}, "ranks": {id: [[pp_rank, tp_rank, engine_rank, attn_dp_rank, attn_tp_rank] per
rank]}}``: SGLang's own pipeline and tensor-parallel ranks of each world rank, what our
receiver's ``engine_rank()`` answers there, and SGLang's attention data-parallel and
tensor-parallel ranks (the last two on 0.5.23 only).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.multiprocessing as mp


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    return {n: [list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in tensors.items()}


def _build(build: dict[str, Any], rank: int, port: int) -> tuple[Any, Any, Any]:
    from safetensors.torch import load_file, save_file

    from tests.helpers.sglang_cpu import build_model, release_model

    partition = build.get("pp_layer_partition")
    if partition:  # read by SGLang's get_pp_indices while the model is built
        os.environ["SGLANG_PP_LAYER_PARTITION"] = ",".join(map(str, partition))
    try:
        model = build_model(
            build["model_dir"],
            build["tp"],
            rank,
            port,
            ep=build.get("ep", 1),
            fuse_shared=build.get("fuse_shared", False),
            pp=build.get("pp", 1),
            dp=build.get("dp", 1),
        )
        model.load_weights(iter(load_file(build["weights"]).items()))
        ranks = _ranks()
        params = {n: p.detach().contiguous() for n, p in model.named_parameters()}
        derived = {
            f"{m}.{attr}": t.detach().contiguous()
            for m, module in model.named_modules()
            for attr, t in vars(module).items()
            # a rotary embedding's cos/sin tables come from the config, not the weights
            # (0.5.12.post1 keeps DeepSeek's as plain tensors; 0.5.23 only on NPU)
            if isinstance(t, torch.Tensor) and not m.endswith("rotary_emb")
        }
    finally:
        os.environ.pop("SGLANG_PP_LAYER_PARTITION", None)
        release_model()
    stem = build["out"].removesuffix(".safetensors")
    save_file(params, f"{stem}_r{rank}.safetensors")
    save_file(derived, f"{stem}_r{rank}_derived.safetensors")
    return _shapes(params), _shapes(derived), ranks


def _ranks() -> list[int]:
    """SGLang's pipeline and tensor-parallel ranks here, our receiver's engine rank, and
    SGLang's attention data-parallel and attention tensor-parallel ranks."""
    from sglang.srt.distributed import parallel_state as ps

    from nemo_refit_reshard.integrations.sglang.receiver import engine_rank

    pp_rank = ps.get_pp_group().rank_in_group
    where = [pp_rank, ps.get_tensor_model_parallel_rank(), engine_rank()]
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # 0.5.12.post1: no runtime context (and no dp attention here)
        return where
    par = get_parallel()
    return [*where, par.attn_dp_rank, par.attn_tp_rank]


def _worker(rank: int, tasks: Any, out: Any) -> None:
    """Rank ``rank`` of every build with tp·pp > rank, one after another in this process
    (SGLang imported once: the import is most of a build's time)."""
    while (task := tasks.get()) is not None:
        build, port = task
        try:
            out.put((rank, _build(build, rank, port), None))
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            import traceback

            out.put((rank, None, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def main(job_path: str, result_path: str) -> int:
    from nemo_refit_reshard.engine.rendezvous import free_port

    job = json.load(open(job_path))
    ctx = mp.get_context("spawn")
    world = [build["tp"] * build.get("pp", 1) for build in job["builds"]]
    width = max(world)
    out = ctx.Queue()
    tasks = [ctx.Queue() for _ in range(width)]
    workers = [ctx.Process(target=_worker, args=(r, tasks[r], out)) for r in range(width)]
    for w in workers:
        w.start()
    result: dict[str, Any] = {"derived": {}, "ranks": {}}
    try:
        for build, size in zip(job["builds"], world):
            port = free_port()
            for r in range(size):
                tasks[r].put((build, port))
            ranks = [out.get(timeout=600) for _ in range(size)]
            errors = [e for _, _, e in ranks if e]
            if errors:
                result = {"error": f"build {build['id']}: {errors[0]}"}
                break
            ordered = [shapes for _, shapes, _ in sorted(ranks, key=lambda x: x[0])]
            result[build["id"]] = [params for params, _, _ in ordered]
            result["derived"][build["id"]] = [derived for _, derived, _ in ordered]
            result["ranks"][build["id"]] = [where for _, _, where in ordered]
    finally:
        for q in tasks:
            q.put(None)
        for w in workers:
            w.join(timeout=60)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
