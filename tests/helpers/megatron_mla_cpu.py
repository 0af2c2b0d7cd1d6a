"""Real megatron-core MLA (DeepSeek-V3-like) ``GPTModel``s on CPU, for the MLA truth test
and the end-to-end refit tests whose training ranks are DeepSeek models.

Like ``megatron_cpu.py``, for spawned processes only (the patches are global). The
global-tensor statement (:func:`mla_global`) is written from megatron-core's MLA
sources (``multi_latent_attention.py``: q/kv down and up projections, their layernorms),
not from the layout provider.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F

from nemo_refit_reshard.integrations.megatron.cpu import CPU_CONFIG
from nemo_refit_reshard.spec.model import ModelSpec, spec_from_hf_config
from nemo_refit_reshard.spec.parallel import TrainParallel
from tests.helpers import megatron_cpu as mc

BASE_GLOBAL = mc.megatron_global  # the GQA/MoE statement, for the keys MLA shares


def cpu_mla_patches() -> type:
    """Extra CPU patches for MLA (not in ``megatron_cpu.apply_cpu_patches``; see
    /tmp/notes_megatron.md P6) and a core-attention class MLA can use without TE."""
    from megatron.core.transformer import multi_latent_attention as mla_mod
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    # P6: megatron.core.extensions.transformer_engine imports without TE (``te`` is a
    # MagicMock), so multi_latent_attention's try-import sets HAVE_TE=True and
    # MLASelfAttention.__init__ calls isinstance(..., TELinear) on a MagicMock: TypeError.
    mla_mod.HAVE_TE = False

    class DotProductAttentionKV(DotProductAttention):
        """MLASelfAttention passes ``k_channels``/``v_channels`` to its core attention,
        which only TEDotProductAttention accepts; the local DotProductAttention would
        also size its output by ``kv_channels`` instead of ``v_head_dim``."""

        def __init__(self, *args: Any, k_channels: Any = None, v_channels: Any = None, **kw: Any):
            super().__init__(*args, **kw)
            if v_channels is not None:
                self.hidden_size_per_attention_head = v_channels
                heads = self.num_attention_heads_per_partition
                self.hidden_size_per_partition = v_channels * heads

    return DotProductAttentionKV


def mla_config(hf: dict[str, Any], par: TrainParallel) -> Any:
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    spec = spec_from_hf_config(hf)
    arch, moe = spec.arch, spec.arch.moe
    assert moe is not None and arch.mla is not None
    return MLATransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        ffn_hidden_size=arch.intermediate_size,
        q_lora_rank=hf["q_lora_rank"],
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_type="rope",
        rotary_base=mc.rope_theta(hf),
        rotary_scaling_factor=1.0,
        rotary_interleaved=False,  # see the module docstring
        qk_layernorm=True,  # q_a_layernorm / kv_a_layernorm
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        add_bias_linear=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=par.tp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        **CPU_CONFIG,
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.expert_intermediate_size,
        moe_shared_expert_intermediate_size=moe.shared_intermediate_size,
        moe_layer_freq=[int(arch.is_sparse(i)) for i in range(arch.num_layers)],
        moe_router_topk=int(hf["num_experts_per_tok"]),
        # DeepSeek-V3 routing: sigmoid scores, top-k chosen on scores + expert_bias,
        # weights = chosen raw scores renormalised (norm_topk_prob) times the scale.
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_router_num_groups=hf.get("n_group"),
        moe_router_group_topk=hf.get("topk_group"),
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )


def mla_global(key: str, arch: Any, c: dict[str, torch.Tensor], vocab: int) -> torch.Tensor:
    """Megatron's global tensor for sharded key ``key`` (heterogeneous block:
    ``decoder.layers.<global i>.<sub>``), from the HF DeepSeek-V3 canonical tensors."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key)
    if m is None:
        return BASE_GLOBAL(key, arch, c, vocab)
    p, sub = f"model.layers.{m[1]}.", m[2]
    direct = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
        "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
        "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
        "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
        "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
    }
    if sub in direct:
        return c[p + direct[sub]]
    if sub == "mlp.shared_experts.linear_fc1.weight":
        s = p + "mlp.shared_experts."
        return torch.cat([c[s + "gate_proj.weight"], c[s + "up_proj.weight"]])
    return mc._layer_global(arch, c, int(m[1]), sub)  # dense MLP, routed experts, router


def build_mla_gpt(
    hf: dict[str, Any], spec: ModelSpec, par: TrainParallel, vocab: int, attn_cls: type
) -> torch.nn.Module:
    """This rank's MLA ``GPTModel`` with the local spec (``get_gpt_decoder_block_spec``:
    per-layer dense or MoE from ``moe_layer_freq``), in eval mode. Model parallel state
    must be initialized; ``attn_cls`` from :func:`cpu_mla_patches`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = mla_config(hf, par)
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    for layer_spec in block.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = attn_cls
    return GPTModel(
        config=cfg,
        transformer_layer_spec=block,
        vocab_size=vocab,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=mc.rope_theta(hf),
        share_embeddings_and_output_weights=spec.arch.tie_word_embeddings,
    ).eval()
