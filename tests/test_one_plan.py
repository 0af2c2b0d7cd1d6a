"""One plan on every path (issue #40 item 3): the layout facts a rank reads are settled
once for the model, and every path compares plan fingerprints before the first step.

The end-to-end case is a DeepSeek-V3-shaped megatron-core model whose first pipeline
stage is all dense, with grouped-GEMM experts (``tests/programs/one_plan_world.py``,
which names its stand-in: Transformer Engine's grouped linear layers), through the NeMo
RL plan (the reports our policy worker gives and the driver-side code NeMo RL's driver
runs, ``plans.megatron_sources``), the vLLM-native trainer (``trainer_init`` +
``send_weights``, separate and colocated) and a genuinely divergent trainer rank.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nemo_refit_reshard.engine.rendezvous import free_address, new_secret
from nemo_refit_reshard.integrations.megatron import live_megatron_options
from nemo_refit_reshard.integrations.nemo_rl.config import RefitConfig
from nemo_refit_reshard.integrations.nemo_rl.plans import megatron_options, megatron_sources
from nemo_refit_reshard.integrations.vllm.transfer_sources import MegatronSource
from nemo_refit_reshard.integrations.worker import ColocatedTrainer, RefitEndpoint
from nemo_refit_reshard.plan import Colocation, PlanError, plan_refit
from nemo_refit_reshard.runner import RunConfig, build_layouts
from nemo_refit_reshard.spec import TrainParallel, spec_from_hf_config
from tests.helpers import vllm_env
from tests.helpers.requires import requires

OPTIONS = {
    "layer_spec": "te",
    "moe_grouped_gemm": True,
    "num_layers_in_first_pipeline_stage": 3,
    "num_layers_in_last_pipeline_stage": None,
    "params_dtype": "bfloat16",
}


def _reports(*options: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"rank": r, "options": o} for r, o in enumerate(options)]


# ------------------------------------------------------------- settled once for the model
def test_a_rank_that_cannot_tell_abstains() -> None:
    """A dense stage without a config saying (None) abstains; the expert ranks decide."""
    dense = dict(OPTIONS, moe_grouped_gemm=None)
    opts = megatron_options(TrainParallel(pp=3), RefitConfig(), _reports(dense, OPTIONS, OPTIONS))
    assert opts.moe_grouped_gemm is True and opts.layer_spec == "te"


def test_a_genuinely_divergent_rank_is_one_line() -> None:
    other = dict(OPTIONS, moe_grouped_gemm=False)
    with pytest.raises(PlanError) as err:
        megatron_options(TrainParallel(pp=3), RefitConfig(), _reports(OPTIONS, other, OPTIONS))
    assert str(err.value) == (
        "policy workers disagree on moe_grouped_gemm (ranks [1]: False; ranks [0, 2]: True): "
        "every rank must run one model and training config (policy.megatron_cfg)"
    )


class _Stage(torch.nn.Module):
    """A pipeline stage's parameters under Megatron's names (``config``: a stand-in for
    megatron-core's ``TransformerConfig``, which every rank of a model shares)."""

    def __init__(self, names: list[str], config: Any = None) -> None:
        super().__init__()
        self.params = torch.nn.ParameterDict(
            {n.replace(".", "-"): torch.nn.Parameter(torch.zeros(1)) for n in names}
        )
        if config is not None:
            self.config = config

    def state_dict(self, *args: Any, **kw: Any) -> dict[str, Any]:  # type: ignore[override]
        return {k.replace("-", "."): v for k, v in self.params.items()}


DENSE_STAGE = ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"]
GROUPED_STAGE = ["decoder.layers.0.mlp.experts.linear_fc1.weight0"]
SEQUENTIAL_STAGE = ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]


def test_grouped_gemm_comes_from_the_models_config() -> None:
    grouped = SimpleNamespace(moe_grouped_gemm=True, num_moe_experts=4)
    assert live_megatron_options(_Stage(DENSE_STAGE, grouped))["moe_grouped_gemm"] is True
    assert live_megatron_options(_Stage(GROUPED_STAGE, grouped))["moe_grouped_gemm"] is True
    dense_model = SimpleNamespace(moe_grouped_gemm=True, num_moe_experts=None)
    assert live_megatron_options(_Stage(DENSE_STAGE, dense_model))["moe_grouped_gemm"] is False
    # Without a config: the names decide where there are experts; a dense stage abstains.
    assert live_megatron_options(_Stage(DENSE_STAGE))["moe_grouped_gemm"] is None
    assert live_megatron_options(_Stage(SEQUENTIAL_STAGE))["moe_grouped_gemm"] is False
    assert live_megatron_options(_Stage(["embedding.word_embeddings.weight"]))["layer_spec"] is None
    with pytest.raises(PlanError) as err:
        live_megatron_options(_Stage(SEQUENTIAL_STAGE, grouped))
    assert str(err.value) == (
        "Megatron model: its TransformerConfig says moe_grouped_gemm=True but its experts are "
        "named as SequentialMLP's (experts.local_experts.{i}); build the layer spec from the "
        "config (get_gpt_decoder_block_spec) or set moe_grouped_gemm to match it"
    )


def test_megatron_source_refuses_what_its_rank_cannot_tell() -> None:
    spec = spec_from_hf_config(_deepseek_hf())
    with pytest.raises(ValueError) as err:
        MegatronSource(_Stage(DENSE_STAGE), spec, TrainParallel(pp=2), 0)
    assert str(err.value) == (
        "Megatron trainer rank 0 cannot tell moe_grouped_gemm from its own parameters (it "
        "holds no such layers and its model has no config saying): pass them to "
        "MegatronSource, the same on every rank"
    )
    source = MegatronSource(
        _Stage(DENSE_STAGE), spec, TrainParallel(pp=2), 0, moe_grouped_gemm=True
    )
    assert source.options.moe_grouped_gemm is True


def _deepseek_hf() -> dict[str, Any]:
    from tests.programs.one_plan_world import hf_config

    return hf_config()


# ------------------------------------------------------------ colocated trainer ranks
def test_colocated_trainer_ranks_compare_fingerprints_at_join() -> None:
    """Training ranks that hold different plans are refused on every rank at join, in one
    line naming the ranks and fingerprints, before any step."""
    spec, sources, destinations = build_layouts(
        RunConfig(model="small-qwen3", train="tp=2", infer="tp=2")
    )
    hosts = Colocation.same_index(len(sources), len(destinations))
    plans = [
        plan_refit(spec, sources, destinations, bucket_mb=mb, colocation=hosts) for mb in (512, 1)
    ]
    host, port = free_address()
    secret = new_secret()
    errors: dict[int, str] = {}

    def rank(r: int) -> None:
        tensors = {
            t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in sources[r].tensors
        }
        endpoint = RefitEndpoint(host, port, 2, r, timeout_s=120, secret=secret)
        trainer = ColocatedTrainer(endpoint, tensors, plans[r])
        try:
            trainer.join()
        except PlanError as err:
            errors[r] = str(err)
        finally:
            trainer.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = plans[0].fingerprint, plans[1].fingerprint
    detail = "; ".join(f"ranks [{r}]: {fp}" for fp, r in sorted([(a, 0), (b, 1)]))
    line = (
        f"refit ranks hold different plans ({detail}); build the plan once (on the driver "
        "or rank 0) and ship the same plan file to every rank"
    )
    assert errors == {0: line, 1: line}


# ------------------------------------------------ a dense first stage through every path


@pytest.mark.slow
@requires(vllm_env.skip_reason)
def test_dense_first_stage_one_plan_on_every_path(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    vllm_env.finish(vllm_env.start("one_plan_world", str(out)), "the two-rank Megatron world")
    ranks = json.loads(out.read_text())
    reports = [r["report"] for r in ranks]
    # Stage 0 holds dense layers only, stage 1 the grouped-GEMM experts.
    assert not any(".experts." in n for n in reports[0]["parameters"])
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight0" in reports[1]["parameters"]
    # NeMo RL: both ranks report one set of options; the driver's plan check accepts
    # them and its layouts name exactly each rank's live tensors.
    assert reports[0]["options"] == reports[1]["options"]
    assert reports[0]["options"]["moe_grouped_gemm"] is True
    spec = spec_from_hf_config(_deepseek_hf())
    layouts = megatron_sources(spec, TrainParallel(pp=2), RefitConfig(), reports)
    for lay, report in zip(layouts, reports, strict=True):
        assert sorted(t.name for t in lay.tensors) == sorted(report["tensors"])
    # The vLLM-native trainer: every rank plans alone, and identically.
    assert ranks[0]["fingerprints"] == ranks[1]["fingerprints"]
    prints = ranks[0]["fingerprints"]
    for mode in ("separate", "colocated"):
        first, second = ranks[0][mode], ranks[1][mode]
        assert "error" not in first and "error" not in second, (first, second)
        assert first["fingerprint"] == second["fingerprint"] == prints[mode]
        assert first["calls"] == ["init", "start", "update", "finish"]
        assert first["checked"] == 98 and first["mismatches"] == [], mode
    # A genuinely divergent rank: refused on both, before rank 0 ships anything.
    divergent = [r["divergent"] for r in ranks]
    assert divergent[0]["calls"] == []
    mine = prints["colocated"]
    other = divergent[1]["error"].split("ranks [1]: ")[1].split(";")[0].split(")")[0]
    assert other != mine
    detail = "; ".join(f"ranks [{r}]: {fp}" for fp, r in sorted([(mine, 0), (other, 1)]))
    line = (
        f"PlanError: trainer ranks planned different refits ({detail}): every rank's source "
        "must give the same layouts (MegatronSource: pass the same options on every rank)"
    )
    assert divergent[0]["error"] == divergent[1]["error"] == line
