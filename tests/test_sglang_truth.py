"""The SGLang layout provider against SGLang's own model classes (SGLang 0.5.23 on CPU).

For every case SGLang's model class is built for each tensor-parallel rank with SGLang's
own runtime context and parallel state (gloo), and loaded through SGLang's own
``load_weights`` from random float32 checkpoint tensors (``tests/programs/sglang_cpu_job.py``;
stand-ins in ``tests/helpers/sglang_cpu.py``). Its ``named_parameters()`` must equal
the provider's tensors (names, shapes, dtypes), every provider piece must hold exactly
the canonical slice it claims, and every padding box zeros. A negative control shows
the content check fails when ranks are swapped.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from nemo_refit_reshard.engine.materialize import mismatches
from nemo_refit_reshard.layouts.base import RankLayout
from nemo_refit_reshard.layouts.sglang import check_sglang_parallel, sglang_layout
from nemo_refit_reshard.spec import InferParallel, ModelSpec, spec_from_hf_config
from tests.helpers import vllm_env
from tests.helpers.checkpoints import random_tensors
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires

P = InferParallel
# Every layer an MoE block, as in Qwen3-MoE checkpoints (SGLang 0.5.23 builds experts in
# every layer; the test config's dense layer 1 is refused below).
CONFIGS = {**MODELS, "qwen3_moe_sparse": {**MODELS["qwen3_moe"], "mlp_only_layers": []}}
CASES = [
    ("llama", P()),
    ("llama", P(tp=2)),
    ("llama", P(tp=4)),  # 2 KV heads over 4 ranks: each replicated twice
    ("qwen2", P(tp=4)),  # qkv biases, KV replication
    ("qwen3", P(tp=2)),  # q/k norms, tied embeddings, vocabulary padded 100 -> 128
    ("qwen3_moe_sparse", P(tp=2)),  # every expert sliced over the tp ranks
]


def _id(case: tuple[str, InferParallel]) -> str:
    return f"{case[0]}-tp{case[1].tp}"


def _spec(model: str) -> ModelSpec:
    return spec_from_hf_config(CONFIGS[model], name=model)


@pytest.fixture(scope="module")
def sglang_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case built and loaded by SGLang, one process per rank."""
    from safetensors.torch import save_file

    work = tmp_path_factory.mktemp("sglang-truth")
    builds = []
    for model in sorted({m for m, _ in CASES}):
        (work / model).mkdir()
        (work / model / "config.json").write_text(json.dumps(CONFIGS[model]))
        save_file(random_tensors(_spec(model), 0), str(work / f"{model}.safetensors"))
    for case in CASES:
        model, par = case
        builds.append(
            dict(
                id=_id(case),
                model_dir=str(work / model),
                tp=par.tp,
                weights=str(work / f"{model}.safetensors"),
                out=str(work / f"{_id(case)}.safetensors"),
            )
        )
    (work / "job.json").write_text(json.dumps({"builds": builds}))
    proc = vllm_env.start(
        "sglang_cpu_job",
        str(work / "job.json"),
        str(work / "result.json"),
        python=vllm_env.sglang_python(),
    )
    vllm_env.finish(proc, "SGLang CPU builds")
    result = json.loads((work / "result.json").read_text())
    assert "error" not in result, result["error"]
    return {"work": work, "shapes": result}


def _loaded(runs: dict[str, Any], case: tuple[str, InferParallel], rank: int):
    from safetensors.torch import load_file

    return load_file(str(runs["work"] / f"{_id(case)}_r{rank}.safetensors"))


def _content_mismatches(
    layout: RankLayout, loaded: dict[str, torch.Tensor], canonical: dict[str, torch.Tensor]
) -> list[str]:
    out = mismatches(layout, loaded, canonical)
    for t in layout.tensors:
        for box in t.padding:
            if loaded[t.name][box.slices()].count_nonzero():
                out.append(f"{t.name}: padding {box} is not zero")
    return out


@pytest.mark.slow
@requires(vllm_env.sglang_skip_reason)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_provider_matches_sglang_parameters_and_contents(
    case: tuple[str, InferParallel], sglang_runs: dict[str, Any]
) -> None:
    model, par = case
    canonical = random_tensors(_spec(model), 0)
    for rank in range(par.tp):
        layout = sglang_layout(_spec(model), par, rank, params_dtype="float32")
        ours = {t.name: [list(t.shape), t.dtype] for t in layout.tensors}
        assert sglang_runs["shapes"][_id(case)][rank] == ours, (rank, layout.framework)
        assert _content_mismatches(layout, _loaded(sglang_runs, case, rank), canonical) == []


@pytest.mark.slow
@requires(vllm_env.sglang_skip_reason)
def test_a_wrong_shard_is_caught(sglang_runs: dict[str, Any]) -> None:
    """Rank 1's loaded parameters against rank 0's layout: same names and shapes, and
    the content check names the tensors whose slices differ."""
    case = ("llama", P(tp=2))
    canonical = random_tensors(_spec("llama"), 0)
    layout = sglang_layout(_spec("llama"), case[1], 0, params_dtype="float32")
    wrong = _content_mismatches(layout, _loaded(sglang_runs, case, 1), canonical)
    assert any("qkv_proj" in m for m in wrong) and any("embed_tokens" in m for m in wrong)


@pytest.mark.parametrize(
    "model, par, message",
    [
        ("qwen3_moe", P(tp=2), "has dense MLP layers [1] (mlp_only_layers / decoder_sparse"),
        ("qwen3_moe_sparse", P(tp=8), "tp=8 exceeds num_experts=4 (SGLang's rule)"),
        ("deepseek_v3", P(tp=2), "family 'deepseek_v3' with MLA: use the vLLM engine for it"),
        ("qwen3_fp8", P(tp=2), "do not cover FP8 engines yet"),
        ("qwen3", P(tp=2, pp=2), "drop pp/engine_dp/ep for SGLang"),
    ],
)
def test_what_is_not_proven_is_refused_by_name(model: str, par: InferParallel, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_sglang_parallel(_spec(model), par)
