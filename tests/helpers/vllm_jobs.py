"""What the tests tell a vLLM process about an engine rank (``tests/programs``' jobs)."""

from __future__ import annotations

from typing import Any

from nemo_refit_reshard.layouts.vllm_grid import vllm_position
from nemo_refit_reshard.spec import InferParallel, ModelSpec
from tests.helpers import vllm_env


def installed_version() -> str:
    """The vLLM version of the vLLM venv (the tests using it skip when there is none)."""
    version = vllm_env.installed_vllm_version()
    assert version is not None
    return version


def rank_fields(par: InferParallel, rank: int, backend: str | None) -> dict[str, Any]:
    """Engine rank ``rank``'s parallel sizes and grid position, as vLLM's config takes them."""
    pos = vllm_position(par, rank)
    return dict(
        tp=par.tp,
        pp=par.pp,
        engine_dp=par.engine_dp,
        expert_parallel=par.expert_parallel,
        tp_rank=pos.tp,
        pp_rank=pos.pp,
        dp_rank=pos.edp,
        all2all_backend=backend,
    )


def engine_dtype(spec: ModelSpec) -> str:
    """float32 storage; bfloat16 for a block-FP8 engine (vLLM's Fp8Config refuses float32)."""
    return "bfloat16" if spec.arch.quant is not None else "float32"
