"""A plan with carried transfers: two pipeline-parallel training ranks on one node, a
tp=2 engine on the other; the busier training rank hands bytes to its NVLink neighbour,
which sends them on one round later (``plan/pass4_routes/carry.py``)."""

from __future__ import annotations

from nemo_refit_reshard.layouts import MegatronOptions, RankLayout, megatron_layout, vllm_layout
from nemo_refit_reshard.plan import Cluster, Placement, RefitPlan, Topology, plan_refit
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.hf_models import TINY_CONFIGS

# 3 layers over 2 pipeline stages, the first holding 1: stage 0 = embedding + 1 layer,
# stage 1 = 2 layers + final norm + head, about a third more bytes.
SPEC = spec_from_hf_config(
    dict(TINY_CONFIGS["llama"], num_hidden_layers=3, vocab_size=256, torch_dtype="float32")
)
# Latencies far below the test model's transfer times, as at real model sizes.
CLUSTER = Cluster(
    gpus_per_node=2, nvlink_gbps=450, nic_gbps=50, nvlink_latency_us=0.01, nic_latency_us=0.02
)


def carried_layouts() -> tuple[list[RankLayout], list[RankLayout]]:
    """Megatron pp=2 (first stage 1 layer) sources, vLLM tp=2 destinations."""
    tp = TrainParallel(pp=2)
    opts = MegatronOptions(num_layers_in_first_pipeline_stage=1)
    sources = [megatron_layout(SPEC, tp, r, opts) for r in range(2)]
    destinations = [vllm_layout(SPEC, InferParallel(tp=2), r) for r in range(2)]
    return sources, destinations


def carried_plan(
    carry: bool = True,
) -> tuple[RefitPlan, list[RankLayout], list[RankLayout], Placement]:
    """The plan (with carries unless ``carry`` is False), its layouts and placement."""
    sources, destinations = carried_layouts()
    placement = Placement.packed(2, 2, CLUSTER)  # training on node 0, inference on node 1
    plan = plan_refit(
        SPEC,
        sources,
        destinations,
        bucket_mb=0.02,
        relay="none",
        links=Topology(CLUSTER, placement),
        carry=carry,
    )
    return plan, sources, destinations, placement
