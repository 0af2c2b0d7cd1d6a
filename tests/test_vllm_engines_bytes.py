"""benchmarks/vllm_engines_bytes.py on a small model, under vLLM's Python (``.venv-vllm``).

vLLM's own ``nccl_m2n`` resolution sends every fused parameter (``q/k/v_proj``,
``gate/up_proj``) whole to every worker, and resharding resolves only the unfused
tensor-parallel linears (``o_proj``, ``down_proj``) directly; vLLM's own sharded-RDT bake
pulls exactly the slices each worker stores, as ``reshard`` does: both at ``min_bytes``.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import vllm_env
from tests.helpers.requires import requires

pytestmark = [pytest.mark.slow, requires(vllm_env.skip_reason)]

_PROGRAM = """
import json, logging
from benchmarks.vllm_engines_bytes import run_case
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.runner import RunConfig, build_layouts

logging.getLogger("vllm").setLevel(logging.ERROR)
case = ("qwen3-0.6b", "tp=2,pp=2", "tp=2,dp=2")
figures = run_case(*case)
spec, sources, destinations = build_layouts(RunConfig(model=case[0], train=case[1], infer=case[2]))
plan = plan_refit(spec, sources, destinations)
print("RESULT " + json.dumps({
    "min_bytes": plan.stats.min_bytes,
    "names": [t.name for t in spec],
    "model_bytes": sum(t.numel * 2 for t in spec),
    "figures": {k: {"worker_total": f.worker_total, "worker_max": f.worker_max,
                    "trainer_gather": f.trainer_gather, "whole": sorted(f.whole)}
                for k, f in figures.items()},
}))
"""


def test_engines_bytes_small_qwen3() -> None:
    python = vllm_env.vllm_python()
    done = subprocess.run(
        [python, "-c", _PROGRAM],
        cwd=vllm_env.REPO,
        env=vllm_env.vllm_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    f, names = r["figures"], r["names"]
    n_workers = 4

    # reshard and vLLM's sharded_rdt bake: each worker gets exactly what it stores
    assert f["reshard"]["worker_total"] == r["min_bytes"]
    assert f["sharded_rdt"]["worker_total"] == r["min_bytes"]
    assert f["reshard"]["trainer_gather"] == 0
    # nccl: every tensor to every worker
    assert f["nccl (packed)"]["worker_total"] == r["model_bytes"] * n_workers

    # nccl_m2n, by vLLM's resolve_parameter_destinations: fused ones go whole ...
    fused = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    whole = set(f["nccl_m2n"]["whole"])
    assert {n for n in names if any(f".{p}." in n for p in fused)} <= whole
    # ... and exactly the unfused tensor-parallel linears resolve direct
    direct = set(names) - whole
    assert direct == {n for n in names if ".o_proj." in n or ".down_proj." in n}
    assert r["min_bytes"] < f["nccl_m2n"]["worker_total"] < r["model_bytes"] * n_workers
