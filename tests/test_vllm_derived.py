"""What vLLM derives from the loaded weights stays current across refits (vLLM on CPU).

vLLM's MLA layers absorb ``kv_b_proj`` into ``W_UK_T`` / ``W_UV`` after loading; for a
block-FP8 ``kv_b_proj`` they are dequantized copies, which a refit of the parameters
alone leaves at the previous step (``integrations/vllm/derived.py``). Megatron tp=2
training ranks refit two one-rank engines of vLLM 0.33's own block-FP8
``DeepseekV3ForCausalLM`` (``tests/programs/vllm_derived_check.py``), twice: the worker
of engine 0 reruns vLLM's ``MLAAttention.process_weights_after_loading`` after each
refit, the control engine 1 does not. Each is compared, bit for bit, with vLLM's own
load + processing of that step's checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_refit_reshard.engine.rendezvous import free_port
from nemo_refit_reshard.integrations.worker import RefitEndpoint
from nemo_refit_reshard.layouts import MegatronOptions, VllmOptions, megatron_layout, vllm_layouts
from nemo_refit_reshard.layouts.fp8_wire import wire_layouts
from nemo_refit_reshard.plan import plan_refit, rank_plan
from nemo_refit_reshard.spec import (
    InferParallel,
    ModelSpec,
    TrainParallel,
    spec_from_hf_config,
)
from tests.helpers import vllm_env
from tests.helpers.checkpoints import fp8_checkpoints, write_steps
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires
from tests.helpers.train_ranks import start_training_ranks
from tests.helpers.vllm_jobs import engine_dtype, installed_version, rank_fields

pytestmark = [pytest.mark.slow, requires(vllm_env.skip_reason)]

MLA = [f"model.layers.{i}.self_attn.mla_attn.mla_attn" for i in range(3)]
DERIVED = sorted(f"{layer}.{attr}" for layer in MLA for attr in ("W_UK_T", "W_UV"))


def write_checkpoints(spec: ModelSpec, work: Path, steps: int) -> list[str]:
    """The start-up checkpoint, then one per refit step; every value a bfloat16 one, so
    that the float32 training ranks and vLLM's load of the bfloat16 + FP8 checkpoint hold
    the same numbers (vLLM keeps the router's correction bias in float32)."""
    return write_steps(spec, work, range(-1, steps), seed=100, cast=_bfloat16_values)


def _bfloat16_values(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def write_plan(spec: ModelSpec, train: TrainParallel, infer: InferParallel, work: Path) -> str:
    """Rank slices ``plan.rank{r}.json`` (the path template). The training ranks quantize
    their whole-block pieces (``kv_b_proj`` among them) and send e4m3 + scales; Megatron's
    tp halves of ``kv_a_proj_with_mqa`` (96 rows) cross as BF16 twins the engine quantizes."""
    sources = [
        megatron_layout(spec, train, r, MegatronOptions(params_dtype="float32"))
        for r in range(train.world_size)
    ]
    opts = VllmOptions(params_dtype=engine_dtype(spec), vllm_version=installed_version())
    destinations = vllm_layouts(spec, infer, opts)
    sources, destinations, wire = wire_layouts(spec, sources, destinations, engine_dtype(spec))
    assert all(f"model.layers.{i}.self_attn.kv_b_proj.weight" in wire.quantized for i in range(3))
    plan = plan_refit(spec, sources, destinations, bucket_mb=1)
    for r in range(train.world_size + infer.world_size):
        (work / f"plan.rank{r}.json").write_text(rank_plan(plan, r).to_json())
    return str(work / "plan.rank{rank}.json")


MODES = ("rerun", "skip_rerun", "rebind")


def run(work: Path, steps: int = 2) -> dict[str, dict[str, Any]]:
    """Two training ranks and three one-rank engines (one per mode of
    ``vllm_derived_check``) in one refit group; each engine's result."""
    model, train, infer = "deepseek_v3_fp8", TrainParallel(tp=2), InferParallel(dp=len(MODES))
    cfg = MODELS[model]
    spec = spec_from_hf_config(cfg, name=model)
    initial, *checkpoints = write_checkpoints(spec.unquantized(), work, steps)
    loads = fp8_checkpoints(spec, [initial, *checkpoints])
    plan = write_plan(spec, train, infer, work)
    s, world = train.world_size, train.world_size + infer.world_size
    endpoint = RefitEndpoint("127.0.0.1", free_port(), world, 0, "gloo", timeout_s=300)
    procs = start_training_ranks(cfg, train, endpoint, plan, checkpoints, work)
    results = []
    for engine in range(infer.dp):
        path, out = work / f"vllm{engine}.json", work / f"vllm{engine}.out.json"
        path.write_text(
            json.dumps(
                dict(
                    config=cfg,
                    rank=rank_fields(infer, 0, None),
                    endpoint=endpoint.to_json(),
                    first_rank=s + engine,
                    plan=plan,
                    initial=loads[0],
                    checkpoints=loads[1:],
                    dtype=engine_dtype(spec),
                    mode=MODES[engine],
                )
            )
        )
        procs.append(vllm_env.start("vllm_derived_check", str(path), str(out)))
        results.append(out)
    try:
        # the vLLM ranks first: one that fails reports why, and the training ranks
        # waiting for it are stopped below rather than left to their timeout
        for p in procs[s:]:
            vllm_env.finish(p, "a vLLM rank")
        out = {mode: json.loads(r.read_text()) for mode, r in zip(MODES, results)}
        if all(r["ok"] for r in out.values()):
            for p in procs[:s]:
                assert p.wait() == 0, "a training rank failed"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return run(tmp_path_factory.mktemp("vllm-derived"))


def test_refit_reruns_mla_derivation_in_place(results: dict[str, dict[str, Any]]) -> None:
    """After each of two refits, every refit parameter and every MLA layer's ``W_UK_T`` /
    ``W_UV`` equal vLLM's fresh load + processing bit for bit, and no storage moved."""
    r = results["rerun"]
    assert r["ok"], r.get("traceback")
    # block-FP8 kv_b_proj: the derived tensors are copies, not views of the weight ...
    assert r["derived"] == r["copies"] == DERIVED
    # ... and not refit: the plan writes every other parameter
    assert not set(DERIVED) & set(r["described"])
    assert r["written"] == len(r["described"])
    assert [s["differ"] for s in r["steps"]] == [[], []]
    assert [s["derived_differ"] for s in r["steps"]] == [[], []]
    assert [s["moved"] for s in r["steps"]] == [[], []]
    assert all(s["timing"]["derived_seconds"] > 0 for s in r["steps"])


def test_control_without_rerun_serves_stale_attention(results: dict[str, dict[str, Any]]) -> None:
    """The control: the same refits without the rerun write every parameter bit-exact,
    yet every MLA layer keeps the previous step's ``W_UK_T`` / ``W_UV``."""
    r = results["skip_rerun"]
    assert r["ok"], r.get("traceback")
    assert [s["differ"] for s in r["steps"]] == [[], []]
    assert [s["derived_differ"] for s in r["steps"]] == [DERIVED, DERIVED]
    assert [s["moved"] for s in r["steps"]] == [[], []]


def test_rerun_that_rebinds_is_put_back_on_its_storage(
    results: dict[str, dict[str, Any]],
) -> None:
    """A rerun whose ``replace_parameter`` rebinds the derived parameters to new storage
    (vLLM 0.25 assigns new tensors; 0.33 rebinds when the stride differs): the worker
    copies the values into the previous storage and puts it back."""
    r = results["rebind"]
    assert r["ok"], r.get("traceback")
    assert [s["differ"] for s in r["steps"]] == [[], []]
    assert [s["derived_differ"] for s in r["steps"]] == [[], []]
    assert [s["moved"] for s in r["steps"]] == [[], []]


def test_underivable_mla_variants_are_refused_by_name(results: dict[str, dict[str, Any]]) -> None:
    """A worker whose MLA layers use DCP query replication or AMX refuses, naming each."""
    assert results["rerun"]["refused"] == (
        "UnsupportedVllmOption: layers that derive tensors from the loaded weights in a way "
        f"a refit cannot rerun in place: {MLA[0]}: DCP query replication (W_UK_T_dcp_qrep), "
        f"{MLA[1]}: AMX MLA (AMXMLAImpl releases kv_b_proj.weight); serve on CUDA with "
        "decode_context_parallel_size=1 (MLA: W_UK_T/W_UV recomputed in place after every "
        "refit)"
    )
