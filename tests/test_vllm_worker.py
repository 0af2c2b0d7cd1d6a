"""The vLLM worker side (``integrations/vllm``) refitting vLLM's own model classes on CPU.

Training ranks (Megatron-layout float32 shards, this project's Python) and vLLM
generation ranks (vLLM's model classes with real float32 storage, vLLM's Python)
join one gloo refit group. Each vLLM rank runs the worker operations through vLLM's
own ``run_method`` — as ``worker_extension_cls`` methods or as ``collective_rpc``
callables — and after every step compares each parameter with what vLLM's own
``load_weights`` makes of that step's checkpoint (``tests/vllm_refit_rank.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_refit_reshard.engine.rendezvous import free_port
from nemo_refit_reshard.integrations.worker import RefitEndpoint
from nemo_refit_reshard.layouts import MegatronOptions, VllmOptions, megatron_layout, vllm_layouts
from nemo_refit_reshard.layouts.fp8_wire import wire_layouts
from nemo_refit_reshard.plan import plan_refit, rank_plan
from nemo_refit_reshard.spec import InferParallel, ModelSpec, TrainParallel, spec_from_hf_config
from tests.helpers import broken_rules, vllm_env
from tests.helpers.checkpoints import fp8_checkpoints, write_checkpoints
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires
from tests.helpers.train_ranks import start_training_ranks
from tests.helpers.vllm_jobs import engine_dtype, installed_version, rank_fields

pytestmark = [pytest.mark.slow, requires(vllm_env.skip_reason)]


def write_plan(
    spec: ModelSpec, train: TrainParallel, infer: InferParallel, work: Path, version: str
) -> str:
    """Rank slices ``plan.rank{r}.json``; returns the path template. A block-FP8 engine
    (bfloat16 besides its FP8 weights) is planned as the wire carries it: the training
    ranks quantize their whole-block pieces and send e4m3 + scales."""
    sources = [
        megatron_layout(spec, train, r, MegatronOptions(params_dtype="float32"))
        for r in range(train.world_size)
    ]
    dtype = engine_dtype(spec)
    opts = VllmOptions(params_dtype=dtype, vllm_version=version)
    destinations = vllm_layouts(spec, infer, opts)
    if spec.arch.quant is not None:
        sources, destinations, wire = wire_layouts(spec, sources, destinations, dtype)
        assert not wire.unquantized  # every shard below is whole blocks
    plan = plan_refit(spec, sources, destinations, bucket_mb=1)
    for r in range(train.world_size + infer.world_size):
        (work / f"plan.rank{r}.json").write_text(rank_plan(plan, r).to_json())
    return str(work / "plan.rank{rank}.json")


def run_refit(
    model: str, train: TrainParallel, infer: InferParallel, work: Path, steps: int = 2
) -> list[dict[str, Any]]:
    cfg = MODELS[model]
    spec = spec_from_hf_config(cfg, name=model)
    initial, *checkpoints = write_checkpoints(spec.unquantized(), work, steps)
    loads = (
        fp8_checkpoints(spec, [initial, *checkpoints])
        if spec.arch.quant is not None
        else [initial, *checkpoints]
    )
    plan = write_plan(spec, train, infer, work, installed_version())
    s, world = train.world_size, train.world_size + infer.world_size
    endpoint = RefitEndpoint("127.0.0.1", free_port(), world, 0, "gloo", timeout_s=300)
    procs = start_training_ranks(cfg, train, endpoint, plan, checkpoints, work)
    results = []
    for engine in range(infer.dp):
        for local in range(infer.engine_world_size):
            d = engine * infer.engine_world_size + local
            path, out = work / f"vllm{d}.json", work / f"vllm{d}.out.json"
            path.write_text(
                json.dumps(
                    dict(
                        config=cfg,
                        rank=rank_fields(infer, local, None),
                        endpoint=endpoint.to_json(),
                        first_rank=s + engine * infer.engine_world_size,
                        plan=plan,
                        initial=loads[0],
                        checkpoints=loads[1:],
                        dtype=engine_dtype(spec),
                        route="extension" if engine % 2 == 0 else "function",
                        mode="refit",
                    )
                )
            )
            procs.append(vllm_env.start("vllm_refit_rank", str(path), str(out)))
            results.append(out)
    try:
        # the vLLM ranks first: one that failed ends the test now (the finally below
        # stops the training ranks), not after the training ranks' join timeout
        for p, out in zip([p for p in procs if p.stdout is not None], results):
            vllm_env.finish(p, "a vLLM rank")
            reported = json.loads(out.read_text())
            assert reported["ok"], reported.get("traceback")
        for p in procs:
            if p.stdout is None:
                assert p.wait() == 0, "a training rank failed"
    finally:  # one failed rank must not leave the others waiting for their timeout
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(r.read_text()) for r in results]


def _check(results: list[dict[str, Any]], steps: int, first: int) -> None:
    for d, r in enumerate(results):
        assert r["ok"], r.get("traceback")
        assert r["group_rank"] == first + d
        assert r["written"] == r["params"] == len(r["described"]["tensors"])
        assert [len(s["differ"]) for s in r["steps"]] == [0] * steps, r["steps"]
        assert [len(s["moved"]) for s in r["steps"]] == [0] * steps
        assert all(s["timing"]["seconds"] > 0 for s in r["steps"])


def test_broken_megatron_rule_fails_the_refit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the training ranks hold Megatron's own placement of the weights
    (its sharded state dict), so a plan made with k and v swapped in our Megatron rule
    sends the wrong rows, and the vLLM ranks see exactly the fused qkv_proj differ."""
    owner = broken_rules.rule_owner()
    monkeypatch.setattr(owner, "qkv", broken_rules.kv_swapped(owner.qkv))
    results = run_refit("qwen3", TrainParallel(tp=2), InferParallel(), tmp_path, steps=1)
    for r in results:
        assert r["ok"], r.get("traceback")
        assert r["steps"][0]["differ"] == [
            f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(3)
        ]


def test_refit_two_engines_qwen3_moe(tmp_path: Path) -> None:
    """Two tp=2 engines: one through the extension class, one through plain callables."""
    results = run_refit("qwen3_moe", TrainParallel(tp=2), InferParallel(tp=2, dp=2), tmp_path)
    _check(results, 2, first=2)
    assert results[0]["described"]["vllm_version"] == installed_version()
    assert results[1]["described"]["parallel"] == "tp=2,pp=1,dp=1,engine_dp=1,ep=1"


def test_refit_into_fp8_engine(tmp_path: Path) -> None:
    """Megatron tp=2 BF16-trained shards (float32 here) -> a tp=2 engine of vLLM's own
    block-FP8 Qwen3-MoE classes (bfloat16 besides the FP8 weights; layer 0's router left
    unquantized by the checkpoint). Megatron's shards are whole 128x128 blocks, so each
    training rank quantizes its pieces and sends e4m3 + scales straight into the worker's
    parameters: after each step every parameter equals, bit for bit, vLLM's own
    ``load_weights`` of the FP8 checkpoint quantized from the same weights, and none
    moved."""
    results = run_refit("qwen3_moe_fp8", TrainParallel(tp=2), InferParallel(tp=2), tmp_path)
    for r in results:
        assert r["ok"], r.get("traceback")
        assert [len(s["differ"]) for s in r["steps"]] == [0, 0], r["steps"]
        assert [len(s["moved"]) for s in r["steps"]] == [0, 0]
        tensors = r["described"]["tensors"]
        assert r["written"] == r["params"] == len(tensors)
        # 13 scales per rank (qkv, o in 3 layers; gate_up, down in the dense one; w13, w2
        # in the 2 sparse ones; layer 2's router), each written by the refit.
        assert sum(n.endswith("weight_scale_inv") for n in tensors) == 13
        qkv = "model.layers.0.self_attn.qkv_proj"
        assert tensors[f"{qkv}.weight"] == [[512, 256], "float8_e4m3fn"]
        assert tensors[f"{qkv}.weight_scale_inv"] == [[4, 2], "float32"]
        assert tensors["model.layers.0.mlp.gate.weight"] == [[4, 256], "bfloat16"]
        assert tensors["model.layers.2.mlp.gate.weight"] == [[4, 256], "float8_e4m3fn"]
        # DeepGEMM requantizes block-FP8 weights to UE8M0 scales after loading, the
        # FlashInfer-CUTLASS MoE backend swaps w13's halves: a worker whose layers use
        # them refuses, naming each, before any plan.
        assert r["deepgemm"].startswith(
            "UnsupportedVllmOption: block-FP8 kernels that re-lay or requantize weights "
            "after loading cannot be refit in place: model.layers.0.self_attn.qkv_proj: "
            "DeepGemmFp8BlockScaledMMKernel, "
        ), r["deepgemm"]
        assert (
            "model.layers.0.mlp.experts.routed_experts: MoE backend FLASHINFER_CUTLASS"
            in (r["deepgemm"])
        )
        # the same refusal when vLLM creates the weight-transfer engine (start-up)
        assert r["deepgemm_at_creation"] == r["deepgemm"]


def test_refit_deepseek_sequence_parallel_moe(tmp_path: Path) -> None:
    """DeepSeek-V3 with EP over tp=2 x engine_dp=2: shared experts whole on every rank."""
    infer = InferParallel(tp=2, engine_dp=2, ep=4)
    results = run_refit("deepseek_v3", TrainParallel(tp=2), infer, tmp_path)
    _check(results, 2, first=2)
    shared = "model.layers.1.mlp.shared_experts.gate_up_proj.weight"
    assert [r["described"]["tensors"][shared][0] for r in results] == [[32, 32]] * 4


def _single(
    tmp_path: Path, mode: str, plan: str, first_rank: int = 2, model: str = "qwen3_moe"
) -> dict[str, Any]:
    path, out = tmp_path / "vllm.json", tmp_path / "vllm.out.json"
    path.write_text(
        json.dumps(
            dict(
                config=MODELS[model],
                dtype=engine_dtype(spec_from_hf_config(MODELS[model])),
                rank=rank_fields(InferParallel(tp=2), 0, None),
                endpoint="",
                first_rank=first_rank,
                plan=plan,
                checkpoints=[],
                route="function",
                mode=mode,
            )
        )
    )
    vllm_env.finish(vllm_env.start("vllm_refit_rank", str(path), str(out)), "vLLM rank")
    return json.loads(out.read_text())


def test_plan_for_another_vllm_release_is_refused(tmp_path: Path) -> None:
    spec = spec_from_hf_config(MODELS["qwen3_moe"], name="qwen3_moe")
    plan = write_plan(spec, TrainParallel(tp=2), InferParallel(tp=2), tmp_path, "0.11")
    r = _single(tmp_path, "wrong_plan", plan)
    version = installed_version()
    assert r["error"].startswith(
        f"PlanError: vLLM {version} rank 0 of tp=2,pp=1,dp=1,engine_dp=1,ep=1: live parameters "
        "do not match the plan:\n  model.layers.0.mlp.experts.routed_experts.w13_weight: live, "
        "but the plan does not write it"
    ), r["error"]
    assert "model.layers.0.mlp.experts.w13_weight: missing" in r["error"]
    assert r["error"].endswith(
        f"build the plan with VllmOptions(vllm_version='{version}', "
        "all2all_backend='allgather_reducescatter') and this engine's parallelism"
    )


def test_moe_backend_that_relays_weights_is_refused(tmp_path: Path) -> None:
    r = _single(tmp_path, "flashinfer_backend", "")
    assert r["error"].startswith(
        "UnsupportedVllmOption: MoE backends that re-lay w13/w2 after loading cannot be refit "
        "in place: model.layers.0.mlp.experts.routed_experts: FLASHINFER_CUTLASS"
    ), r["error"]
