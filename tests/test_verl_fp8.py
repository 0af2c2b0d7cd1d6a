"""veRL's FP8 rollouts (``rollout.quantization: fp8``) served by the ``reshard`` engine.

``tests/programs/verl_fp8_rollout.py`` runs veRL 0.9.1's own FP8 reload functions
(``prepare_quanted_weights_for_loading``, ``load_quanted_weights``,
``process_quanted_weights_after_loading``, after its ``apply_vllm_quant_patches``) on vLLM
0.33's own FP8 model classes, fed what our engine yields on each rollout rank, against the
same fed the full BF16 tensors. Needs both ``.venv-vllm`` and ``.venv-verl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_refit_reshard.spec import spec_from_hf_config
from tests.helpers import vllm_env
from tests.helpers.checkpoints import write_steps
from tests.helpers.hf_models import hf_config
from tests.helpers.model_configs import FP8_DIMS
from tests.helpers.requires import requires

pytestmark = [pytest.mark.slow, requires(vllm_env.skip_reason, vllm_env.verl_skip_reason)]


def verl_package() -> str:
    import subprocess

    python = vllm_env.verl_python()
    assert python is not None
    probe = (
        "import importlib.util; "
        "print(importlib.util.find_spec('verl').submodule_search_locations[0])"
    )
    return subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()


def run(tmp: Path, infer: str, rank: dict[str, Any]) -> dict[str, Any]:
    config = hf_config("qwen3_moe", **FP8_DIMS, moe_intermediate_size=256)  # BF16, trained
    spec = spec_from_hf_config(config)
    checkpoints = write_steps(spec, tmp, range(2), seed=900, cast=torch.Tensor.bfloat16)
    job = {
        "config": config,
        "engine": {"infer": infer, "quantization": "fp8", "bucket_mb": 1},
        "actors": 2,
        "infer": rank,
        "checkpoints": checkpoints,
        "verl": verl_package(),
        "ranks": [1],  # the second shard: nothing of it at offset 0
    }
    (tmp / "job.json").write_text(json.dumps(job))
    proc = vllm_env.start("verl_fp8_rollout", str(tmp / "job.json"), str(tmp / "result.json"))
    vllm_env.finish(proc, "veRL FP8 rollout")
    result = json.loads((tmp / "result.json").read_text())
    assert "error" not in result, result.get("traceback")
    return result


def test_verl_fp8_rollout_loads_what_the_engine_yields(tmp_path: Path) -> None:
    """Rank 1 of a tp=2 rollout, 2 steps: bit-equal to veRL's own full-tensor load."""
    result = run(tmp_path, "tp=2", {"tp": 2})
    assert len(result["ranks"]) == 1
    attention = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight")
    moe = ("mlp.experts.routed_experts.w13_weight", "mlp.experts.routed_experts.w2_weight")
    dense = ("mlp.gate_up_proj.weight", "mlp.down_proj.weight")  # layer 1 is dense
    fp8 = sorted(
        f"model.layers.{i}.{m}" for i in range(3) for m in attention + (dense if i == 1 else moe)
    )
    for steps in result["ranks"]:
        for step in steps:
            assert step["mismatch"] == []
            assert step["params"] == 41
            assert step["fp8"] == fp8  # every linear and expert weight; routers stay BF16
    # The comparison sees one changed element of a received box.
    assert result["control"] == ["model.layers.0.self_attn.o_proj.weight"]
