"""The SGLang receiver (``integrations/sglang``) refitting SGLang's own DeepSeek-V3 on CPU.

Two training ranks (Megatron tp=2 float32 shards materialized from each step's canonical
tensors, sent by this project's ``RefitWorker``) and two SGLang tp ranks join one gloo
refit group (``tests/programs/sglang_receiver_job.py``). Each SGLang rank holds SGLang's
own model class, built with SGLang's runtime context and parallel state and first loaded
by SGLang's own ``load_weights``; every receiver operation reaches it as the scheduler
receives it: SGLang's own ``SchedulerWeightUpdaterManager`` handles
``BeginWeightUpdateReqInput``, ``UpdateWeightsFromTensorReqInput(load_format=LOADER)``
(a serialized ``refit_command`` per tp rank) and ``EndWeightUpdateReqInput``, calling
SGLang's own ``WeightUpdater.update_weights_from_tensor``, which calls our custom
loader; our plugin's hook is applied by SGLang's ``HookRegistry``. Two steps with
different weights must leave every parameter bitwise equal to its canonical slices with
its storage unmoved, MLA's derived ``w_kc``/``w_vc`` recomputed by SGLang's own
``post_load_weights`` in their storage, and everything equal to what SGLang's own
``load_weights`` makes of the same checkpoint; then a plan of another fingerprint is
refused without touching the weights, and a step after the training ranks have gone
leaves them stale with the transport's error; SGLang answers each failure with
``success=False`` and records a weight version only for the successes.

Stand-ins (SGLang code that cannot run on CPU, and what replaces it):

- ``ModelRunner`` (it allocates the KV cache and captures CUDA graphs) and
  ``TpModelWorker``: namespaces holding what the tensor path reads — SGLang's own
  ``WeightUpdater`` built as ``ModelRunner.init_weight_updater`` builds it, with our
  loader in ``custom_weight_loaders`` as ``--custom-weight-loader`` puts it (callbacks the
  path never calls raise), and ``deserialize_own_rank`` copied line for line (its module
  imports the scheduler, which needs ``setproctitle``, absent from the CPU venv).
- The ``Scheduler`` itself (process, ZMQ, dispatcher, radix cache): the test calls the
  manager's handlers directly; ``record_weight_version_change`` appends to a list and
  ``flush_cache`` has nothing to flush. The ``Engine`` (tokenizer process): the job
  serializes each command with SGLang's ``MultiprocessingSerializer`` as
  ``Engine._serialize_tensors_per_rank`` does, before the first call (SGLang's torch
  reduction patch, installed on the scheduler side, cannot reduce CPU tensors, and here
  both sides share a process).
- ``load_plugins()``: the job calls ``plugin.register()`` and ``HookRegistry.apply_hooks()``.
- ``torchvision`` and vLLM's CUDA rotary kernel: ``tests/helpers/sglang_cpu.py``.

On SGLang 0.5.12.post1 (NeMo RL's pin; ``NRR_SGLANG_PYTHON`` = its venv's Python) there
is no session and no ``WeightUpdater``: each operation reaches the model through SGLang's
own ``SchedulerUpdateWeightsMixin.update_weights_from_tensor`` (answer, cache flush, tp
barrier over SGLang's own tp group) and SGLang's own, hooked
``ModelRunner.update_weights_from_tensor`` (``tests/helpers/sglang_scheduler.py``,
``scheduler_weight_updater_0512``). Its stand-ins: ``TpModelWorker``'s tensor path copied
line for line (``setproctitle`` again), the ``ModelRunner`` a namespace holding the model,
tp rank, device and the global ``ServerArgs`` with our loader in
``custom_weight_loader``, and the weight version recorded as its tokenizer side records it
(``TokenizerControlMixin._update_weight_version_if_provided``, SGLang's own, after a
successful answer). The same assertions hold: the same answers and recorded versions.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import vllm_env
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires

pytestmark = [pytest.mark.slow, requires(vllm_env.sglang_skip_reason)]

# the SGLang versions whose weight-update path the job drives: 0.5.23 (SGLang's own
# SchedulerWeightUpdaterManager and WeightUpdater, in a begin/end session) and
# 0.5.12.post1, NeMo RL's pin (no session: SGLang's own scheduler mixin and
# ModelRunner.update_weights_from_tensor); NRR_SGLANG_PYTHON picks the venv
VERSIONS = ("0.5.23", "0.5.12.post1")

STEPS = [100, 101]  # the canonical weights' seed of each refit step (start-up: 99)
# DeepSeek-V3: MLA (derived w_kc/w_vc) and MoE; the job takes any SGLang model. What
# DeepSeek-V3's own config.json has and transformers' DeepseekV3Config does not write,
# which SGLang's DeepseekV2 reads, and a YaRN rope_scaling SGLang's CPU rotary embedding
# accepts (factor 1: plain rope) — as tests/test_sglang_truth.py builds it.
SGLANG_KEYS = {
    "scoring_func": "sigmoid",
    "moe_layer_freq": 1,
    "ep_size": 1,
    "norm_topk_prob": True,
    "rope_scaling": {
        "rope_type": "deepseek_yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}
CONFIGS = {
    "deepseek_v3": {**MODELS["deepseek_v3"], **SGLANG_KEYS},
    # block FP8 (e4m3 weights, 128x128 scales): the training ranks quantize what they send
    "deepseek_v3_fp8": {**MODELS["deepseek_v3_fp8"], **SGLANG_KEYS},
}


# The SGLang engines refit (model, parallelism): tp=2; pipeline parallel (--pp-size 2:
# layers split, each stage's own parameters); attention data parallel (--tp-size 2
# --dp-size 2 --enable-dp-attention: MLA whole on each rank, MoE and dense MLP split over
# both); a block-FP8 engine at tp=2.
ENGINES = {
    "tp2": ("deepseek_v3", dict(tp=2)),
    "pp2": ("deepseek_v3", dict(pp=2)),
    "dp_attention2": ("deepseek_v3", dict(engine_dp=2)),
    "fp8_tp2": ("deepseek_v3_fp8", dict(tp=2)),
}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    model, infer = ENGINES[request.param]
    config = CONFIGS[model]
    old = vllm_env.installed_sglang_version().startswith("0.5.12")
    if old and ("engine_dp" in infer or "quantization_config" in config):
        pytest.skip("data-parallel attention and FP8 are proven against SGLang 0.5.23 only")
    work = tmp_path_factory.mktemp(f"sglang-receiver-{request.param}")
    (work / "model").mkdir()
    (work / "model" / "config.json").write_text(json.dumps(config))
    job = dict(
        name=model,
        config=config,
        model_dir=str(work / "model"),
        initial=str(work / "initial.safetensors"),
        initial_seed=99,
        steps=STEPS,
        timeout_s=20,
        infer=infer,
    )
    (work / "job.json").write_text(json.dumps(job))
    proc = vllm_env.start(
        "sglang_receiver_job",
        str(work / "job.json"),
        str(work / "result.json"),
        python=vllm_env.sglang_python(),
    )
    vllm_env.finish(proc, "the SGLang receiver job")
    result = json.loads((work / "result.json").read_text())
    assert "error" not in result, result["error"]
    assert result["train_exitcodes"] == [0, 0]
    return [{**rank, "engine": request.param} for rank in result["ranks"]]


def test_two_steps_write_canonical_slices_in_place(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["sglang_version"] in VERSIONS
        assert rank["described"]["sglang_version"] == rank["sglang_version"]
        assert [s["differ"] for s in rank["steps"]] == [[], []]  # bitwise, every piece
        assert [s["moved"] for s in rank["steps"]] == [[], []]  # storage unchanged
        for step, s in enumerate(rank["steps"], start=1):
            assert s["status"]["step"] == step and s["status"]["stale"] is None
            assert s["status"]["errors"] == []
            # SGLang's post_load_weights reran: new derived values, in the same storage
            assert s["derived"] and s["derived_unchanged"] == [] and s["derived_moved"] == []
        # and SGLang's own load_weights of step 2's checkpoint gives the same bits
        assert rank["reload_differ"] == []
        # an FP8 kv_b_proj: SGLang's CPU path adds one per-tensor w_scale per MLA layer,
        # compared with the rest above
        fp8 = rank["engine"].startswith("fp8")
        w_scales = [f"model.layers.{i}.self_attn.w_scale" for i in range(3)] if fp8 else []
        assert rank["w_scales"] == w_scales
        # and the MLA attentions' KV-cache scales (BaseKVCacheMethod's: -1.0 as loaded
        # here, no checkpoint scale) are live parameters no plan writes: SGLang's own
        # session end (process_weights_after_loading) sets them to its default 1.0
        kv = [f"model.layers.{i}.self_attn.{a}.{k}_scale" for i in range(3)
              for a in ("attn_mqa", "attn_mha") for k in "kv"]  # fmt: skip
        assert rank["kv_scales"] == ({n: -1.0 for n in kv} if fp8 else {})
        assert rank["kv_scales_changed"] == ({n: 1.0 for n in kv} if fp8 else {})


def test_each_rank_holds_its_share_of_the_engine(ranks: list[dict[str, Any]]) -> None:
    """What was refit is what SGLang's parallelism gives each rank (deepseek_v3: 4 heads
    of 12 + 8 dims, q_lora 16, hidden 32, dense layer 0 intermediate 64, 3 layers): tp
    splits MLA's q_b_proj and the dense MLP; attention DP keeps MLA whole and splits the
    MLP over both ranks; pp puts layer 0 and the embedding on stage 0, the last layer and
    the final norm on stage 1. The FP8 engine (deepseek_v3_fp8: 4 heads of 192 + 128
    dims, q_lora 256, hidden 256, intermediate 512) splits e4m3 weights and their
    128x128 scales alike."""
    engine = ranks[0]["engine"]
    tensors = [rank["described"]["tensors"] for rank in ranks]
    assert [rank["described"]["engine_rank"] for rank in ranks] == [0, 1]
    q_b, gate_up = "self_attn.q_b_proj.weight", "mlp.gate_up_proj.weight"
    if engine == "fp8_tp2":
        for t in tensors:
            assert t[f"model.layers.0.{q_b}"] == [[384, 256], "float8_e4m3fn"]
            assert t[f"model.layers.0.{q_b}_scale_inv"] == [[3, 2], "float32"]
            assert t[f"model.layers.0.{gate_up}"] == [[512, 256], "float8_e4m3fn"]
            assert t[f"model.layers.0.{gate_up}_scale_inv"] == [[4, 2], "float32"]
        return
    if engine == "pp2":
        assert tensors[0][f"model.layers.0.{q_b}"] == [[48, 16], "float32"]
        assert tensors[0][f"model.layers.0.{gate_up}"] == [[128, 32], "float32"]
        assert "model.embed_tokens.weight" in tensors[0] and "model.norm.weight" in tensors[1]
        assert "model.embed_tokens.weight" not in tensors[1]
        assert "model.norm.weight" not in tensors[0]
        assert f"model.layers.2.{q_b}" in tensors[1] and f"model.layers.2.{q_b}" not in tensors[0]
        assert f"model.layers.0.{q_b}" not in tensors[1]
        return
    assert tensors[0].keys() == tensors[1].keys()
    heads = 48 if engine == "dp_attention2" else 24
    for t in tensors:
        assert t[f"model.layers.0.{q_b}"] == [[heads, 16], "float32"], engine
        assert t[f"model.layers.0.{gate_up}"] == [[64, 32], "float32"], engine


def test_plan_of_another_fingerprint_is_refused(ranks: list[dict[str, Any]]) -> None:
    for tp, rank in enumerate(ranks):
        status = rank["bad_plan"]
        assert status["stale"] is None and status["step"] == 2  # nothing was written
        # SGLang's own answer to the driver, through our plugin's hook (plugin.py)
        op, ok, message = rank["answers"][4]
        assert (op, ok) == ("load_plan", False) and message == status["errors"][0]
        (error,) = status["errors"]
        version = rank["sglang_version"]
        assert error.startswith(
            f"nemo_refit_reshard.load_plan: PlanError: SGLang {version} engine rank {tp}"
        )
        assert "not the driver's plan 000000000000" in error


def test_dead_peer_leaves_weights_stale(ranks: list[dict[str, Any]]) -> None:
    for tp, rank in enumerate(ranks):
        status = rank["dead_peer"]
        assert status["step"] == 2  # the last complete refit
        assert status["stale"].startswith("the refit of step 3 failed (TransportError")
        # the wording after this depends on how gloo saw the training ranks go
        assert f"refit rank {2 + tp}: step 3 round 0" in status["stale"]
        assert "step 3 failed" in rank["require_fresh"]
        assert rank["require_fresh"].startswith("generation on SGLang engine rank")
        assert rank["moved_after_failure"] == []
        op, ok, message = rank["answers"][5]
        assert (op, ok) == ("step", False) and "TransportError" in message


def test_sglang_answers_success_for_complete_commands(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        ops = ["join", "load_plan", "step", "step"]
        assert rank["answers"][:4] == [[op, True, "Success"] for op in ops]
        assert rank["answers"][-1] == ["close", True, "Success"]
        # SGLang records the version of every successful update, of no failed one (0.5.23:
        # the scheduler; 0.5.12.post1: the tokenizer side; the same list on both)
        assert rank["versions"] == ["join", "plan", "step1", "step2", "close"]
