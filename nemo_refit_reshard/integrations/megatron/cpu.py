"""Run real megatron-core 0.16.1 ``GPTModel``s on a CPU-only torch (gloo, no TE/Apex).

megatron-core assumes CUDA in a handful of places even when every tensor lives on the
CPU; :func:`apply_cpu_patches` redirects exactly those. The patches rewrite some
``torch.cuda`` entry points *globally*, so call it only in processes that will never
use a GPU (spawned training workers, not a pytest parent that also runs GPU tests).

:func:`transformer_config` and :func:`build_gpt` build a float32 ``GPTModel`` with
the local (non-Transformer-Engine) layer spec from the shape facts of a
:class:`~nemo_refit_reshard.spec.config.ArchConfig`, so that its parameters carry the
names and shapes :func:`~nemo_refit_reshard.layouts.megatron_layout` describes.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...spec.config import ArchConfig
from ...spec.parallel import TrainParallel

_PATCHED = False


def apply_cpu_patches() -> None:
    """Monkeypatch torch/megatron so that build, ``sharded_state_dict``, forward and
    backward run on CPU. Idempotent. Each patch was shown to be needed by switching it
    off."""
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    # P1: ``model_parallel_cuda_manual_seed`` -> ``CudaRNGStatesTracker.add`` reads
    # ``torch.cuda.get_rng_state()`` ("Torch not compiled with CUDA enabled"), and
    # ``DotProductAttention.forward`` forks the tracker (even with dropout 0), which calls
    # ``random._get/_set_cuda_rng_state``. Map them all onto the CPU default generator;
    # the fork restores the state afterwards, so the global CPU stream is not disturbed.
    def get_state(*_a: Any, **_k: Any) -> Tensor:
        return torch.get_rng_state()

    def set_state(state: Tensor, *_a: Any, **_k: Any) -> None:
        torch.set_rng_state(state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = get_state
    torch.cuda.manual_seed = torch.manual_seed

    # P2: ``device=torch.cuda.current_device()`` allocates rotary ``inv_freq``, the TP
    # all-gather buffers (tensor_parallel/mappings.py), the MoE router's casts and the
    # pipeline schedules' receive buffers; "cpu" turns them into CPU allocations
    # (otherwise: AssertionError, no CUDA).
    torch.cuda.current_device = lambda: "cpu"

    # P3: ``LanguageModule.setup_embeddings_and_output_layer`` does
    # ``weight.data = weight.data.cuda()`` before all-reducing the tied word embedding
    # over the embedding group (pp > 1 with share_embeddings_and_output_weights).
    torch.Tensor.cuda = lambda self, *_a, **_k: self

    # P5: megatron-core 0.16.1 imports ``te_general_gemm`` only inside ``try: import
    # transformer_engine`` but the router forward tests ``te_general_gemm is not None``
    # unconditionally: NameError in every MoE forward without TE.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # (P4, the alltoall dispatcher's CUDA streams, is not needed: we use "allgather".)

    # P6: every schedule of ``get_forward_backward_func`` (pp = 1 included) allocates its
    # token counter with a literal ``torch.zeros([], device="cuda")``. The schedules module
    # gets a ``torch`` whose ``zeros`` maps "cuda" to "cpu"; nothing else changes. (The
    # p2p ``torch.cuda.synchronize()`` is avoided by ``batch_p2p_sync=False``, below.)
    schedules.torch = _CpuZerosTorch()
    _PATCHED = True


class _CpuZerosTorch(types.ModuleType):
    """``torch`` for megatron's schedules module, with ``zeros(device="cuda")`` on CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kw: Any) -> Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kw)


# TransformerConfig settings every CPU model needs (shared with the MLA truth tests).
CPU_CONFIG: dict[str, Any] = dict(
    # Every rank builds the full master weight on the CPU and keeps its slice; without
    # this, weights are allocated on current_device() and initialised by the CUDA RNG.
    use_cpu_initialization=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    # CUDA-only fused kernels (all default off in 0.16; pinned here on purpose).
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
    # batch_isend_irecv is followed by torch.cuda.synchronize() (an old NCCL
    # workaround) unless this is off; gloo needs no such sync.
    batch_p2p_sync=False,
)


def transformer_config(
    arch: ArchConfig,
    par: TrainParallel,
    *,
    norm_eps: float,
    first: int | None = None,
    last: int | None = None,
    **overrides: Any,
) -> Any:
    """The float32, CPU-safe ``TransformerConfig`` of a dense Llama/Qwen-style ``arch``.

    ``first``/``last``: ``num_layers_in_{first,last}_pipeline_stage``. ``overrides`` are
    passed to ``TransformerConfig`` last (MoE keys, ``perform_initialization``...).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,  # explicit: Qwen3's head_dim != hidden / heads
        ffn_hidden_size=arch.intermediate_size,
        gated_linear_unit=True,  # SwiGLU: linear_fc1 = [gate; up]
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=norm_eps,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        **CPU_CONFIG,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(
    config: Any,
    arch: ArchConfig,
    par: TrainParallel,
    padded_vocab: int,
    *,
    rope_theta: float,
    max_sequence_length: int = 64,
) -> list[torch.nn.Module]:
    """This rank's ``GPTModel`` chunk(s) (one per virtual pipeline stage), local spec.

    Needs ``parallel_state`` initialised. ``padded_vocab`` is the full padded vocabulary
    (megatron-core pads nothing itself; Megatron-LM's training script does).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    chunks = []
    for vp in range(par.vpp) if par.vpp > 1 else [None]:
        if arch.moe is not None:
            # Per-layer specs (dense layers from moe_layer_freq), sliced for this stage.
            layer_spec = get_gpt_decoder_block_spec(
                config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp
            )
        else:
            layer_spec = get_gpt_layer_local_spec(
                qk_layernorm=arch.qk_norm, normalization="RMSNorm"
            )
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=layer_spec,
                vocab_size=padded_vocab,
                max_sequence_length=max_sequence_length,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                position_embedding_type="rope",
                rotary_base=rope_theta,
                share_embeddings_and_output_weights=arch.tie_word_embeddings,
                vp_stage=vp,
            )
        )
    return chunks


def causal_mask(seq: int) -> Tensor:
    """Megatron's boolean mask, True = masked out. Passing None would make
    ``get_default_causal_mask`` allocate on ``device="cuda"``."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
