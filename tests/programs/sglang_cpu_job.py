"""Build SGLang's own model classes on CPU and load a checkpoint through SGLang's own
``load_weights`` (run under the Python of ``scripts/setup_sglang_cpu.sh``).

    python -m tests.programs.sglang_cpu_job JOB.json RESULT.json

JOB: ``{"builds": [{"id", "model_dir", "tp", "weights", "out"[, "ep", "fuse_shared"]}]}``:
for each build, one process per tensor-parallel rank (``tests/helpers/sglang_cpu.py``),
each writing its ``named_parameters()`` to ``out`` with ``_r<rank>`` before
``.safetensors``, and the tensors SGLang derived after loading (plain tensor attributes
of a module, not parameters or buffers: DeepSeek's ``w_kc``/``w_vc``) with
``_r<rank>_derived``. RESULT: ``{id: [{name: [shape, dtype]} per rank], "derived": {id:
[{name: [shape, dtype]} per rank]}}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.multiprocessing as mp


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    return {n: [list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in tensors.items()}


def _rank(build: dict[str, Any], rank: int, port: int, out: Any) -> None:
    try:
        from safetensors.torch import load_file, save_file

        from tests.helpers.sglang_cpu import build_model

        model = build_model(
            build["model_dir"],
            build["tp"],
            rank,
            port,
            ep=build.get("ep", 1),
            fuse_shared=build.get("fuse_shared", False),
        )
        model.load_weights(iter(load_file(build["weights"]).items()))
        params = {n: p.detach().contiguous() for n, p in model.named_parameters()}
        derived = {
            f"{m}.{attr}": t.detach().contiguous()
            for m, module in model.named_modules()
            for attr, t in vars(module).items()
            if isinstance(t, torch.Tensor)
        }
        stem = build["out"].removesuffix(".safetensors")
        save_file(params, f"{stem}_r{rank}.safetensors")
        save_file(derived, f"{stem}_r{rank}_derived.safetensors")
        out.put((rank, (_shapes(params), _shapes(derived)), None))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        import traceback

        out.put((rank, None, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def main(job_path: str, result_path: str) -> int:
    from nemo_refit_reshard.engine.rendezvous import free_port

    job = json.load(open(job_path))
    ctx = mp.get_context("spawn")
    result: dict[str, Any] = {"derived": {}}
    for build in job["builds"]:
        out, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_rank, args=(build, r, port, out)) for r in range(build["tp"])]
        for p in procs:
            p.start()
        ranks = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        errors = [e for _, _, e in ranks if e]
        if errors:
            result = {"error": f"build {build['id']}: {errors[0]}"}
            break
        ordered = [shapes for _, shapes, _ in sorted(ranks, key=lambda x: x[0])]
        result[build["id"]] = [params for params, _ in ordered]
        result["derived"][build["id"]] = [derived for _, derived in ordered]
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
