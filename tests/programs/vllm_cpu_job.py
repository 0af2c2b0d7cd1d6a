"""Build vLLM model ranks on CPU and report their parameters (run with vLLM's Python).

    python -m tests.programs.vllm_cpu_job JOB.json RESULT.json

JOB: ``{"configs": {key: <HF config.json dict>}, "builds": [{"id", "config": key,
"rank": EngineRank fields, "device": "meta"|"cpu", "dtype", "weights": <safetensors
path or null>, "out": <safetensors path or null>}]}``. For each build, RESULT holds the
``named_parameters()`` names, shapes and dtypes, vLLM's chosen model dtype and the
build time; with ``weights`` the rank loads them through vLLM's own
``model.load_weights()`` and writes its parameters to ``out``.
"""

from __future__ import annotations

import json
import sys
import time

from tests.helpers import vllm_cpu


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    results: dict[str, object] = {"vllm_version": vllm_cpu.vllm_version(), "builds": {}}
    for b in job["builds"]:
        print(f"build {b['id']}", flush=True)  # names the build in a failure's output
        t0 = time.perf_counter()
        rank = vllm_cpu.EngineRank.from_dict(b["rank"])
        hf_config = job["configs"][b["config"]]
        model, config = vllm_cpu.build_model(hf_config, rank, b["device"], b.get("dtype"))
        entry: dict[str, object] = {
            "params": vllm_cpu.describe(model),
            "model_dtype": str(config.model_config.dtype).removeprefix("torch."),
            "sequence_parallel_moe": bool(config.parallel_config.use_sequence_parallel_moe),
        }
        if b.get("weights"):
            from safetensors.torch import save_file

            loaded = model.load_weights(vllm_cpu.checkpoint_tensors(b["weights"]))
            entry["loaded"] = sorted(loaded) if loaded is not None else None
            save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, b["out"])
        entry["build_s"] = round(time.perf_counter() - t0, 3)
        results["builds"][b["id"]] = entry  # type: ignore[index]
    with open(result_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
