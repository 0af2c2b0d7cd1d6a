"""The vLLM rank provider: the local tensors of one vLLM inference rank and the
canonical pieces each holds (:func:`vllm_layout`, :func:`vllm_layouts`), and the
parallel settings vLLM refuses (:func:`check_vllm_parallel`). Where a rank sits (its
position, pipeline layers, experts, replicas) is ``vllm_grid``; which release's rules
apply (:data:`VLLM_RELEASES`, :class:`VllmOptions`) is ``vllm_releases``.

The rules below were read from each release's source; for 0.33.0 every rank's
``named_parameters()`` of vLLM's own model classes is compared with this provider
(``tests/test_vllm_truth.py``). With S = tp, rank s:

* ``qkv_proj``: ``[q heads s·nq/S.. | k heads | v heads]``; if ``S >= ng`` each rank
  holds one KV head ``s // (S/ng)`` (replicated ``S/ng`` times).
* ``gate_up_proj``: ``[gate rows s·F/S.. ; up rows s·F/S..]``; ``o_proj``/``down_proj``
  take input columns ``[s·in/S, ..)``.
* vocabulary padded to ``Vp = ceil(V/64)·64``; rank s holds token ids
  ``[s·Vp/S, (s+1)·Vp/S)``, ids ``>= V`` are (zero) padding.
* FusedMoE: over ``M = engine_dp·tp`` ranks, moe rank ``m = edp·tp + tp_rank``;
  without expert parallel ``w13_weight[e] = [gate rows m·Fe/M.. ; up rows]``,
  ``w2_weight[e]`` columns ``[m·Fe/M, ..)``; with expert parallel (``ep = M``) rank
  m holds ``E//M + (m < E%M)`` whole experts from ``m·(E//M) + min(m, E%M)``.
  Since 0.24 the weights live in the runner's child module: ``experts.routed_experts.``.
* sequence-parallel MoE (expert parallel, ``tp > 1``, ``engine_dp > 1`` and an
  all2all backend that splits tokens, the default one included): DeepSeek's shared
  experts are built with ``disable_tp`` — every rank holds them whole.
* DeepSeek's ``gate.e_score_correction_bias`` exists only when config.json says
  ``topk_method: noaux_tc`` (float32).
* pipeline: each stage builds the layers ``vllm_pp_indices`` gives it; parameter names
  keep the global layer index.
"""

from __future__ import annotations

from ..spec.config import ArchConfig
from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel
from ..spec.quantization import FP8
from .base import Box, LayoutBuilder, RankLayout, paused_gc
from .vllm_fp8 import Fp8Layout
from .vllm_grid import vllm_expert_range, vllm_position, vllm_pp_indices, vllm_replicas
from .vllm_releases import VllmOptions, vllm_release

VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE


def vllm_padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def check_vllm_parallel(
    a: ArchConfig, par: InferParallel, options: VllmOptions | None = None
) -> None:
    """Raise ``ValueError`` naming the parameter and rule for an impossible combination."""
    opts = options or VllmOptions()
    vllm_release(opts.vllm_version)  # an unknown version fails here, before any layout
    s, nq, ng = par.tp, a.num_attention_heads, a.num_key_value_heads
    if nq % s:
        raise ValueError(f"tp={s} must divide num_attention_heads={nq} (vLLM's rule)")
    if a.mla is None and (ng % s if s < ng else s % ng):
        raise ValueError(
            f"tp={s} and num_key_value_heads={ng}: one must divide the other "
            "(vLLM's QKVParallelLinear)"
        )
    if a.intermediate_size % s:
        raise ValueError(f"tp={s} must divide intermediate_size={a.intermediate_size}")
    vp = vllm_padded_vocab(a.vocab_size)
    if vp % s:
        raise ValueError(f"tp={s} must divide the padded vocabulary {vp} (vocab padded to 64)")
    if par.pp > a.num_layers:
        raise ValueError(f"pp={par.pp} exceeds num_hidden_layers={a.num_layers}")
    moe = a.moe
    if moe is None:
        if par.expert_parallel:
            raise ValueError(f"ep={par.ep} given for {a.family}, which has no experts")
        return
    if par.expert_parallel:
        if par.ep > moe.num_experts:
            raise ValueError(
                f"ep={par.ep} exceeds num_experts={moe.num_experts}: some expert-parallel ranks "
                "would hold no expert; lower engine_dp·tp or turn expert parallel off (ep=1)"
            )
    elif moe.expert_intermediate_size % par.moe_size:
        raise ValueError(
            f"engine_dp·tp={par.moe_size} must divide moe_intermediate_size="
            f"{moe.expert_intermediate_size} (FusedMoE shards experts over engine_dp·tp ranks "
            "without expert parallel); use ep=engine_dp·tp or a smaller tp/engine_dp"
        )
    if moe.shared_intermediate_size % s and not opts.sequence_parallel_moe(par):
        raise ValueError(
            f"tp={s} must divide the shared-expert size {moe.shared_intermediate_size}"
        )


class VllmRankWalker(Fp8Layout):
    """Walks the model's modules in vLLM's order, building one rank's local tensors and
    their pieces (``layouts/sglang_walk.py`` subclasses it for SGLang's names)."""

    # MLA's fused ``[q_a_proj ; kv_a_proj_with_mqa]``, replicated: vLLM's module name (the
    # one thing SGLang, which builds the same tensor, names otherwise).
    fused_qkv_a = "fused_qkv_a_proj"

    def __init__(self, spec: ModelSpec, par: InferParallel, rank: int, opts: VllmOptions):
        self.spec = spec
        self.a = spec.arch
        self.par = par
        self.opts = opts
        self.pos = vllm_position(par, rank)
        self.release = opts.release
        # Shared experts are built with disable_tp under sequence-parallel MoE.
        self.shared_tp = 1 if opts.sequence_parallel_moe(par) else par.tp
        self.dtype = opts.params_dtype or self.a.dtype
        self.version = self.release.version
        self.b = LayoutBuilder()

    def replicated(
        self, name: str, shape: tuple[int, ...], canonical: str | None = None, dtype: str = ""
    ) -> None:
        canonical = canonical or name
        quantized = self.fp8(canonical)
        self.b.tensor(name, shape, FP8 if quantized else dtype or self.dtype)
        self.b.piece(canonical, Box.full(shape), name, Box.full(shape))
        if quantized:
            assert len(shape) == 2
            self.scale_full(name, canonical, (shape[0], shape[1]))

    def column(self, name: str, canonical: str, rows: int, cols: int) -> None:
        s, r = self.par.tp, self.pos.tp
        n = rows // s
        self.b.tensor(name, (n, cols), self.weight_dtype(canonical))
        self.b.rows(name, [(0, rows, canonical, 0)], r * n, (r + 1) * n)
        if self.fp8(canonical):
            self.scale_rows(name, (n, cols), [(0, rows, canonical, 0)], r * n, (r + 1) * n, 0, rows)

    def row(self, name: str, canonical: str, rows: int, cols: int) -> None:
        s, r = self.par.tp, self.pos.tp
        n = cols // s
        self.b.tensor(name, (rows, n), self.weight_dtype(canonical))
        self.b.piece(canonical, Box((0, r * n), (rows, n)), name, Box((0, 0), (rows, n)))
        if self.fp8(canonical):
            self.scale_columns(name, canonical, rows, n, r, s)

    def vocab(self, name: str, canonical: str) -> None:
        s, r = self.par.tp, self.pos.tp
        n = vllm_padded_vocab(self.a.vocab_size) // s
        self.b.tensor(name, (n, self.a.hidden_size), self.dtype)
        self.b.rows(name, [(0, self.a.vocab_size, canonical, 0)], r * n, (r + 1) * n)

    def dense_mlp(
        self, p: str, hf: str, ffn: int, tp: int | None = None, rank: int | None = None
    ) -> None:
        """``gate_up_proj``/``down_proj`` over ``tp`` ranks (default: the TP group), this
        rank being ``rank`` of them (default: its TP rank mod ``tp``)."""
        s = self.par.tp if tp is None else tp
        r, h = (self.pos.tp % s if rank is None else rank), self.a.hidden_size
        n = ffn // s
        name, gate, up = (
            f"{p}.gate_up_proj.weight",
            f"{hf}.gate_proj.weight",
            f"{hf}.up_proj.weight",
        )
        self.b.tensor(name, (2 * n, h), self.weight_dtype(gate))
        self.b.rows(name, [(0, ffn, gate, 0)], r * n, (r + 1) * n, 0)
        self.b.rows(name, [(0, ffn, up, 0)], r * n, (r + 1) * n, n)
        if self.fp8(gate):  # the gate half is not the last: whole blocks, always
            if n % self.block[0]:
                raise self._refuse(name, "gate rows per rank", n, self.block[0])
            self.scale_rows(name, (2 * n, h), [(0, ffn, gate, 0)], r * n, (r + 1) * n, 0, ffn)
            self.scale_rows(name, (2 * n, h), [(0, ffn, up, 0)], r * n, (r + 1) * n, n, ffn)
        down, hf_down = f"{p}.down_proj.weight", f"{hf}.down_proj.weight"
        self.b.tensor(down, (h, n), self.weight_dtype(hf_down))
        self.b.piece(hf_down, Box((0, r * n), (h, n)), down, Box((0, 0), (h, n)))
        if self.fp8(hf_down):
            self.scale_columns(down, hf_down, h, n, r, s)

    def qkv(self, p: str, suffix: str) -> None:
        a, s, r = self.a, self.par.tp, self.pos.tp
        hd, nq, ng = a.head_dim, a.num_attention_heads, a.num_key_value_heads
        nq_l = nq // s
        if s >= ng:
            kv_heads = [r // (s // ng)]
        else:
            kv_l = ng // s
            kv_heads = list(range(r * kv_l, (r + 1) * kv_l))
        rows = (nq_l + 2 * len(kv_heads)) * hd
        name, q = f"{p}.qkv_proj.{suffix}", f"{p}.q_proj.{suffix}"
        shape = (rows, a.hidden_size) if suffix == "weight" else (rows,)
        self.b.tensor(name, shape, self.weight_dtype(q))
        k0, nk = kv_heads[0] * hd, len(kv_heads) * hd
        segments = [
            (0, nq_l * hd, q, r * nq_l * hd),
            (nq_l * hd, nk, f"{p}.k_proj.{suffix}", k0),
            (nq_l * hd + nk, nk, f"{p}.v_proj.{suffix}", k0),
        ]
        self.b.rows(name, segments, 0, rows)
        if self.fp8(q):  # vLLM's loader takes each shard in whole blocks (q and k not last)
            for what, size in (("query rows per rank", nq_l * hd), ("key rows per rank", nk)):
                if size % self.block[0]:
                    raise self._refuse(name, what, size, self.block[0])
            self.scale_rows(name, (rows, a.hidden_size), segments, 0, rows)

    def attention(self, p: str) -> None:
        a, h = self.a, self.a.hidden_size
        if a.mla is not None:
            self.mla(p)
            return
        self.qkv(p, "weight")
        if a.qkv_bias:
            self.qkv(p, "bias")
        self.row(f"{p}.o_proj.weight", f"{p}.o_proj.weight", h, a.num_attention_heads * a.head_dim)
        if a.qk_norm:
            self.replicated(f"{p}.q_norm.weight", (a.head_dim,))
            self.replicated(f"{p}.k_norm.weight", (a.head_dim,))

    def mla(self, p: str) -> None:
        a, h, nq = self.a, self.a.hidden_size, self.a.num_attention_heads
        m = a.mla
        assert m is not None
        kv_a = m.kv_lora_rank + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            self.column(f"{p}.q_proj.weight", f"{p}.q_proj.weight", nq * m.qk_head_dim, h)
            self.replicated(f"{p}.kv_a_proj_with_mqa.weight", (kv_a, h))
        else:
            # fused_qkv_a_proj = [q_a_proj ; kv_a_proj_with_mqa], replicated (disable_tp).
            name, q_a = f"{p}.{self.fused_qkv_a}.weight", f"{p}.q_a_proj.weight"
            self.b.tensor(name, (m.q_lora_rank + kv_a, h), self.weight_dtype(q_a))
            segments = [
                (0, m.q_lora_rank, q_a, 0),
                (m.q_lora_rank, kv_a, f"{p}.kv_a_proj_with_mqa.weight", 0),
            ]
            self.b.rows(name, segments, 0, m.q_lora_rank + kv_a)
            if self.fp8(q_a):
                rows = m.q_lora_rank + kv_a
                self.scale_rows(name, (rows, h), segments, 0, rows)
            self.replicated(f"{p}.q_a_layernorm.weight", (m.q_lora_rank,))
            self.column(
                f"{p}.q_b_proj.weight", f"{p}.q_b_proj.weight", nq * m.qk_head_dim, m.q_lora_rank
            )
        self.replicated(f"{p}.kv_a_layernorm.weight", (m.kv_lora_rank,))
        self.column(
            f"{p}.kv_b_proj.weight",
            f"{p}.kv_b_proj.weight",
            nq * (m.qk_nope_head_dim + m.v_head_dim),
            m.kv_lora_rank,
        )
        self.row(f"{p}.o_proj.weight", f"{p}.o_proj.weight", h, nq * m.v_head_dim)

    def fused_moe(self, p: str) -> None:
        a, par, pos = self.a, self.par, self.pos
        moe = a.moe
        assert moe is not None
        fe, e_total = moe.expert_intermediate_size, moe.num_experts
        m_size, m_rank = par.moe_size, pos.edp * par.tp + pos.tp
        if par.expert_parallel:
            first, stop = vllm_expert_range(e_total, m_size, m_rank)
            shard, shard_rank = 1, 0
        else:
            first, stop = 0, e_total
            shard, shard_rank = m_size, m_rank
        n = fe // shard
        dtype = self.weight_dtype(f"{p}.experts.{first}.gate_proj.weight")
        experts = [f"{p}.experts.{e}" for e in range(first, stop)]
        self.expert_weights(f"{p}.{self.release.expert_module}", experts, dtype, n, shard_rank * n)

    def expert_weights(self, module: str, experts: list[str], dtype: str, n: int, lo: int) -> None:
        """A FusedMoE's ``w13_weight`` and ``w2_weight`` (and block-FP8 scales) holding the
        local ``experts`` (their checkpoint modules, in slot order), each sliced to the
        intermediate rows ``[lo, lo + n)``. SGLang's FusedMoE holds them alike
        (``layouts/sglang_walk.py``, a fused shared expert among them)."""
        h = self.a.hidden_size
        w13, w2 = f"{module}.w13_weight", f"{module}.w2_weight"
        self.b.tensor(w13, (len(experts), 2 * n, h), dtype)
        self.b.tensor(w2, (len(experts), h, n), dtype)
        if dtype == FP8:
            self.expert_scales(module, experts, n, lo, h)
        # Every expert reads the same canonical boxes: build them once (DeepSeek-V3 at
        # tp=32 has 1.5 million expert pieces per rank set). Slot j < len(experts) and rows
        # [half * n, half * n + n) lie inside (len(experts), 2n, h) by construction.
        gate_up, down = Box((lo, 0), (n, h)), Box((0, lo), (h, n))
        # w13's pieces in expert order, each expert's gate before its up
        halves = (("gate_proj", 0), ("up_proj", n))
        w13_slots = [
            (f"{hf}.{half}.weight", (j, row, 0))
            for j, hf in enumerate(experts)
            for half, row in halves
        ]
        self.b.stacked_pieces(w13, gate_up, w13_slots)
        self.b.stacked_pieces(
            w2, down, [(f"{hf}.down_proj.weight", (j, 0, 0)) for j, hf in enumerate(experts)]
        )

    def mlp(self, layer: int, p: str) -> None:
        a = self.a
        if not a.is_sparse(layer):
            self.dense_mlp(p, p, a.intermediate_size)
            return
        moe = a.moe
        assert moe is not None
        self.replicated(f"{p}.gate.weight", (moe.num_experts, a.hidden_size))
        if moe.router_bias and moe.topk_method == "noaux_tc":
            self.replicated(
                f"{p}.gate.e_score_correction_bias", (moe.num_experts,), dtype="float32"
            )
        self.fused_moe(p)
        if moe.num_shared_experts:
            self.dense_mlp(
                f"{p}.shared_experts",
                f"{p}.shared_experts",
                moe.shared_intermediate_size,
                self.shared_tp,
            )

    def build(self) -> None:
        a, par, pos = self.a, self.par, self.pos
        h = a.hidden_size
        start, end = vllm_pp_indices(a.num_layers, pos.pp, par.pp, self.opts.pp_layer_partition)
        first, last = pos.pp == 0, pos.pp == par.pp - 1
        # Qwen3-MoE builds embed_tokens, norm and lm_head on every stage (qwen3_moe.py);
        # tied Llama/Qwen2/Qwen3 build embed_tokens on the last stage too (lm_head = it).
        everywhere = a.family == "qwen3_moe"
        tied = a.tie_word_embeddings and a.family != "deepseek_v3"
        if first or everywhere or (tied and last):
            self.vocab("model.embed_tokens.weight", "model.embed_tokens.weight")
        for layer in range(start, end):
            self.decoder_layer(layer)
        if last or everywhere:
            self.replicated("model.norm.weight", (h,))
            if not tied:
                self.vocab("lm_head.weight", "lm_head.weight")

    def decoder_layer(self, layer: int) -> None:
        """Decoder layer ``layer``'s parameters, in the order vLLM's (and SGLang's) model
        classes register them."""
        p, h = f"model.layers.{layer}", self.a.hidden_size
        self.replicated(f"{p}.input_layernorm.weight", (h,))
        self.attention(f"{p}.self_attn")
        self.replicated(f"{p}.post_attention_layernorm.weight", (h,))
        self.mlp(layer, f"{p}.mlp")


@paused_gc
def vllm_layout(
    spec: ModelSpec, parallel: InferParallel, rank: int, options: VllmOptions | None = None
) -> RankLayout:
    """The local tensors and canonical pieces of vLLM inference rank ``rank``."""
    opts = options or VllmOptions()
    check_vllm_parallel(spec.arch, parallel, opts)
    walker = VllmRankWalker(spec, parallel, rank, opts)
    walker.build()
    return RankLayout(
        framework="vllm",
        rank=rank,
        world_size=parallel.world_size,
        position=walker.pos.as_dict(),
        replicas=vllm_replicas(spec, parallel, rank, opts),
        tensors=walker.b.build(),
    )


def vllm_layouts(
    spec: ModelSpec, parallel: InferParallel, options: VllmOptions | None = None
) -> list[RankLayout]:
    """Every inference rank's layout. Replicas (:func:`vllm_replicas`) share their
    first member's tensors instead of rebuilding them: the planner then recognises
    them at once, and 8 DeepSeek-V3 replicas cost one replica's memory."""
    opts = options or VllmOptions()
    out: list[RankLayout] = []
    for rank in range(parallel.world_size):
        replicas = vllm_replicas(spec, parallel, rank, opts)
        if replicas[0] == rank:
            out.append(vllm_layout(spec, parallel, rank, opts))
            continue
        out.append(
            RankLayout(
                framework="vllm",
                rank=rank,
                world_size=parallel.world_size,
                position=vllm_position(parallel, rank).as_dict(),
                replicas=replicas,
                tensors=out[replicas[0]].tensors,
            )
        )
    return out
