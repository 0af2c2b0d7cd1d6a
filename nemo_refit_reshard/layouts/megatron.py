"""Megatron-core layout provider (follows megatron-core 0.16.1).

For one training rank: the parameters of its ``GPTModel`` chunk(s), named as
``model.named_parameters()`` names them (stage-local ``decoder.layers.{i}``;
with virtual pipeline chunk ``c`` the name is prefixed ``model{c}.`` as in
Megatron's distributed checkpoints), and the canonical pieces in each.

Transforms (HF -> Megatron), with T tensor-parallel ranks, rank r:

* ``linear_qkv``: rows grouped per query group ``g`` as
  ``[q heads of g | k_g | v_g]`` (block ``B = (nq/ng + 2)·hd``); rank r holds the
  even row slice ``[r·R, (r+1)·R)``, ``R = (nq + 2·ng)·hd / T``. With ``ng < T``
  a group's block is cut over ``T/ng`` ranks.
* ``linear_fc1`` (SwiGLU): ``[gate rows r·F/T.. ; up rows r·F/T..]``.
* ``linear_proj`` / ``linear_fc2``: columns ``[r·in/T, (r+1)·in/T)``.
* vocabulary: padded to ``Vp = ceil(V / (m·T))·m·T`` rows; rank r holds
  ``[r·Vp/T, (r+1)·Vp/T)``; rows ``>= V`` are padding.
* experts: EP rank e holds experts ``[e·E/EP, (e+1)·E/EP)``, each sharded over
  ETP like a dense MLP.
"""

from __future__ import annotations

from ..spec.model import ModelSpec
from ..spec.parallel import TrainParallel
from .base import Box, LayoutBuilder, RankLayout, paused_gc
from .megatron_grid import megatron_layer_chunks, megatron_position, megatron_replicas
from .megatron_rules import MegatronOptions, check_megatron_parallel, megatron_padded_vocab


class _MegatronRank:
    """Walks one rank's model chunks and records tensors and pieces."""

    def __init__(self, spec: ModelSpec, par: TrainParallel, rank: int, opts: MegatronOptions):
        self.a = spec.arch
        self.par = par
        self.opts = opts
        self.pos = megatron_position(par, rank)
        self.dtype = opts.params_dtype or self.a.dtype
        self.b = LayoutBuilder()
        self.te = opts.layer_spec == "te"
        self.holds_experts = False

    # -- generic shapes -------------------------------------------------------------------
    def replicated(
        self, local: str, canonical: str, shape: tuple[int, ...], dtype: str = ""
    ) -> None:
        self.b.tensor(local, shape, dtype or self.dtype)
        self.b.piece(canonical, Box.full(shape), local, Box.full(shape))

    def column(self, local: str, canonical: str, rows: int, cols: int, t: int, r: int) -> None:
        """Column-parallel weight: rank r holds rows [r·rows/t, (r+1)·rows/t)."""
        n = rows // t
        self.b.tensor(local, (n, cols), self.dtype)
        self.b.rows(local, [(0, rows, canonical, 0)], r * n, (r + 1) * n)

    def row(self, local: str, canonical: str, rows: int, cols: int, t: int, r: int) -> None:
        """Row-parallel weight: rank r holds columns [r·cols/t, (r+1)·cols/t)."""
        n = cols // t
        self.b.tensor(local, (rows, n), self.dtype)
        self.b.piece(canonical, Box((0, r * n), (rows, n)), local, Box((0, 0), (rows, n)))

    def swiglu_fc1(self, local: str, hf: str, ffn: int, hidden: int, t: int, r: int) -> None:
        n = ffn // t
        self.b.tensor(local, (2 * n, hidden), self.dtype)
        self.b.rows(local, [(0, ffn, f"{hf}.gate_proj.weight", 0)], r * n, (r + 1) * n, 0)
        self.b.rows(local, [(0, ffn, f"{hf}.up_proj.weight", 0)], r * n, (r + 1) * n, n)

    def mlp(self, local: str, hf: str, ffn: int, t: int, r: int, norm: str | None) -> None:
        h = self.a.hidden_size
        if norm is not None:
            self.replicated(f"{local}.linear_fc1.layer_norm_weight", norm, (h,))
        self.swiglu_fc1(f"{local}.linear_fc1.weight", hf, ffn, h, t, r)
        self.row(f"{local}.linear_fc2.weight", f"{hf}.down_proj.weight", h, ffn, t, r)

    def vocab(self, local: str, canonical: str) -> None:
        t, r = self.par.tp, self.pos.tp
        v, h = self.a.vocab_size, self.a.hidden_size
        n = megatron_padded_vocab(v, t, self.opts.make_vocab_size_divisible_by) // t
        self.b.tensor(local, (n, h), self.dtype)
        self.b.rows(local, [(0, v, canonical, 0)], r * n, (r + 1) * n)

    # -- attention ------------------------------------------------------------------------
    def qkv(self, local: str, hf: str, suffix: str) -> None:
        a, t, r = self.a, self.par.tp, self.pos.tp
        hd, qpg, ng = a.head_dim, a.queries_per_group, a.num_key_value_heads
        block = (qpg + 2) * hd
        segments = []
        for g in range(ng):
            segments += [
                (g * block, qpg * hd, f"{hf}.q_proj.{suffix}", g * qpg * hd),
                (g * block + qpg * hd, hd, f"{hf}.k_proj.{suffix}", g * hd),
                (g * block + (qpg + 1) * hd, hd, f"{hf}.v_proj.{suffix}", g * hd),
            ]
        n = ng * block // t
        shape = (n, a.hidden_size) if suffix == "weight" else (n,)
        self.b.tensor(f"{local}.linear_qkv.{suffix}", shape, self.dtype)
        self.b.rows(f"{local}.linear_qkv.{suffix}", segments, r * n, (r + 1) * n)

    def attention(self, local: str, hf: str, layer_hf: str) -> None:
        a, t, r = self.a, self.par.tp, self.pos.tp
        h = a.hidden_size
        if a.mla is not None:
            self.mla(local, hf, layer_hf)
            return
        if self.te:
            self.replicated(
                f"{local}.linear_qkv.layer_norm_weight", f"{layer_hf}.input_layernorm.weight", (h,)
            )
        self.qkv(local, hf, "weight")
        if a.qkv_bias:
            self.qkv(local, hf, "bias")
        self.row(
            f"{local}.linear_proj.weight",
            f"{hf}.o_proj.weight",
            h,
            a.num_attention_heads * a.head_dim,
            t,
            r,
        )
        if a.qk_norm:
            self.replicated(f"{local}.q_layernorm.weight", f"{hf}.q_norm.weight", (a.head_dim,))
            self.replicated(f"{local}.k_layernorm.weight", f"{hf}.k_norm.weight", (a.head_dim,))

    def _fused_norm(self, local: str, te_linear: str, plain_norm: str) -> str:
        """The norm's local name: Transformer Engine fuses it into the next linear."""
        if self.te:
            return f"{local}.{te_linear}.layer_norm_weight"
        return f"{local}.{plain_norm}.weight"

    def mla(self, local: str, hf: str, layer_hf: str) -> None:
        a, t, r = self.a, self.par.tp, self.pos.tp
        m = a.mla
        assert m is not None
        h, nq = a.hidden_size, a.num_attention_heads
        # TE spec: the down projections are duplicated (TELinear parallel_mode="duplicated");
        # the local spec builds them as ColumnParallelLinear, sharded over tp.
        dt, dr = (1, 0) if self.te else (t, r)
        if m.q_lora_rank is None:
            self.column(
                f"{local}.linear_q_proj.weight", f"{hf}.q_proj.weight", nq * m.qk_head_dim, h, t, r
            )
        else:
            self.column(
                f"{local}.linear_q_down_proj.weight",
                f"{hf}.q_a_proj.weight",
                m.q_lora_rank,
                h,
                dt,
                dr,
            )
            norm = self._fused_norm(local, "linear_q_up_proj", "q_layernorm")
            self.replicated(norm, f"{hf}.q_a_layernorm.weight", (m.q_lora_rank,))
            self.column(
                f"{local}.linear_q_up_proj.weight",
                f"{hf}.q_b_proj.weight",
                nq * m.qk_head_dim,
                m.q_lora_rank,
                t,
                r,
            )
        kv_down = m.kv_lora_rank + m.qk_rope_head_dim
        self.column(
            f"{local}.linear_kv_down_proj.weight",
            f"{hf}.kv_a_proj_with_mqa.weight",
            kv_down,
            h,
            dt,
            dr,
        )
        norm = self._fused_norm(local, "linear_kv_up_proj", "kv_layernorm")
        self.replicated(norm, f"{hf}.kv_a_layernorm.weight", (m.kv_lora_rank,))
        self.column(
            f"{local}.linear_kv_up_proj.weight",
            f"{hf}.kv_b_proj.weight",
            nq * (m.qk_nope_head_dim + m.v_head_dim),
            m.kv_lora_rank,
            t,
            r,
        )
        self.row(f"{local}.linear_proj.weight", f"{hf}.o_proj.weight", h, nq * m.v_head_dim, t, r)

    # -- MLP / MoE ------------------------------------------------------------------------
    def moe(self, local: str, hf: str) -> None:
        a, par, pos = self.a, self.par, self.pos
        moe = a.moe
        assert moe is not None
        h = a.hidden_size
        self.replicated(f"{local}.router.weight", f"{hf}.gate.weight", (moe.num_experts, h))
        if moe.router_bias:
            self.replicated(
                f"{local}.router.expert_bias",
                f"{hf}.gate.e_score_correction_bias",
                (moe.num_experts,),
                "float32",
            )
        per_rank = moe.num_experts // par.ep
        self.holds_experts = True
        for i in range(per_rank):
            e = pos.ep * per_rank + i
            if self.opts.moe_grouped_gemm:
                fc1, fc2 = (
                    f"{local}.experts.linear_fc1.weight{i}",
                    f"{local}.experts.linear_fc2.weight{i}",
                )
            else:
                base = f"{local}.experts.local_experts.{i}"
                fc1, fc2 = f"{base}.linear_fc1.weight", f"{base}.linear_fc2.weight"
            fe = moe.expert_intermediate_size
            self.swiglu_fc1(fc1, f"{hf}.experts.{e}", fe, h, par.expert_tp, pos.etp)
            self.row(fc2, f"{hf}.experts.{e}.down_proj.weight", h, fe, par.expert_tp, pos.etp)
        if moe.num_shared_experts:
            self.mlp(
                f"{local}.shared_experts",
                f"{hf}.shared_experts",
                moe.shared_intermediate_size,
                par.tp,
                pos.tp,
                None,
            )

    def decoder_layer(self, local: str, layer: int) -> None:
        a = self.a
        hf = f"model.layers.{layer}"
        h = a.hidden_size
        if not self.te or a.mla is not None:
            self.replicated(f"{local}.input_layernorm.weight", f"{hf}.input_layernorm.weight", (h,))
        self.attention(f"{local}.self_attention", f"{hf}.self_attn", hf)
        post_norm = f"{hf}.post_attention_layernorm.weight"
        if a.is_sparse(layer):
            self.replicated(f"{local}.pre_mlp_layernorm.weight", post_norm, (h,))
            self.moe(f"{local}.mlp", f"{hf}.mlp")
        elif self.te:
            self.mlp(
                f"{local}.mlp",
                f"{hf}.mlp",
                a.intermediate_size,
                self.par.tp,
                self.pos.tp,
                post_norm,
            )
        else:
            self.replicated(f"{local}.pre_mlp_layernorm.weight", post_norm, (h,))
            self.mlp(
                f"{local}.mlp", f"{hf}.mlp", a.intermediate_size, self.par.tp, self.pos.tp, None
            )

    # -- whole rank -----------------------------------------------------------------------
    def build(self) -> None:
        a, par, pos, opts = self.a, self.par, self.pos, self.opts
        chunks = megatron_layer_chunks(
            a.num_layers,
            par,
            pos.pp,
            opts.num_layers_in_first_pipeline_stage,
            opts.num_layers_in_last_pipeline_stage,
        )
        last_stage = pos.pp == par.pp - 1
        for c, (first, count) in enumerate(chunks):
            prefix = f"model{c}." if par.vpp > 1 else ""
            pre = pos.pp == 0 and c == 0
            post = last_stage and c == len(chunks) - 1
            if pre:
                self.vocab(f"{prefix}embedding.word_embeddings.weight", "model.embed_tokens.weight")
            for i in range(count):
                self.decoder_layer(f"{prefix}decoder.layers.{i}", first + i)
            if post:
                self.replicated(
                    f"{prefix}decoder.final_layernorm.weight", "model.norm.weight", (a.hidden_size,)
                )
                if a.num_mtp_layers:
                    self.mtp(prefix)
                if not a.tie_word_embeddings:
                    self.vocab(f"{prefix}output_layer.weight", "lm_head.weight")
                elif par.pp > 1:
                    # The last stage keeps its own copy, kept equal by the embedding group.
                    self.vocab(f"{prefix}output_layer.weight", "model.embed_tokens.weight")

    def mtp(self, prefix: str) -> None:
        """Multi-token prediction layers (``mtp.layers.{k}``) on the last stage.

        They share Megatron's embedding and output layer, so the checkpoint's
        per-MTP-layer ``embed_tokens`` / ``shared_head.head`` copies have no
        separate source here.
        """
        a = self.a
        h = a.hidden_size
        for k in range(a.num_mtp_layers):
            layer = a.num_layers + k
            hf, local = f"model.layers.{layer}", f"{prefix}mtp.layers.{k}"
            self.replicated(f"{local}.enorm.weight", f"{hf}.enorm.weight", (h,))
            self.replicated(f"{local}.hnorm.weight", f"{hf}.hnorm.weight", (h,))
            self.column(
                f"{local}.eh_proj.weight",
                f"{hf}.eh_proj.weight",
                h,
                2 * h,
                self.par.tp,
                self.pos.tp,
            )
            self.decoder_layer(f"{local}.transformer_layer", layer)
            self.replicated(
                f"{local}.final_layernorm.weight", f"{hf}.shared_head.norm.weight", (h,)
            )


@paused_gc
def megatron_layout(
    spec: ModelSpec, parallel: TrainParallel, rank: int, options: MegatronOptions | None = None
) -> RankLayout:
    """The local tensors and canonical pieces of Megatron training rank ``rank``."""
    opts = options or MegatronOptions()
    spec = spec.unquantized()  # the trained weights: never an FP8 checkpoint
    check_megatron_parallel(spec.arch, parallel, opts)
    walker = _MegatronRank(spec, parallel, rank, opts)
    walker.build()
    return RankLayout(
        framework="megatron",
        rank=rank,
        world_size=parallel.world_size,
        position=walker.pos.as_dict(),
        replicas=megatron_replicas(parallel, rank, walker.holds_experts),
        tensors=walker.b.build(),
    )


def megatron_layouts(
    spec: ModelSpec, parallel: TrainParallel, options: MegatronOptions | None = None
) -> list[RankLayout]:
    """Every Megatron training rank's layout, ranks ``0..world_size-1`` in order."""
    spec = spec.unquantized()  # once, not per rank
    return [megatron_layout(spec, parallel, r, options) for r in range(parallel.world_size)]
