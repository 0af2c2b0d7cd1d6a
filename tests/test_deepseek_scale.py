"""Claims about a real-size rank, checked on meta tensors (shapes, no memory): DeepSeek-V3
trained with Megatron ``pp=16,dp=16,ep=16`` (3 and 2 layers on the first and last stage)
refit into vLLM ``tp=32,dp=8`` with 1 GiB buckets — what ``gpu-check`` replays on a GPU.
One plan for the module (~15 s); each program compiles in ~10-20 s."""

from __future__ import annotations

import pytest
import torch

from nemo_refit_reshard.engine.host_staged import HostStagedTransport
from nemo_refit_reshard.engine.materialize import empty_like_layout
from nemo_refit_reshard.engine.program import RankProgram
from nemo_refit_reshard.layouts import MegatronOptions, refit_layouts
from nemo_refit_reshard.plan import plan_refit, rank_plan
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec

pytestmark = pytest.mark.slow
META = torch.device("meta")
TRAINING_RANK = 16  # the second pipeline stage's first rank: MoE layers, strided rows
GIB = 2**30


@pytest.fixture(scope="module")
def deepseek():
    spec = load_model_spec("deepseek-v3")
    stages = MegatronOptions(
        num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=2
    )
    src, dst = refit_layouts(
        spec, TrainParallel(pp=16, dp=16, ep=16), InferParallel(tp=32, dp=8), stages
    )
    return plan_refit(spec, src, dst, bucket_mb=1024), src, dst


def _program(deepseek, rank: int) -> RankProgram:
    plan, src, dst = deepseek
    s = plan.num_sources
    layout = src[rank] if rank < s else dst[rank - s]
    return RankProgram(rank_plan(plan, rank), rank, empty_like_layout(layout, device=META), META)


class _Nothing:
    """An inner transport that moves nothing (sizing on meta tensors)."""

    rank, world_size, timeout_s = 0, 2, 5.0

    def start_exchange(self, sends, recvs, round_index=0):
        return self

    def wait(self) -> None:
        pass


@pytest.fixture(scope="module")
def inference_rank_0(deepseek) -> RankProgram:
    return _program(deepseek, deepseek[0].num_sources)


def test_host_copies_of_an_inference_rank_are_at_most_its_staging(inference_rank_0) -> None:
    """vLLM rank 0, every round through the host-staged transport: the host memory it
    holds is the staging, one mirror per staging storage. Keyed per message span, as
    before, the same rounds held the sum of every span's bytes: many times the staging
    (asserted too, so the test shows what it guards against)."""
    program = inference_rank_0
    staged = HostStagedTransport(_Nothing())
    spans = 0
    for phase in program.rounds:
        staged.exchange(phase.sends, phase.recvs)
        spans += sum(b.numel() for _, b in [*phase.sends, *phase.recvs])
    assert program.staging_bytes < 1.01 * GIB
    assert staged.staged_bytes == program.recv_buffers[0].numel()  # a receiver: no sends
    assert spans > 40 * program.staging_bytes  # what per-span copies held


def _strided(program: RankProgram) -> int:
    lists = ("copies_out", "local_out", "copies_in")
    return sum(
        not (d.is_contiguous() and s.is_contiguous())
        for phase in program.rounds
        for name in lists
        for d, s in getattr(phase, name)
    )


def test_copies_are_grouped_into_few_launches(deepseek, inference_rank_0) -> None:
    """``_foreach_copy_`` takes its multi-tensor path only for a list whose every pair is
    dense and of one dtype: grouped at compile time, the inference rank's ~18,000 copies
    a step are a few launches a round (ungrouped, its 9 strided pairs sent every list
    they were in down the per-pair path), and a training rank's launches are its
    strided pairs (one each) plus a few a round."""
    program = inference_rank_0
    rounds = len(program.rounds)
    assert program.num_copies > 18_000
    assert _strided(program) < 20
    assert sum(program.launches_per_round) <= 8 * rounds  # ~380 copies a round, 64 a launch
    training = _program(deepseek, TRAINING_RANK)
    strided = _strided(training)
    assert strided > 2_000
    assert strided < sum(training.launches_per_round) <= strided + 2 * rounds
