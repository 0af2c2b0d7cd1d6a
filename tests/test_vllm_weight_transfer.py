"""``reshard`` as a backend of vLLM's own weight-transfer API, on CPU with vLLM 0.33.

Two trainer ranks hold a live megatron-core ``GPTModel`` (tp=2 over gloo) filled through
Megatron's own sharded-state-dict placement, and build the trainer engine through vLLM's
``WeightTransferTrainerFactory.trainer_init`` from a ``MegatronSource``; rank 0 drives the
engine with vLLM's own ``RayVLLMWeightSyncClient``. The engine is an ``LLM`` actor with
vLLM's own RL methods (``RLOfflineMixin``) over two worker ranks (one tp=2 engine of vLLM's
block-FP8 model classes with real storage: e4m3 weights, float32 scales, bfloat16 for the
rest), each building the worker engine through vLLM's
``WeightTransferEngineFactory`` from ``WeightTransferConfig(backend="reshard")`` and
running the phases through vLLM's own ``Worker`` methods. Every party is a Ray actor
(``tests/programs/vllm_ray_refit.py``). Stand-ins, for what needs a GPU: the engine core's
``collective_rpc`` and the worker object (``tests/helpers/vllm_control_plane.py``), and the
FP8 kernel choice, which declines this CPU (``vllm_cpu.allow_fp8_block_kernel_on_cpu``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_refit_reshard.spec import InferParallel, spec_from_hf_config
from tests.helpers import vllm_env
from tests.helpers.checkpoints import fp8_checkpoints, write_checkpoints
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires
from tests.helpers.vllm_jobs import rank_fields

pytestmark = [pytest.mark.slow, requires(vllm_env.skip_reason)]


def run(
    model: str,
    work: Path,
    steps: int,
    fail_after: int | None = None,
    colocated_steps: int = 0,
    program: str = "vllm_ray_refit",
    infer_tp: int = 2,
) -> dict[str, Any]:
    """The Ray job's result (see the program's docstring)."""
    cfg, infer = MODELS[model], InferParallel(tp=infer_tp)
    quant = cfg.get("quantization_config")  # a block-FP8 engine of a BF16-trained model
    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    trained = spec_from_hf_config(cfg, name=model)
    initial, *checkpoints = write_checkpoints(trained, work, steps)
    extra: dict[str, Any] = {}
    if quant:
        fp8 = fp8_checkpoints(spec_from_hf_config(MODELS[model]), [initial, *checkpoints])
        extra = dict(quantization=quant, fp8_initial=fp8[0], fp8_checkpoints=fp8[1:])
    spec = dict(
        **extra,
        config=cfg,
        train_tp=2,
        infer=[rank_fields(infer, d, None) for d in range(infer.world_size)],
        initial=initial,
        checkpoints=checkpoints,
        fail_after=fail_after,
        colocated_steps=colocated_steps,
        timeout_s=20,  # the fleet job's refit deadline (a tiny model's waits are short)
    )
    (work / "spec.json").write_text(json.dumps(spec))
    proc = vllm_env.start(program, str(work / "spec.json"), str(work / "out.json"))
    vllm_env.finish(proc, f"the Ray job {program}")  # every wait in it is bounded
    return json.loads((work / "out.json").read_text())


def test_reshard_backend_over_ray_bit_exact_then_failed_update_then_colocated(
    tmp_path: Path,
) -> None:
    """A block-FP8 engine (vLLM's own FP8 Qwen3-MoE classes, layer 0's router left
    unquantized) of a BF16-trained Megatron model, told its quantization_config through
    ``ReshardTrainerInitInfo.quantization``: the trainer ranks quantize and send e4m3 +
    scales. Two versions committed bit-exact vs vLLM's load_weights of the quantized
    checkpoints; the third update fails (a trainer rank left) and commits nothing. Then
    the same engine again, colocated (re-initialised through vLLM's own shutdown/init
    calls), weights poisoned first: two more versions, bit-exact."""
    r = run("qwen3_moe_fp8", tmp_path, steps=3, fail_after=2, colocated_steps=2)
    assert r["ok"], r.get("traceback")
    assert r["fingerprints"][0] == r["fingerprints"][1]
    assert r["llm_version"] == "v2"
    for d, w in enumerate(r["workers"]):
        assert w["engine"] == "ReshardWeightTransferEngine"
        assert w["committed"] == ["v1", "v2", "c1", "c2"], d
        assert [s["step"] for s in w["steps"]] == [1, 2, 1, 2]
        assert [s["differ"] for s in w["steps"]] == [[], [], [], []], w["steps"]
        assert [s["moved"] for s in w["steps"]] == [[], [], [], []]
    colocated = r["colocated"]
    assert colocated["fingerprints"][0] == colocated["fingerprints"][1]
    assert colocated["fingerprints"][0] != r["fingerprints"][0]
    assert colocated["llm_version"] == "c2"
    for status in colocated["status"]:
        assert status["weight_version"] == "c2" and status["stale"] is None, status
    assert r["failed_update"] is not None
    assert r["llm_version_after_failure"] == "v2"
    for status in r["status"]:
        assert status["weight_version"] == "v2" and status["step"] == 2
        assert status["stale"] and "step 3" in status["stale"], status
        assert status["active"] is False  # vLLM's Worker ended the failed session
    assert "StaleWeightsError" in r["engine_finish"], r["engine_finish"]
    assert "version 'v2'" in r["engine_finish"]


def test_two_engines_one_dies_the_other_goes_on_and_a_new_one_is_admitted(
    tmp_path: Path,
) -> None:
    """Two vLLM engines, each its own refit group (``tests/programs/vllm_ray_fleet.py``):
    engine b's workers are killed between steps; its update fails on every trainer rank
    and commits nothing, while engine a takes the same version through its own group.
    b is fenced (its trainer engines shut down); engine c, started from the initial
    checkpoint, is admitted through vLLM's ``init_weight_transfer_engine`` and caught up
    to the version a holds; then a and c take the next one. Every committed version is
    bit-exact against vLLM's ``load_weights`` of its checkpoint; no storage moved."""
    r = run("qwen3", tmp_path, steps=3, program="vllm_ray_fleet", infer_tp=1)
    assert r["ok"], r.get("traceback")
    prints = r["fingerprints"]
    assert prints["a"][0] == prints["a"][1] == prints["b"][0] == prints["c"][0]
    for name in ("a", "b"):
        assert r["step1"][name]["errors"] == [None, None], name
    lost = r["step2"]["b"]["errors"]  # every trainer rank saw it, each its own way:
    assert "ActorDiedError" in lost[0], lost  # rank 0 drives b's dead workers through vLLM
    assert lost[1].startswith("TransportError: refit rank 1: step 2"), lost
    assert r["step2"]["b"]["seconds"] < 20 + 60  # bounded by the refit deadline (20 s)
    assert r["step2"]["a"]["errors"] == [None, None], r["step2"]["a"]
    assert r["b_shutdown"] is not None  # b's workers are gone; vLLM's call says so
    assert r["after_loss"]["a"]["version"] == "v2"
    assert r["catch_up"]["errors"] == [None, None], r["catch_up"]
    for name in ("a", "c"):
        assert r["after_admission"][name]["version"] == "v2", name
        assert r["step3"][name]["errors"] == [None, None], (name, r["step3"])
        state = r["final"][name]
        assert state["version"] == "v3", name
        for status in state["status"]:
            assert status["weight_version"] == "v3" and status["stale"] is None, status
    [a], [c] = r["workers"]["a"], r["workers"]["c"]
    assert a["committed"] == ["v1", "v2", "v3"]
    assert [s["step"] for s in a["steps"]] == [1, 2, 3]
    assert c["committed"] == ["v2", "v3"]  # caught up, then the fleet's next version
    assert [s["step"] for s in c["steps"]] == [1, 2]  # c's own refit group counts again
    for w in (a, c):
        assert [s["differ"] for s in w["steps"]] == [[]] * len(w["steps"]), w["steps"]
        assert [s["moved"] for s in w["steps"]] == [[]] * len(w["steps"])
