"""The vLLM layout provider against vLLM's own model classes (vLLM installed on CPU).

For every case, vLLM's model class is built for each engine rank (meta device) and
its ``named_parameters()`` — names, shapes, dtypes — must equal the provider's local
tensors exactly. For the content cases the ranks are built with real float32
storage and loaded through vLLM's own ``model.load_weights()`` from random
checkpoint tensors: every provider piece must then hold exactly the canonical slice
it claims, and every padding box zeros. Two negative controls show both checks fail
when a provider rule is broken.

vLLM runs in its own processes under the Python of ``scripts/setup_vllm_cpu.sh``;
without it the tests skip and say how to install it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import pytest
import torch

from nemo_refit_reshard.engine.materialize import mismatches
from nemo_refit_reshard.layouts import VLLM_RELEASES, RankLayout, VllmOptions, vllm_layout
from nemo_refit_reshard.spec import InferParallel, ModelSpec, spec_from_hf_config
from tests.helpers import vllm_env
from tests.helpers.checkpoints import random_tensors
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires
from tests.helpers.vllm_jobs import rank_fields

pytestmark = [pytest.mark.slow, requires(vllm_env.skip_reason)]

P = InferParallel
# (model, parallelism, all2all backend or None for vLLM's default)
CASES: list[tuple[str, InferParallel, str | None]] = [
    ("llama", P(), None),
    ("llama", P(tp=2), None),
    ("llama", P(tp=4), None),  # 2 KV heads over 4 ranks: each replicated twice
    ("llama", P(tp=2, pp=2), None),
    ("qwen2", P(tp=4), None),  # qkv biases, KV replication
    ("qwen2", P(pp=2), None),
    ("qwen3", P(tp=2, pp=2), None),  # tied: the last stage builds embed_tokens too
    ("qwen3", P(tp=4), None),
    ("qwen3_moe", P(tp=2), None),
    ("qwen3_moe", P(tp=2, engine_dp=2), None),  # experts sliced over 4 moe ranks
    ("qwen3_moe", P(tp=2, engine_dp=2, ep=4), None),
    ("qwen3_moe", P(tp=2, pp=2, ep=2), None),
    ("qwen3_moe_e6", P(engine_dp=4, ep=4), None),  # 6 experts over 4: 2, 2, 1, 1
    ("deepseek_v3", P(tp=2), None),
    ("deepseek_v3", P(tp=2, engine_dp=2), None),
    ("deepseek_v3", P(tp=2, engine_dp=2, ep=4), None),  # sequence-parallel MoE
    ("deepseek_v3", P(tp=2, pp=3, engine_dp=2, ep=4), None),
    ("deepseek_v3", P(tp=2, engine_dp=2, ep=4), "flashinfer_nvlink_two_sided"),  # not SP
    ("deepseek_v3", P(engine_dp=2, ep=2), None),  # tp=1: not SP
    ("deepseek_v3_no_topk_method", P(tp=2), None),
    ("deepseek_v3_no_q_lora", P(tp=4), None),
    ("kimi_k2", P(tp=4, engine_dp=2, ep=8), None),  # 12 experts over 8 ranks
    ("qwen3_fp8", P(), None),
    ("qwen3_fp8", P(tp=2), None),
    ("qwen3_fp8", P(tp=4), None),  # 2 KV heads over 4 ranks: scale rows replicated too
    ("qwen3_moe_fp8", P(tp=2), None),
    ("qwen3_moe_fp8", P(tp=2, engine_dp=2, ep=4), None),
    ("deepseek_v3_fp8", P(tp=2), None),
    ("deepseek_v3_fp8", P(tp=2, engine_dp=2, ep=4), None),
]
# Built with real storage and loaded through vLLM's load_weights().
CONTENT_CASES: list[tuple[str, InferParallel, str | None]] = [
    ("llama", P(tp=4), None),
    ("qwen2", P(tp=2), None),
    ("qwen3", P(tp=2, pp=2), None),
    ("qwen3_moe", P(tp=2, engine_dp=2), None),
    ("qwen3_moe_e6", P(engine_dp=4, ep=4), None),
    ("deepseek_v3", P(tp=2, engine_dp=2, ep=4), None),
    ("deepseek_v3_no_q_lora", P(tp=2, pp=2), None),
    ("deepseek_v3", P(tp=2), None),  # shared experts sharded over TP
    ("kimi_k2", P(tp=4, engine_dp=2, ep=8), None),
    ("qwen3_moe", P(tp=2, pp=2, ep=2), None),
    ("qwen3_fp8", P(tp=4), None),
    ("qwen3_moe_fp8", P(tp=2), None),
    ("deepseek_v3_fp8", P(tp=2, engine_dp=2, ep=4), None),
]


_VERSION = vllm_env.installed_vllm_version()


def _mla_builds_on_cpu() -> bool:
    """0.33's CPU platform has an MLA attention backend; 0.24/0.25's refuse MLA on CPU."""
    if _VERSION is None:
        return True
    major, minor = (int(x) for x in _VERSION.split(".")[:2])
    return (major, minor) >= (0, 33)


def _is_mla(case: tuple[str, InferParallel, str | None]) -> bool:
    return MODELS[case[0]]["architectures"][0] == "DeepseekV3ForCausalLM"


def runnable(cases: list[tuple[str, InferParallel, str | None]]) -> list[Any]:
    out = []
    for case in cases:
        if _is_mla(case) and not _mla_builds_on_cpu():
            reason = (
                f"vLLM {_VERSION}'s CPU platform has no MLA attention backend, so its "
                "DeepSeek classes do not build here; this release's MLA rules rest on its source"
            )
            out.append(pytest.param(case, id=case_id(case), marks=pytest.mark.skip(reason=reason)))
        else:
            out.append(pytest.param(case, id=case_id(case)))
    return out


def case_id(case: tuple[str, InferParallel, str | None]) -> str:
    model, par, backend = case
    return f"{model}-{par}" + (f"-{backend}" if backend else "")


def engine_ranks(par: InferParallel) -> list[int]:
    """One engine's ranks (independent engines are identical)."""
    return list(range(par.engine_world_size))


@functools.cache
def spec_of(model: str) -> ModelSpec:
    return spec_from_hf_config(MODELS[model], name=model)


def checkpoint(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 checkpoint tensors, every element distinct in practice; a block-FP8
    model's quantized weights as e4m3 (their scales float32), as its checkpoint has them."""
    out = random_tensors(spec, seed)
    for t in spec:
        if t.dtype == "float8_e4m3fn":
            out[t.name] = out[t.name].to(torch.float8_e4m3fn)
    return out


def content_dtype(model: str) -> str:
    """float32 storage, except FP8 models: vLLM's Fp8Config refuses a float32 model dtype
    (its unquantized tensors are then bfloat16)."""
    return "bfloat16" if MODELS[model].get("quantization_config") else "float32"


# Created by vLLM's Fp8KVCacheMethod for every attention layer of an FP8 model and
# deleted by its process_weights_after_loading (quantization/kv_cache.py): never in a
# serving engine, so never refit.
_KV_SCALES = ("attn.q_scale", "attn.k_scale", "attn.v_scale", "attn.prob_scale")


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case's builds, in two vLLM processes running side by side (meta / content)."""
    work = tmp_path_factory.mktemp("vllm-truth")
    meta_job: dict[str, Any] = {"configs": MODELS, "builds": []}
    for case in [c for c in CASES if _mla_builds_on_cpu() or not _is_mla(c)]:
        model, par, backend = case
        for rank in engine_ranks(par):
            meta_job["builds"].append(
                dict(
                    id=f"{case_id(case)}/{rank}",
                    config=model,
                    rank=rank_fields(par, rank, backend),
                    device="meta",
                )
            )
    content_job: dict[str, Any] = {"configs": MODELS, "builds": []}
    for model in sorted({c[0] for c in CONTENT_CASES}):
        from safetensors.torch import save_file

        save_file(checkpoint(spec_of(model)), str(work / f"{model}.safetensors"))
    for case in [c for c in CONTENT_CASES if _mla_builds_on_cpu() or not _is_mla(c)]:
        model, par, backend = case
        for rank in engine_ranks(par):
            bid = f"{case_id(case)}/{rank}"
            content_job["builds"].append(
                dict(
                    id=bid,
                    config=model,
                    rank=rank_fields(par, rank, backend),
                    device="cpu",
                    dtype=content_dtype(model),
                    weights=str(work / f"{model}.safetensors"),
                    out=str(work / f"{bid.replace('/', '_')}.safetensors"),
                )
            )
    procs = {}
    for name, job in (("meta", meta_job), ("content", content_job)):
        d = work / name
        d.mkdir()
        (d / "job.json").write_text(json.dumps(job))
        procs[name] = (vllm_env.start("vllm_cpu_job", str(d / "job.json"), str(d / "r.json")), d)
    out: dict[str, Any] = {}
    for name, (proc, d) in procs.items():
        vllm_env.finish(proc, f"vLLM {name} builds")
        out[name] = json.loads((d / "r.json").read_text())
    out["work"] = work
    return out


def provider_layout(
    model: str, par: InferParallel, rank: int, backend: str | None, dtype: str, version: str
) -> RankLayout:
    opts = VllmOptions(params_dtype=dtype, vllm_version=version, all2all_backend=backend)
    return vllm_layout(spec_of(model), par, rank, opts)


def name_shape_mismatches(layout: RankLayout, live: dict[str, list[Any]]) -> list[str]:
    """Differences between the provider's tensors and vLLM's ``named_parameters()``."""
    ours = {t.name: [list(t.shape), t.dtype] for t in layout.tensors}
    live = {n: v for n, v in live.items() if not n.endswith(_KV_SCALES)}
    out = [f"only in vLLM: {n} {live[n]}" for n in sorted(set(live) - set(ours))]
    out += [f"only in the provider: {n} {ours[n]}" for n in sorted(set(ours) - set(live))]
    out += [
        f"{n}: vLLM {live[n]}, provider {ours[n]}"
        for n in sorted(set(ours) & set(live))
        if ours[n] != live[n]
    ]
    return out


def content_mismatches(
    layout: RankLayout, loaded: dict[str, torch.Tensor], canonical: dict[str, torch.Tensor]
) -> list[str]:
    """Tensors whose pieces do not hold their canonical boxes after vLLM's loader, and
    padding boxes that are not zero."""
    out = mismatches(layout, loaded, canonical)
    for t in layout.tensors:
        local = loaded[t.name]
        for box in t.padding:
            if local[box.slices()].count_nonzero():
                out.append(f"{t.name}: padding {box} is not zero")
    return out


@pytest.mark.parametrize("case", runnable(CASES))
def test_provider_matches_vllm_parameters(
    case: tuple[str, InferParallel, str | None], vllm_runs: dict[str, Any]
) -> None:
    model, par, backend = case
    result = vllm_runs["meta"]
    for rank in engine_ranks(par):
        build = result["builds"][f"{case_id(case)}/{rank}"]
        lay = provider_layout(
            model, par, rank, backend, build["model_dtype"], result["vllm_version"]
        )
        assert name_shape_mismatches(lay, build["params"]) == [], f"rank {rank}"


def test_sequence_parallel_moe_is_what_vllm_decided(vllm_runs: dict[str, Any]) -> None:
    """The provider's sequence-parallel rule agrees with vLLM's ParallelConfig."""
    result = vllm_runs["meta"]
    for case in CASES:
        model, par, backend = case
        build = result["builds"].get(f"{case_id(case)}/0")
        if build is None:  # not buildable with this release on CPU (see runnable)
            continue
        opts = VllmOptions(vllm_version=result["vllm_version"], all2all_backend=backend)
        assert opts.sequence_parallel_moe(par) == build["sequence_parallel_moe"], case_id(case)


@pytest.mark.parametrize("case", runnable(CONTENT_CASES))
def test_provider_pieces_hold_what_vllm_loaded(
    case: tuple[str, InferParallel, str | None], vllm_runs: dict[str, Any]
) -> None:
    from safetensors.torch import load_file

    model, par, backend = case
    canonical = checkpoint(spec_of(model))
    result = vllm_runs["content"]
    for rank in engine_ranks(par):
        bid = f"{case_id(case)}/{rank}"
        build = result["builds"][bid]
        loaded = load_file(str(vllm_runs["work"] / f"{bid.replace('/', '_')}.safetensors"))
        lay = provider_layout(
            model, par, rank, backend, content_dtype(model), result["vllm_version"]
        )
        assert name_shape_mismatches(lay, build["params"]) == []
        assert content_mismatches(lay, loaded, canonical) == [], f"rank {rank}"


def test_broken_rules_are_caught(
    vllm_runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative controls: each check fails when one provider rule is broken."""
    result = vllm_runs["meta"]
    version = result["vllm_version"]
    key = ".".join(version.split(".")[:2])
    # 1. Shared experts sharded over TP under sequence-parallel MoE (the old rule).
    if _mla_builds_on_cpu():
        case = ("deepseek_v3", P(tp=2, engine_dp=2, ep=4), None)
        no_sp = dataclasses.replace(VLLM_RELEASES[key], sequence_parallel_backends=frozenset())
        monkeypatch.setitem(VLLM_RELEASES, key, no_sp)
        build = result["builds"][f"{case_id(case)}/0"]
        lay = provider_layout("deepseek_v3", case[1], 0, None, build["model_dtype"], version)
        diffs = name_shape_mismatches(lay, build["params"])
        assert any("shared_experts.gate_up_proj" in d for d in diffs), diffs
        monkeypatch.undo()
    # 2. The pre-0.24 expert module name.
    case = ("qwen3_moe", P(tp=2), None)
    build = result["builds"][f"{case_id(case)}/0"]
    lay = provider_layout("qwen3_moe", case[1], 0, None, build["model_dtype"], "0.11")
    diffs = name_shape_mismatches(lay, build["params"])
    assert "only in vLLM: model.layers.0.mlp.experts.routed_experts.w13_weight" in " ".join(
        diffs
    ), diffs
    # 3. Content: K and V heads swapped inside qkv_proj.
    from safetensors.torch import load_file

    case = ("llama", P(tp=4), None)
    bid = f"{case_id(case)}/1"
    loaded = load_file(str(vllm_runs["work"] / f"{bid.replace('/', '_')}.safetensors"))
    lay = provider_layout(
        "llama", case[1], 1, None, "float32", vllm_runs["content"]["vllm_version"]
    )
    swapped = []
    for t in lay.tensors:
        pieces = tuple(
            dataclasses.replace(
                p,
                canonical=p.canonical.replace("k_proj", "@")
                .replace("v_proj", "k_proj")
                .replace("@", "v_proj"),
            )
            for p in t.pieces
        )
        swapped.append(dataclasses.replace(t, pieces=pieces))
    broken = dataclasses.replace(lay, tensors=tuple(swapped))
    diffs = content_mismatches(broken, loaded, checkpoint(spec_of("llama")))
    assert diffs == [
        f"model.layers.{i}.self_attn.qkv_proj.weight <- model.layers.{i}.self_attn.v_proj.weight"
        for i in range(2)
    ], diffs


def test_broken_fp8_scale_rule_is_caught(
    vllm_runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control for the FP8 rules: every rank taking rank 0's columns of a
    row-parallel scale (o_proj, down_proj) keeps the names and shapes vLLM registers,
    and the content check fails on the ranks whose scales vLLM's loader sliced."""
    from safetensors.torch import load_file

    from nemo_refit_reshard.layouts.vllm_fp8 import Fp8Layout

    original = Fp8Layout.scale_columns

    def first_columns(self, weight, canonical, rows, n, rank, tp):  # type: ignore[no-untyped-def]
        return original(self, weight, canonical, rows, n, 0, tp)

    monkeypatch.setattr(Fp8Layout, "scale_columns", first_columns)
    case = ("qwen3_fp8", P(tp=4), None)
    canonical = checkpoint(spec_of("qwen3_fp8"))
    result = vllm_runs["content"]
    failed = []
    for rank in engine_ranks(case[1]):
        bid = f"{case_id(case)}/{rank}"
        loaded = load_file(str(vllm_runs["work"] / f"{bid.replace('/', '_')}.safetensors"))
        lay = provider_layout("qwen3_fp8", case[1], rank, None, "bfloat16", result["vllm_version"])
        assert name_shape_mismatches(lay, result["builds"][bid]["params"]) == []
        failed.append(content_mismatches(lay, loaded, canonical))
    assert failed[0] == []
    for rank in (1, 2, 3):
        assert (
            "model.layers.0.self_attn.o_proj.weight_scale_inv <- "
            "model.layers.0.self_attn.o_proj.weight_scale_inv"
        ) in failed[rank], failed[rank]


def test_vllm_native_backend_plans_the_fp8_engine(vllm_runs: dict[str, Any]) -> None:
    """The vLLM-native ``reshard`` backend's trainer side, told the engine's block-FP8
    ``quantization_config`` (as ``ReshardTrainerInitInfo.quantization``), plans what
    vLLM's own FP8 classes hold: every worker's planned tensors are its
    ``named_parameters()`` (e4m3 weights, float32 scales, the unquantized router of
    layer 0), all written by the refit; two replicated trainer ranks hold every weight
    whole, so all of it crosses as e4m3 + scales they quantize, none as twins."""
    from nemo_refit_reshard.integrations.vllm.engine_plan import plan_for_engine
    from nemo_refit_reshard.integrations.vllm.transfer_sources import FullModuleSource

    model, par = "qwen3_moe_fp8", InferParallel(tp=2)
    cfg = MODELS[model]
    trained = spec_from_hf_config({k: v for k, v in cfg.items() if k != "quantization_config"})
    result = vllm_runs["meta"]
    opts = VllmOptions(params_dtype="bfloat16", vllm_version=result["vllm_version"])
    source = FullModuleSource({}, trained, world_size=2)
    plan = plan_for_engine(source, par, opts, quantization=cfg["quantization_config"])
    for rank in engine_ranks(par):
        build = result["builds"][f"{case_id((model, par, None))}/{rank}"]
        live = {n: v for n, v in build["params"].items() if not n.endswith(_KV_SCALES)}
        planned = plan.expected_tensors(plan.num_sources + rank)
        assert {n: [list(s), d] for n, (s, d) in planned.items()} == live
        assert plan.quantize_steps_of(plan.num_sources + rank) == ()
    assert all(plan.quantize_steps_of(r) for r in range(plan.num_sources))
    assert dict(plan.stats.bytes_by_dtype)["float8_e4m3fn"] > 0
    with pytest.raises(ValueError) as err:
        plan_for_engine(source, par, opts, quantization={"quant_method": "awq"})
    assert str(err.value).startswith("quantization_config.quant_method='awq' is not modeled")
