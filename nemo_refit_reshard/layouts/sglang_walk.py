"""SGLang's rank walker (:class:`SglangRank`): vLLM's walker (``layouts/vllm.py``) with
SGLang 0.5.23's own rules where they differ, read from ``models/deepseek_v2.py``,
``models/deepseek_common/deepseek_weight_loader.py`` and ``layers/moe/fused_moe_triton/
layer.py`` and checked against SGLang's classes (``tests/test_sglang_truth.py``).

With S = tp, E routed experts, ``ep`` = ``--ep-size`` (1 or S here), ``moe_tp = S / ep``,
rank s: ``moe_ep_rank = s // moe_tp``, ``moe_tp_rank = s % moe_tp``:

* MLA with ``q_lora_rank``: ``fused_qkv_a_proj_with_mqa`` = ``[q_a_proj ;
  kv_a_proj_with_mqa]`` rows, replicated (a ``ReplicatedLinear``; vLLM names it
  ``fused_qkv_a_proj``). Without ``q_lora_rank``: ``q_proj`` column-parallel,
  ``kv_a_proj_with_mqa`` replicated, as in vLLM.
* FusedMoE: rank s holds the E/ep routed experts ``[moe_ep_rank·E/ep, ..)``
  (``_map_global_expert_id_to_local_expert_id``; ep must divide E), each expert's
  ``w13_weight[j] = [gate rows r·Fe/moe_tp.. ; up rows]`` and ``w2_weight[j]`` columns
  ``[r·Fe/moe_tp, ..)`` with r = moe_tp_rank.
* block FP8: each local expert's ``w13_weight_scale_inv[j]`` = [gate scale rows ; up
  scale rows] of its slice and ``w2_weight_scale_inv[j]`` the scale columns of its slice,
  in whole 128x128 blocks (``Fp8MoEMethod.create_fp8_moe_weight_``, vLLM's rule:
  ``Fp8Layout.expert_scales``); dense linears take vLLM's FP8 walker unchanged.
* fused shared experts (``num_fused_shared_experts = 1``): the shared expert is expert
  ``E`` of the checkpoint (the loader renames ``mlp.shared_experts`` to ``mlp.experts.E``)
  and sits after the local routed experts, in slot ``E/ep``, sliced like them; no
  ``mlp.shared_experts`` module is built.
* pipeline stage k of P builds the layers :func:`sglang_pp_indices` gives it (global
  layer indices in the names; the rest are ``PPMissingLayer``), ``model.embed_tokens``
  on stage 0 only and ``model.norm`` on stage P-1 only, in every family. ``lm_head``
  differs per family (:meth:`SglangRank.build`): Llama (``models/llama.py``) and
  Qwen3-MoE (``models/qwen3_moe.py``) build a ``ParallelLMHead`` on *every* stage, each
  loaded from the checkpoint's ``lm_head.weight``; Qwen2, Qwen3 and DeepSeek
  (``qwen2.py``, ``qwen3.py``, ``deepseek_v2.py``) build it on stage P-1 only. Tied
  Qwen2/Qwen3 under P > 1 build a separate ``lm_head.weight`` on stage P-1, loaded from
  ``model.embed_tokens.weight`` (their ``load_weights``); under P = 1 ``lm_head`` *is*
  ``embed_tokens`` (one parameter).
* data-parallel attention (``--dp-size D --enable-dp-attention``, 0.5.23's
  ``--attn-dp-size D``, with ``--tp-size S``) is ``InferParallel(tp=S/D, engine_dp=D)``:
  the engine's S ranks, SGLang's tp rank ``t = attn_dp_rank·(S/D) + attn_tp_rank``
  (``runtime_context.derive_attention_ranks``) = ``edp·tp + tp_rank`` of
  ``vllm_position``. Attention (``parallel_group="attn_tp"``: ``qkv_proj``, ``o_proj``
  in ``qwen3.py`` ~203 and ``qwen3_moe.py`` ~532, MLA's ``q_proj``/``q_b_proj``/
  ``kv_b_proj``/``o_proj`` in ``deepseek_v2.py`` ~2084-2161) and ``embed_tokens``
  (``use_attn_tp_group=is_dp_attention_enabled()``: ``qwen2.py`` ~374, ``qwen2_moe.py``
  ~1118, ``vocab_parallel_embedding.get_embedding_tp_kwargs``) are split over ``tp`` =
  S/D by ``tp_rank``, replicated across the D groups; the dense MLP (Qwen3's
  ``Qwen2MLP``, group ``tp``; DeepSeek's dense layers, ``deepseek_v2.py`` ~2665, with
  ``--moe-dense-tp-size`` unset; shared experts ~896), the FusedMoE (``moe_tp = S/ep``,
  ``runtime_context.derive_parallel_widths``) and ``lm_head``
  (``use_attn_tp_group=enable_dp_lm_head``, off by default: ``qwen3.py`` ~586,
  ``qwen3_moe.py`` ~1022, ``deepseek_v2.py`` ~3296) over all S ranks by ``t``
  (:attr:`SglangRank.ffn_rank`).
"""

from __future__ import annotations

from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel
from .sglang_grid import sglang_pp_indices
from .vllm import VllmRankWalker, vllm_padded_vocab
from .vllm_releases import VllmOptions


class SglangRank(VllmRankWalker):
    """One SGLang rank's tensors; ``fuse_shared``: the shared expert lives in ``experts``."""

    fused_qkv_a = "fused_qkv_a_proj_with_mqa"  # a ReplicatedLinear, as vLLM's fused_qkv_a_proj

    def __init__(
        self,
        spec: ModelSpec,
        par: InferParallel,
        rank: int,
        opts: VllmOptions,
        fuse_shared: bool,
    ):
        super().__init__(spec, par, rank, opts)
        self.fuse_shared = fuse_shared
        # SGLang's whole tp group (--tp-size): engine_dp·tp ranks under dp attention,
        # where this rank is SGLang tp rank edp·tp + tp_rank; the MLP, experts and
        # lm_head are split over it, attention and embed_tokens over tp only.
        self.ffn_tp = par.engine_dp * par.tp
        self.ffn_rank = self.pos.edp * par.tp + self.pos.tp
        # SGLang builds shared experts with parallel_group="tp" (only its all-to-all MoE
        # backends, not covered here, replicate them).
        self.shared_tp = self.ffn_tp

    def _refuse(self, name: str, what: str, size: int, block: int) -> ValueError:
        return ValueError(
            f"{name}: {what} {size} is not a multiple of the FP8 block {block}; SGLang "
            "0.5.23 cannot hold this checkpoint at this tensor-parallel size "
            "(Fp8LinearMethod.validate_block_quant_shapes; choose one whose shards are "
            "whole blocks)"
        )

    def fused_moe(self, p: str) -> None:
        a, par = self.a, self.par
        moe = a.moe
        assert moe is not None
        fe, e_total = moe.expert_intermediate_size, moe.num_experts
        moe_tp = self.ffn_tp // par.ep
        ep_rank, tp_rank = self.ffn_rank // moe_tp, self.ffn_rank % moe_tp
        n_routed = e_total // par.ep
        experts = [f"{p}.experts.{e}" for e in range(ep_rank * n_routed, (ep_rank + 1) * n_routed)]
        if self.fuse_shared:
            experts.append(f"{p}.shared_experts")  # loaded as experts.E, in the last slot
        n = fe // moe_tp
        dtype = self.weight_dtype(f"{experts[0]}.gate_proj.weight")
        # vLLM's tensors, and with FP8 (SGLang's Fp8MoEMethod) its scale names, shapes and
        # slices, under SGLang's module name
        self.expert_weights(f"{p}.experts", experts, dtype, n, tp_rank * n)

    def dense_mlp(
        self, p: str, hf: str, ffn: int, tp: int | None = None, rank: int | None = None
    ) -> None:
        """``gate_up_proj``/``down_proj`` (and block-FP8 scales) over SGLang's whole tp
        group under dp attention, this rank being its ``ffn_rank`` there; vLLM's split
        otherwise (the same)."""
        if self.par.engine_dp == 1:
            super().dense_mlp(p, hf, ffn, tp, rank)
            return
        super().dense_mlp(p, hf, ffn, self.ffn_tp, self.ffn_rank)

    def lm_head(self, canonical: str) -> None:
        """``lm_head.weight``: the padded vocabulary's rows over SGLang's whole tp group."""
        if self.par.engine_dp == 1:
            self.vocab("lm_head.weight", canonical)
            return
        s, r = self.ffn_tp, self.ffn_rank
        n = vllm_padded_vocab(self.a.vocab_size) // s
        self.b.tensor("lm_head.weight", (n, self.a.hidden_size), self.dtype)
        self.b.rows("lm_head.weight", [(0, self.a.vocab_size, canonical, 0)], r * n, (r + 1) * n)

    def mlp(self, layer: int, p: str) -> None:
        a = self.a
        moe = a.moe
        if moe is None or not a.is_sparse(layer) or not self.fuse_shared:
            super().mlp(layer, p)
            return
        # vLLM's MoE block without the separate shared_experts module.
        self.replicated(f"{p}.gate.weight", (moe.num_experts, a.hidden_size))
        if moe.router_bias and moe.topk_method == "noaux_tc":
            self.replicated(
                f"{p}.gate.e_score_correction_bias", (moe.num_experts,), dtype="float32"
            )
        self.fused_moe(p)

    def build(self) -> None:
        a, par, pos = self.a, self.par, self.pos
        h = a.hidden_size
        start, end = sglang_pp_indices(a.num_layers, pos.pp, par.pp, self.opts.pp_layer_partition)
        first, last = pos.pp == 0, pos.pp == par.pp - 1
        if first:
            self.vocab("model.embed_tokens.weight", "model.embed_tokens.weight")
        for layer in range(start, end):
            self.decoder_layer(layer)
        if last:
            self.replicated("model.norm.weight", (h,))
        # A tied DeepSeek at pp=1 is lm_head = embed_tokens (deepseek_v2.py ~3288); tied
        # configs of Qwen3-MoE, and DeepSeek's under pp, are refused (check_sglang_parallel).
        tied = a.tie_word_embeddings
        if not (last or a.family in ("llama", "qwen3_moe")):
            return
        if not tied:
            self.lm_head("lm_head.weight")
        elif par.pp > 1:  # Qwen2 / Qwen3: the last stage's own head, from the embedding
            self.lm_head("model.embed_tokens.weight")
