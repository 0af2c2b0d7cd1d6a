"""The Megatron provider against real megatron-core ``GPTModel``s on gloo CPU worlds.

One spawn of 4 ranks runs every configuration in turn (re-initialising
``parallel_state``). On every rank, for every configuration:

1. names/shapes: ``state_dict()`` names (parameters + persistent buffers) and shapes
   equal the provider's local tensors; ``parallel_state`` coordinates equal
   ``layout.position``.
2. placement: parameters are filled through the provider's pieces with *tags*
   (every canonical element a distinct integer); for every ShardedTensor of
   ``model.sharded_state_dict()`` (factories built) the tags say where the local
   data sits in Megatron's global tensor. That offset must equal the ShardedTensor's
   ``global_offset``, and the whole local block must equal the global tensor (built
   independently, ``megatron_cpu.megatron_global``) at that offset. Ranks holding
   identical (key, offset) shard sets must be exactly ``layout.replicas``.
3. logits: parameters filled from a random HF model's checkpoint tensors through the
   pieces; Megatron's forward (TP-gathered) must match HF's logits. Negative
   controls fill through a corrupted piece set and must not match.
"""

from __future__ import annotations

import os
import tempfile
import traceback
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from nemo_refit_reshard.integrations.nemo_rl.config import RefitConfig
from nemo_refit_reshard.integrations.nemo_rl.plans import megatron_sources
from nemo_refit_reshard.layouts.megatron import MegatronOptions, megatron_layout
from nemo_refit_reshard.plan import PlanError
from nemo_refit_reshard.spec.model import spec_from_hf_config
from nemo_refit_reshard.spec.parallel import TrainParallel
from tests.helpers import megatron_cpu as mc

pytestmark = pytest.mark.slow

WORLD, BATCH, SEQ = 4, 2, 8
P = TrainParallel

# name -> family (tests/hf_models.py), HF overrides, parallel sizes, first-stage layers,
# whether to run the forward, and a negative control (local-name part, canonical a <-> b).
CASES: dict[str, dict[str, Any]] = {
    "llama_tp1": dict(family="llama", par=P(tp=1, dp=4), forward=True),
    "llama_tp2": dict(
        family="llama", par=P(tp=2, dp=2), forward=True, neg=("linear_qkv", "k_proj", "v_proj")
    ),
    "llama_tp4_ng2": dict(family="llama", par=P(tp=4), forward=True),
    "qwen2_qkv_bias_tp2": dict(family="qwen2", par=P(tp=2, dp=2), forward=True),
    "qwen3_tied_tp2": dict(family="qwen3", par=P(tp=2, dp=2), forward=True),
    "qwen3_tied_tp4": dict(family="qwen3", par=P(tp=4), forward=True),
    "qwen3moe_ep2": dict(
        family="qwen3_moe",
        hf=dict(norm_topk_prob=True),
        par=P(tp=1, ep=2, dp=4),
        forward=True,
        neg=("local_experts", "gate_proj", "up_proj"),
    ),
    "qwen3moe_tp2_ep2_etp1": dict(
        family="qwen3_moe",
        hf=dict(norm_topk_prob=False),
        par=P(tp=2, ep=2, etp=1, dp=2),
        forward=True,
    ),
    "qwen3moe_tp2_ep2_etp2": dict(family="qwen3_moe", par=P(tp=2, ep=2, dp=2)),
    "llama_pp2_uneven_tp2": dict(
        family="llama", hf=dict(num_hidden_layers=3), par=P(tp=2, pp=2), first=1
    ),
    "llama_pp2_vpp2": dict(family="llama", hf=dict(num_hidden_layers=4), par=P(pp=2, vpp=2, dp=2)),
    "qwen3_tied_pp2": dict(family="qwen3", par=P(pp=2, dp=2)),
    "qwen3moe_pp2_ep2": dict(family="qwen3_moe", par=P(pp=2, ep=2, dp=2), first=1),
}
FORWARD = [n for n, c in CASES.items() if c.get("forward")]
NEGATIVE = [n for n, c in CASES.items() if c.get("neg")]


def _options(case: dict[str, Any]) -> MegatronOptions:
    return MegatronOptions(num_layers_in_first_pipeline_stage=case.get("first"))


# ------------------------------------------------------------------------------- workers
def _run_case(rank: int, case: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.helpers import megatron_cpu as mc

    par, hf = case["par"], payload["hf"]
    spec = spec_from_hf_config(hf)
    arch = spec.arch
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
    )
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(0)
    vocab = mc.padded_vocab(arch.vocab_size, par.tp)
    chunks = mc.build_gpt(hf, spec, par, vocab, first=case.get("first"))
    params = mc.local_tensors(chunks, par.vpp)
    layout = megatron_layout(spec, par, rank, _options(case))
    # Only tensors Megatron has with the same shape (mismatches are reported by test 1).
    mine = tuple(t for t in layout.tensors if t.name in params and params[t.name].shape == t.shape)
    out: dict[str, Any] = dict(names={n: tuple(p.shape) for n, p in params.items()})
    out["position"] = mc.grid_position()

    tags = mc.tag_tensors(spec)
    mc.fill(params, mine, tags)
    records = [
        mc.shard_record(name, st, arch, tags, vocab)
        for name, st in mc.sharded_tensors(chunks, par.vpp)
    ]
    out["records"] = records

    if case.get("forward"):
        ids = payload["inputs"][out["position"]["dp"]]
        pos = torch.arange(SEQ).expand(BATCH, SEQ)
        group = ps.get_tensor_model_parallel_group()
        runs = [("logits", mine)]
        if "neg" in case:
            runs.append(("negative", mc.swap_pieces(mine, case["neg"])))
        for key, tensors in runs:
            mc.fill(params, tensors, payload["canonical"])
            with torch.no_grad():
                local = chunks[0](ids, pos, mc.causal_mask(SEQ)).contiguous()  # [b, s, Vp/T]
            parts = [torch.empty_like(local) for _ in range(par.tp)]
            dist.all_gather(parts, local, group=group)
            out[key] = torch.cat(parts, dim=-1)[..., : arch.vocab_size]
    out["wrapped"] = _through_wrappers(chunks, params, layout)
    dist.barrier()
    ps.destroy_model_parallel()
    return out


def _through_wrappers(chunks: list, params: dict, layout: Any) -> dict[str, Any]:
    """The live tensors as a framework holds the model — each chunk in Megatron's own
    ``Float16Module`` (which keeps it as ``.module``, like DDP) — by layout name."""
    import copy

    from megatron.core.transformer.module import Float16Module

    from nemo_refit_reshard.integrations.megatron import match_layout, megatron_live_tensors
    from nemo_refit_reshard.integrations.nemo_rl.policy_worker import ReshardPolicyWorkerMixin
    from nemo_refit_reshard.plan import PlanError

    wrapped = []
    for chunk in chunks:
        cfg = copy.copy(chunk.config)
        cfg.bf16 = True  # converts the parameters in place: the same Parameter objects
        wrapped.append(Float16Module(cfg, chunk))
    live = megatron_live_tensors(wrapped)
    same = live.keys() == params.keys() and all(live[n] is params[n] for n in params)
    try:
        matched = sorted(match_layout(live, layout))
        error = None
    except PlanError as err:
        matched, error = [], str(err)
    # What NeMo RL's policy worker (our mixin on its ``self.model``) reports to the driver.
    worker = ReshardPolicyWorkerMixin()
    worker.model, worker.rank = wrapped, layout.rank
    report = worker.reshard_describe()
    return {"same_tensors": same, "matched": matched, "error": error, "report": report}


def _worker(rank: int, tmp: str) -> None:
    warnings.filterwarnings("ignore")  # megatron's TE/Apex fallback notices, once per rank
    import torch.distributed as dist

    from tests.helpers import megatron_cpu as mc

    torch.set_num_threads(1)
    mc.apply_cpu_patches()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/init",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=120),
    )
    payloads = torch.load(os.path.join(tmp, "payload.pt"), weights_only=False)
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = _run_case(rank, case, payloads[name])
        except Exception as e:
            raise RuntimeError(f"rank {rank}, config {name}:\n{traceback.format_exc()}") from e
    torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- parent
def _payload(seed: int, case: dict[str, Any]) -> dict[str, Any]:
    from tests.helpers.hf_models import (
        TINY_CONFIGS,
        checkpoint_state_dict,
        hf_config_dict,
        random_hf_model,
    )

    overrides = case.get("hf", {})
    if not case.get("forward"):
        return dict(hf=dict(TINY_CONFIGS[case["family"]], **overrides))
    model = random_hf_model(case["family"], seed, **overrides)
    hf = hf_config_dict(model)
    canonical = checkpoint_state_dict(model)
    spec_names = [t.name for t in spec_from_hf_config(hf)]
    assert sorted(canonical) == sorted(spec_names), "checkpoint names != ModelSpec names"
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, hf["vocab_size"], (case["par"].dp, BATCH, SEQ), generator=gen)
    with torch.no_grad():
        ref = torch.stack([model(input_ids=ids).logits for ids in inputs])
    return dict(hf=hf, canonical=canonical, inputs=inputs, reference=ref)


@pytest.fixture(scope="module")
def truth() -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    for name, case in CASES.items():
        assert case["par"].world_size == WORLD, name
    payloads = {name: _payload(i, case) for i, (name, case) in enumerate(CASES.items())}
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(payloads, os.path.join(tmp, "payload.pt"))
        mp.start_processes(_worker, args=(tmp,), nprocs=WORLD, start_method="spawn")
        results = {r: torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)}
    return payloads, results


def _layouts(name: str, payloads: dict[str, Any]) -> list:
    case = CASES[name]
    spec = spec_from_hf_config(payloads[name]["hf"])
    return [megatron_layout(spec, case["par"], r, _options(case)) for r in range(WORLD)]


@pytest.mark.parametrize("name", list(CASES))
def test_names_shapes_and_position(truth, name: str) -> None:
    payloads, results = truth
    mc.assert_names_shapes_position(name, _layouts(name, payloads), results)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_state_dict_placement(truth, name: str) -> None:
    payloads, results = truth
    mc.assert_placement(name, _layouts(name, payloads), results)


@pytest.mark.parametrize("name", list(CASES))
def test_live_tensors_through_framework_wrappers(truth, name: str) -> None:
    """Wrapped chunks give the very same tensors, under exactly the layout's names."""
    payloads, results = truth
    layouts = _layouts(name, payloads)
    for rank in range(WORLD):
        got = results[rank][name]["wrapped"]
        assert got["same_tensors"], (name, rank)
        assert got["error"] is None, got["error"]
        assert got["matched"] == sorted(t.name for t in layouts[rank].tensors)


@pytest.mark.parametrize("name", list(CASES))
def test_policy_worker_reports_plan(truth, name: str) -> None:
    """The NeMo RL policy worker's report (real ``parallel_state`` position, options read
    off the wrapped model) is accepted by the driver's plan check, whose layouts then
    name exactly the live tensors, with the live (bf16) dtype."""
    payloads, results = truth
    case = CASES[name]
    reports = [results[r][name]["wrapped"]["report"] for r in range(WORLD)]
    assert reports[0]["options"] == {
        "layer_spec": "local",
        "moe_grouped_gemm": False,
        "num_layers_in_first_pipeline_stage": case.get("first"),
        "num_layers_in_last_pipeline_stage": None,
        "params_dtype": "bfloat16",  # Float16Module(bf16) converted them
    }
    spec = spec_from_hf_config(payloads[name]["hf"])
    sources = megatron_sources(spec, case["par"], RefitConfig(), reports)
    for r, lay in enumerate(sources):
        assert sorted(t.name for t in lay.tensors) == sorted(reports[r]["tensors"])
        assert {t.dtype for t in lay.tensors} == {"bfloat16"}


def test_policy_worker_reports_refuse_a_wrong_config(truth) -> None:
    """Config says tp=1, dp=4; the workers run tp=2, dp=2: every rank is named."""
    payloads, results = truth
    name = "llama_tp2"
    spec = spec_from_hf_config(payloads[name]["hf"])
    reports = [results[r][name]["wrapped"]["report"] for r in range(WORLD)]
    with pytest.raises(PlanError) as err:
        megatron_sources(spec, P(tp=1, dp=4), RefitConfig(), reports)
    lines = str(err.value).splitlines()
    assert lines[0] == (
        f"Megatron policy workers do not match the planned layout {P(tp=1, dp=4)} "
        f"({MegatronOptions(params_dtype='bfloat16')}):"
    )
    assert [line.split(":")[0] for line in lines[1:5]] == [f"  rank {r}" for r in range(4)]
    assert "tp=1 (planned 0)" in lines[2] and "tp_size=2 (config 1)" in lines[2]
    assert lines[-1].startswith("check policy.megatron_cfg")


@pytest.mark.parametrize("name", FORWARD)
def test_logits_match_hf(truth, name: str) -> None:
    payloads, results = truth
    ref = payloads[name]["reference"]
    for rank in range(WORLD):
        res = results[rank][name]
        got, want = res["logits"], ref[res["position"]["dp"]]
        torch.testing.assert_close(
            got, want, atol=1e-4, rtol=1e-4, msg=lambda m, r=rank: f"{name} rank {r}: {m}"
        )


@pytest.mark.parametrize("name", NEGATIVE)
def test_negative_control_differs(truth, name: str) -> None:
    payloads, results = truth
    ref = payloads[name]["reference"]
    for rank in range(WORLD):
        res = results[rank][name]
        diff = (res["negative"] - ref[res["position"]["dp"]]).abs().max().item()
        assert diff > 1e-2, f"{name} rank {rank}: corrupted pieces {CASES[name]['neg']} still match"
