"""Layer 2: per-framework layout providers (pure functions, no process groups)."""

from .base import Box, LocalTensor, Piece, RankLayout
from .checks import canonical_coverage, check_rank_layout
from .dtensor import (
    Replicate,
    Shard,
    StridedShard,
    dtensor_layout,
    fsdp2_placements,
    fsdp2_tp_placements,
    local_index_runs,
)
from .megatron import MegatronOptions, megatron_layout, megatron_layouts, megatron_padded_vocab
from .megatron_grid import megatron_layer_chunks, megatron_position
from .refit import refit_layouts
from .sglang import check_sglang_parallel, sglang_layout
from .vllm import vllm_layout, vllm_layouts, vllm_padded_vocab
from .vllm_grid import vllm_pp_indices
from .vllm_releases import (
    DEFAULT_VLLM_VERSION,
    VLLM_RELEASES,
    VllmOptions,
    VllmRelease,
    vllm_release,
)

__all__ = [
    "check_sglang_parallel",
    "sglang_layout",
    "DEFAULT_VLLM_VERSION",
    "VLLM_RELEASES",
    "VllmRelease",
    "Box",
    "LocalTensor",
    "MegatronOptions",
    "Piece",
    "RankLayout",
    "Replicate",
    "Shard",
    "StridedShard",
    "VllmOptions",
    "dtensor_layout",
    "fsdp2_placements",
    "fsdp2_tp_placements",
    "local_index_runs",
    "canonical_coverage",
    "check_rank_layout",
    "megatron_layer_chunks",
    "megatron_layout",
    "megatron_layouts",
    "megatron_padded_vocab",
    "megatron_position",
    "refit_layouts",
    "vllm_layout",
    "vllm_layouts",
    "vllm_padded_vocab",
    "vllm_pp_indices",
    "vllm_release",
]
