"""Megatron helpers: a live Megatron-core worker read in the layouts' terms, and real
Megatron-core models on a CPU-only torch.

``live.py``: a live worker's tensors under the Megatron layout's names, the layout
options its model decides and its ``parallel_state`` position (the NeMo RL policy
worker reports them). ``cpu.py``: patches and builders that run megatron-core's
``GPTModel`` on CPU (the CPU GRPO example's trainer and the tests use them); import it
as ``nemo_refit_reshard.integrations.megatron.cpu``.
"""

from .live import (
    UNKNOWABLE_OPTIONS,
    live_megatron_options,
    live_megatron_position,
    load_canonical,
    match_layout,
    megatron_live_tensors,
    unwrap,
)

__all__ = [
    "UNKNOWABLE_OPTIONS",
    "live_megatron_options",
    "live_megatron_position",
    "load_canonical",
    "match_layout",
    "megatron_live_tensors",
    "unwrap",
]
