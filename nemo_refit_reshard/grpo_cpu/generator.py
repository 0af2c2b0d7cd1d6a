"""A vLLM-layout generator for the GRPO example: batched sampling in plain torch.

Each worker holds exactly the local tensors ``vllm_layout`` gives its inference rank
(``qkv_proj``, ``gate_up_proj``, padded vocabulary, replicated KV heads, FusedMoE
``w13_weight``/``w2_weight``) and runs vLLM's tensor-parallel forward over them:

* ``VocabParallelEmbedding``: a rank looks up the ids of its vocabulary shard, the
  partial embeddings are all-reduced (sum) over the tp group.
* ``QKVParallelLinear``: ``nq/tp`` query heads and ``max(1, ng/tp)`` KV heads per rank;
  ``o_proj`` and ``down_proj`` are row-parallel, their partial sums all-reduced.
* ``FusedMoE`` (engine_dp = 1): every tp rank routes all tokens itself (the router is
  replicated) and adds its experts' share — whole experts with expert parallel, an
  ``Fe/tp`` slice of every expert without; the sum is all-reduced.
* ``ParallelLMHead``: vocab-parallel logits all-gathered, the padded ids cut off.

Generation prefills the prompt once into a KV cache, then feeds one token per step.

**TP sampling agreement**: tp rank 0 alone samples (with the ``torch.Generator`` it is
given) and broadcasts the token ids over the tp group; the other ranks never touch
their generator. Every rank then computes the log-probabilities from the same
all-gathered logits, so all ranks of an engine return identical tokens.

The per-rank math is the one ``tests/helpers/vllm_reference.py`` verifies against HF logits
(there all ranks run in one process and the collectives are explicit sums).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..layouts.base import RankLayout
from ..layouts.vllm import vllm_layout, vllm_padded_vocab
from ..layouts.vllm_grid import vllm_expert_range, vllm_position
from ..layouts.vllm_releases import VllmOptions
from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")

# Per decoder layer: (keys, values), each [B, kv heads of this rank, max positions, head_dim].
KvCache = list[tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class ForwardConfig:
    """Forward-pass constants that decide no tensor shape (so ``spec.arch`` lacks them).

    The defaults are transformers' config defaults for Llama/Qwen2/Qwen3; a MoE model
    needs ``num_experts_per_tok`` (no sensible default). Prefer :meth:`from_hf_config`.
    """

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_experts_per_tok: int | None = None
    norm_topk_prob: bool = False

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ForwardConfig:
        """Read a HuggingFace ``config.json`` dict (transformers 4.x or 5.x keys).

        Anything this forward does not implement (scaled RoPE, sliding windows, an
        activation other than SiLU) is refused rather than silently computed wrong."""
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
        if rope_type not in (None, "default"):
            raise ValueError(
                f"rope_type={rope_type!r} is not supported by VllmLayoutGenerator (only plain "
                "RoPE); use a model config without RoPE scaling"
            )
        if cfg.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported by VllmLayoutGenerator")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
        top_k = cfg.get("num_experts_per_tok")
        return cls(
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            num_experts_per_tok=int(top_k) if top_k is not None else None,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as vLLM and HF do."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rope(x: Tensor, theta: float, positions: Tensor) -> Tensor:
    """Neox-style (rotate-half) rotary embedding of ``x`` ``[..., T, d]`` at ``positions`` [T].

    Absolute positions (not ``arange(T)``) so a decode step rotates its single token
    by where it sits in the sequence."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(positions.to(torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * emb.cos().to(x.dtype) + rotated * emb.sin().to(x.dtype)


def _check_supported(spec: ModelSpec, infer: InferParallel) -> None:
    a = spec.arch
    if infer.pp > 1:
        raise ValueError(
            f"inference pp={infer.pp}: VllmLayoutGenerator runs the whole model on every tp "
            "rank and has no pipeline stages; use pp=1 for the generator (raise tp or dp "
            "instead)"
        )
    if a.family not in _FAMILIES or a.mla is not None:
        raise ValueError(
            f"model family {a.family!r} is not supported by VllmLayoutGenerator; supported: "
            f"{', '.join(_FAMILIES)} (MLA / DeepSeek-V3 is not implemented)"
        )
    if a.moe is not None and infer.engine_dp > 1:
        raise ValueError(
            f"engine_dp={infer.engine_dp} with a MoE model: vLLM spreads the experts over "
            "engine_dp·tp ranks, but VllmLayoutGenerator only has the tp group; use "
            "engine_dp=1 (independent engines are dp=)"
        )


class VllmLayoutGenerator:
    """Batched sampling over one inference rank's vLLM-layout local tensors."""

    def __init__(
        self,
        spec: ModelSpec,
        infer: InferParallel,
        rank: int,
        tp_group: dist.ProcessGroup | None,
        dtype: torch.dtype = torch.float32,
        *,
        config: ForwardConfig | None = None,
    ) -> None:
        """``rank`` = this worker's inference rank (vLLM numbering, ``vllm_position``);
        ``tp_group`` = the gloo group of the tp ranks of this rank's engine, in tp order
        (``None`` when ``infer.tp == 1``). ``config``: eps, RoPE theta and MoE routing,
        which ``spec.arch`` does not carry (default :class:`ForwardConfig`).

        Allocates its local tensors from ``vllm_layout(...)`` for this rank (zeros; a
        refit fills them)."""
        _check_supported(spec, infer)
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype {dtype} not supported; use one of {list(_DTYPE_NAMES)}")
        a = spec.arch
        self.spec, self.infer, self.rank, self.dtype = spec, infer, rank, dtype
        self.config = config or ForwardConfig()
        self._pos = vllm_position(infer, rank)
        self._tp, self._tp_rank = infer.tp, self._pos.tp
        self._group = self._checked_group(tp_group)
        options = VllmOptions(params_dtype=_DTYPE_NAMES[dtype])
        self._layout = vllm_layout(spec, infer, rank, options)
        self._expert_module = options.release.expert_module
        # The only storage the forward reads: refit writes into these tensors in place.
        self._tensors = {t.name: torch.zeros(t.shape, dtype=dtype) for t in self._layout.tensors}

        self._hd = a.head_dim
        self._nq = a.num_attention_heads // self._tp
        self._nkv = max(1, a.num_key_value_heads // self._tp)  # one replicated head if tp >= ng
        self._vocab = a.vocab_size
        self._vocab_per_rank = vllm_padded_vocab(a.vocab_size) // self._tp
        self._lm_head = "model.embed_tokens.weight" if a.tie_word_embeddings else "lm_head.weight"
        self._layers = [(f"model.layers.{i}", a.is_sparse(i)) for i in range(a.num_layers)]
        self._experts: list[int] = []
        self._top_k = 0
        if a.moe is not None:
            top_k = self.config.num_experts_per_tok
            if top_k is None or not 1 <= top_k <= a.moe.num_experts:
                raise ValueError(
                    f"{a.family} needs ForwardConfig.num_experts_per_tok in "
                    f"[1, {a.moe.num_experts}], got {top_k}; pass "
                    "config=ForwardConfig.from_hf_config(hf_config)"
                )
            self._top_k = top_k
            if infer.expert_parallel:  # engine_dp == 1, so the moe ranks are the tp ranks
                self._experts = list(
                    range(*vllm_expert_range(a.moe.num_experts, infer.ep, self._tp_rank))
                )
            else:
                self._experts = list(range(a.moe.num_experts))
        qkv = self._tensors["model.layers.0.self_attn.qkv_proj.weight"]
        if qkv.shape[0] != (self._nq + 2 * self._nkv) * self._hd:  # layout and forward disagree
            raise RuntimeError(f"qkv_proj rows {qkv.shape[0]} do not match the per-rank heads")

    def _checked_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        if group is None:
            if self._tp > 1:
                raise ValueError(f"tp={self._tp} needs a tp_group (the tp ranks of this engine)")
            return None
        size, me = dist.get_world_size(group), dist.get_rank(group)
        if size != self._tp or me != self._tp_rank:
            raise ValueError(
                f"tp_group has size {size} and this process is its rank {me}, but inference "
                f"rank {self.rank} is tp rank {self._tp_rank} of tp={self._tp}; build the "
                "group from the engine's ranks in tp order"
            )
        return group if size > 1 else None

    @property
    def layout(self) -> RankLayout:
        """The vLLM layout of this rank (what a refit plan's destination must be)."""
        return self._layout

    def local_tensors(self) -> dict[str, Tensor]:
        """The vLLM-layout local tensors by layout name; refit writes into them in place."""
        return dict(self._tensors)

    # --- collectives (no-ops at tp = 1) ---------------------------------------------------
    def _all_reduce(self, x: Tensor) -> Tensor:
        if self._group is not None:
            dist.all_reduce(x, group=self._group)
        return x

    def _all_gather_vocab(self, local: Tensor) -> Tensor:
        if self._group is None:
            return local
        parts = [torch.empty_like(local) for _ in range(self._tp)]
        dist.all_gather(parts, local.contiguous(), group=self._group)
        return torch.cat(parts, dim=-1)

    # --- layers ---------------------------------------------------------------------------
    def _embed(self, ids: Tensor) -> Tensor:
        lo = self._tp_rank * self._vocab_per_rank
        mine = (ids >= lo) & (ids < lo + self._vocab_per_rank)
        table = self._tensors["model.embed_tokens.weight"]
        local = F.embedding(torch.where(mine, ids - lo, 0), table)
        return self._all_reduce(local * mine[..., None].to(local.dtype))

    def _attention(
        self, h: Tensor, p: str, positions: Tensor, cache: tuple[Tensor, Tensor] | None
    ) -> Tensor:
        w, eps, hd = self._tensors, self.config.rms_norm_eps, self._hd
        b, t = h.shape[:2]
        a = f"{p}.self_attn"
        x = rms_norm(h, w[f"{p}.input_layernorm.weight"], eps)
        qkv = x @ w[f"{a}.qkv_proj.weight"].T
        if f"{a}.qkv_proj.bias" in w:
            qkv = qkv + w[f"{a}.qkv_proj.bias"]
        q, k, v = qkv.split([self._nq * hd, self._nkv * hd, self._nkv * hd], dim=-1)
        q = q.view(b, t, self._nq, hd).transpose(1, 2)  # [B, heads, T, hd]
        k = k.view(b, t, self._nkv, hd).transpose(1, 2)
        v = v.view(b, t, self._nkv, hd).transpose(1, 2)
        if f"{a}.q_norm.weight" in w:  # Qwen3: per-head RMSNorm before RoPE
            q = rms_norm(q, w[f"{a}.q_norm.weight"], eps)
            k = rms_norm(k, w[f"{a}.k_norm.weight"], eps)
        q = rope(q, self.config.rope_theta, positions)
        k = rope(k, self.config.rope_theta, positions)
        end = int(positions[-1]) + 1
        if cache is not None:
            ck, cv = cache
            ck[:, :, end - t : end] = k
            cv[:, :, end - t : end] = v
            k, v = ck[:, :, :end], cv[:, :, :end]
        k = k.repeat_interleave(self._nq // self._nkv, dim=1)
        v = v.repeat_interleave(self._nq // self._nkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) * hd**-0.5  # [B, heads, T, end]
        causal = torch.arange(end)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, self._nq * hd)
        return self._all_reduce(out @ w[f"{a}.o_proj.weight"].T)  # row-parallel

    def _dense_mlp(self, h: Tensor, p: str) -> Tensor:
        w = self._tensors
        x = rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], self.config.rms_norm_eps)
        gate, up = (x @ w[f"{p}.mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        return self._all_reduce((F.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].T)

    def _moe(self, h: Tensor, p: str) -> Tensor:
        w, m = self._tensors, f"{p}.mlp"
        x = rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], self.config.rms_norm_eps)
        x = x.reshape(-1, x.shape[-1])
        # Router in float32 (vLLM and HF softmax the router logits in float32).
        probs = (x @ w[f"{m}.gate.weight"].T).softmax(dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self._top_k, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        experts = f"{m}.{self._expert_module}"
        w13, w2 = w[f"{experts}.w13_weight"], w[f"{experts}.w2_weight"]
        out = torch.zeros_like(x)
        for j, e in enumerate(self._experts):
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            gate, up = (x[tok] @ w13[j].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ w2[j].T
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return self._all_reduce(out).view_as(h)

    def _logits(self, h: Tensor) -> Tensor:
        w = self._tensors
        x = rms_norm(h, w["model.norm.weight"], self.config.rms_norm_eps)
        full = self._all_gather_vocab(x @ w[self._lm_head].T)
        return full[..., : self._vocab].float()  # padded ids are never logits

    def _forward(self, ids: Tensor, start: int, cache: KvCache | None, last_only: bool) -> Tensor:
        positions = torch.arange(start, start + ids.shape[1])
        h = self._embed(ids)
        for i, (p, sparse) in enumerate(self._layers):
            h = h + self._attention(h, p, positions, None if cache is None else cache[i])
            h = h + (self._moe(h, p) if sparse else self._dense_mlp(h, p))
        return self._logits(h[:, -1] if last_only else h)

    # --- public ---------------------------------------------------------------------------
    def _check_ids(self, ids: Tensor) -> None:
        if ids.dim() != 2 or ids.dtype != torch.int64 or ids.shape[1] == 0:
            raise ValueError(
                f"token ids must be a non-empty int64 [B, T] tensor, got "
                f"{ids.dtype} {tuple(ids.shape)}"
            )
        if ids.numel() and not bool(((ids >= 0) & (ids < self._vocab)).all()):
            raise ValueError(f"token ids must lie in [0, vocab_size={self._vocab})")

    @torch.no_grad()
    def forward_logits(self, ids: Tensor) -> Tensor:
        """Float32 logits ``[B, T, V]`` (real vocabulary) of one no-cache forward pass.

        Collective over the tp group, like :meth:`generate`."""
        self._check_ids(ids)
        return self._forward(ids, 0, None, last_only=False)

    def _sample(self, logits: Tensor, temperature: float, gen: torch.Generator | None) -> Tensor:
        if self._tp_rank == 0:
            if temperature == 0.0:
                tok = logits.argmax(dim=-1)
            else:
                # vLLM's random sampler: argmax(p / q), q ~ Exp(1), picks i with probability p_i.
                probs = (logits / temperature).softmax(dim=-1)
                q = torch.empty_like(probs).exponential_(generator=gen)
                tok = (probs / q).argmax(dim=-1)
        else:
            tok = torch.empty(logits.shape[0], dtype=torch.int64)
        if self._group is not None:
            dist.broadcast(tok, group=self._group, group_src=0)
        return tok

    @torch.no_grad()
    def generate(
        self,
        prompts: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Sample ``max_new_tokens`` after ``prompts`` (int64 ``[B, P]``, no padding).

        Returns ``(tokens [B, N] int64, logprobs [B, N] float32)``: the log-probabilities
        of the sampled tokens under the temperature-1 policy (log_softmax of the real-vocab
        logits), i.e. what the trainer must reproduce. ``temperature`` only shapes the
        sampling; ``temperature=0.0`` is greedy (argmax). Only tp rank 0 draws from
        ``generator`` and broadcasts the tokens, so every tp rank returns the same tokens.
        Collective: every tp rank of the engine calls it with the same arguments."""
        self._check_ids(prompts)
        if not temperature >= 0.0 or temperature == float("inf"):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        b, p = prompts.shape
        shape = (b, self._nkv, p + max_new_tokens, self._hd)
        cache = [
            (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
            for _ in self._layers
        ]
        tokens = torch.empty(b, max_new_tokens, dtype=torch.int64)
        logprobs = torch.empty(b, max_new_tokens, dtype=torch.float32)
        if max_new_tokens == 0:
            return tokens, logprobs
        logits = self._forward(prompts, 0, cache, last_only=True)  # prefill
        for i in range(max_new_tokens):
            tok = self._sample(logits, temperature, generator)
            tokens[:, i] = tok
            logprobs[:, i] = logits.log_softmax(dim=-1).gather(-1, tok[:, None])[:, 0]
            if i + 1 < max_new_tokens:
                logits = self._forward(tok[:, None], p + i, cache, last_only=True)
        return tokens, logprobs
