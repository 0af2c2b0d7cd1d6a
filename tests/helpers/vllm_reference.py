"""An independent, plain-torch vLLM forward pass over per-rank local shards.

Nothing here reads the layout provider's rules: the reference only sees the local
tensors (by vLLM parameter name) of each rank and re-derives vLLM's per-rank sizes
from the HF config and the parallel sizes, as vLLM itself does:

* ``QKVParallelLinear``: ``nq/tp`` query heads, ``max(1, ng/tp)`` KV heads per rank,
  output ``[q | k | v]``; ``o_proj``/``down_proj`` are row-parallel (partial sums
  all-reduced over tp).
* ``MergedColumnParallelLinear`` ``gate_up_proj``: ``[gate ; up]`` halves.
* ``VocabParallelEmbedding``/``ParallelLMHead``: vocabulary padded to a multiple of
  64, rank ``s`` holds ids ``[s·Vp/tp, (s+1)·Vp/tp)``; logits gathered, cut to ``V``.
* ``FusedMoE`` over ``engine_dp·tp`` ranks: tokens of all engine-DP ranks are
  gathered (naive dispatch), each rank adds its experts' (or expert slices')
  contribution, the sum is combined back.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nemo_refit_reshard.layouts.base import RankLayout
from nemo_refit_reshard.spec.parallel import InferParallel

Shards = dict[str, Tensor]
# (replica, engine_dp, pp, tp) -> that rank's local tensors
Grid = dict[tuple[int, int, int, int], Shards]

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def canonical_state_dict(model: torch.nn.Module, tied: bool) -> dict[str, Tensor]:
    """In-memory transformers 5.x state dict -> the on-disk (canonical) tensor names.

    transformers 5 fuses MoE experts (conversion mapping ``qwen2_moe``, used by
    ``qwen3_moe``): ``mlp.experts.gate_up_proj[e] = cat(gate_proj[e], up_proj[e], dim=0)``
    of shape ``[E, 2F, H]`` and ``mlp.experts.down_proj`` ``[E, H, F]``; the checkpoint
    keeps ``mlp.experts.{e}.{gate,up,down}_proj.weight``. A tied ``lm_head`` is not saved.
    """
    out: dict[str, Tensor] = {}
    for name, value in model.state_dict().items():
        value = value.detach().clone()
        m = _EXPERT.match(name)
        if m is None:
            if not (tied and name == "lm_head.weight"):
                out[name] = value
            continue
        prefix, kind = m.groups()
        for e in range(value.shape[0]):
            if kind == "gate_up_proj":
                gate, up = value[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = value[e].clone()
    return out


def materialize(layout: RankLayout, canonical: dict[str, Tensor]) -> Shards:
    """Fill each local tensor from its pieces; padding becomes zero.

    Every local element must be written exactly once (by a piece or as padding):
    the tensors start as NaN and a per-element write counter is checked.
    """
    shards: Shards = {}
    for t in layout.tensors:
        local = torch.full(t.shape, float("nan"), dtype=torch.float32)
        count = torch.zeros(t.shape, dtype=torch.int32)
        for p in t.pieces:
            src = canonical[p.canonical][p.canonical_box.slices()]
            local[p.local_box.slices()] = src.reshape(p.local_box.sizes)
            count[p.local_box.slices()] += 1
        for box in t.padding:
            local[box.slices()] = 0.0
            count[box.slices()] += 1
        assert bool((count == 1).all()), f"rank {layout.rank} {t.name}: elements written != once"
        assert bool(torch.isfinite(local).all()), f"rank {layout.rank} {t.name}: holes"
        shards[t.name] = local
    return shards


def padded_vocab(vocab: int) -> int:
    return -(-vocab // 64) * 64


def linear_expert_map(num_experts: int, ep_size: int, ep_rank: int) -> list[int]:
    """vLLM ``determine_expert_map`` (linear placement): global ids of a rank's experts."""
    base, rem = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, rem)
    return list(range(start, start + base + (1 if ep_rank < rem else 0)))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: Tensor, theta: float) -> Tensor:
    """Neox-style (rotate-half) rotary embedding of ``x`` ``[heads, T, d]``."""
    d, t = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()


class VllmReference:
    """Runs one engine replica of a vLLM deployment from its ranks' local shards."""

    def __init__(self, cfg: dict[str, Any], par: InferParallel, grid: Grid, replica: int = 0):
        self.cfg, self.par, self.grid, self.replica = cfg, par, grid, replica
        self.h = cfg["hidden_size"]
        self.nq = cfg["num_attention_heads"]
        self.ng = cfg.get("num_key_value_heads") or self.nq
        self.hd = cfg.get("head_dim") or self.h // self.nq
        self.eps = cfg["rms_norm_eps"]
        rp = cfg.get("rope_parameters") or {}
        self.theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        self.vocab = cfg["vocab_size"]
        self.tied = bool(cfg.get("tie_word_embeddings"))
        # transformers 5.x saves Qwen3-MoE's num_experts as num_local_experts
        self.num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)

    def ranks(self, edp: int, pp: int) -> list[Shards]:
        return [self.grid[(self.replica, edp, pp, s)] for s in range(self.par.tp)]

    def stage_layers(self, pp: int) -> list[int]:
        """Layers this stage holds, read from its parameter names (global layer index)."""
        found = {
            int(m.group(1))
            for n in self.grid[(self.replica, 0, pp, 0)]
            if (m := re.match(r"model\.layers\.(\d+)\.", n))
        }
        return sorted(found)

    def is_moe(self, layer: int) -> bool:
        step = self.cfg.get("decoder_sparse_step") or 1
        dense = self.cfg.get("mlp_only_layers") or []
        return self.num_experts > 0 and layer not in dense and (layer + 1) % step == 0

    # --- vocabulary -------------------------------------------------------------------
    def embed(self, ids: Tensor, ranks: list[Shards]) -> Tensor:
        per = padded_vocab(self.vocab) // self.par.tp
        out = torch.zeros(ids.shape[0], self.h)
        for s, shards in enumerate(ranks):
            w = shards["model.embed_tokens.weight"]
            assert w.shape == (per, self.h), w.shape
            mask = (ids >= s * per) & (ids < (s + 1) * per)
            local = F.embedding((ids - s * per) * mask, w)
            out = out + local * mask[:, None]
        return out

    def lm_head(self, hidden: Tensor, ranks: list[Shards]) -> Tensor:
        name = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        per = padded_vocab(self.vocab) // self.par.tp
        parts = []
        for shards in ranks:
            x = rms_norm(hidden, shards["model.norm.weight"], self.eps)
            parts.append(x @ shards[name].T)
        assert all(p.shape[-1] == per for p in parts)
        return torch.cat(parts, dim=-1)[:, : self.vocab]  # gather over tp, cut padding

    # --- attention --------------------------------------------------------------------
    def attention(self, hidden: Tensor, layer: str, ranks: list[Shards]) -> Tensor:
        tp, hd, t, p = self.par.tp, self.hd, hidden.shape[0], f"{layer}.self_attn"
        nq_l, nkv_l = self.nq // tp, max(1, self.ng // tp)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        out = torch.zeros_like(hidden)
        for shards in ranks:
            x = rms_norm(hidden, shards[f"{layer}.input_layernorm.weight"], self.eps)
            w = shards[f"{p}.qkv_proj.weight"]
            assert w.shape == ((nq_l + 2 * nkv_l) * hd, self.h), w.shape
            qkv = x @ w.T
            if f"{p}.qkv_proj.bias" in shards:
                qkv = qkv + shards[f"{p}.qkv_proj.bias"]
            q, k, v = qkv.split([nq_l * hd, nkv_l * hd, nkv_l * hd], dim=-1)
            q = q.view(t, nq_l, hd).transpose(0, 1)
            k = k.view(t, nkv_l, hd).transpose(0, 1)
            v = v.view(t, nkv_l, hd).transpose(0, 1)
            if f"{p}.q_norm.weight" in shards:
                q = rms_norm(q, shards[f"{p}.q_norm.weight"], self.eps)
                k = rms_norm(k, shards[f"{p}.k_norm.weight"], self.eps)
            q, k = rope(q, self.theta), rope(k, self.theta)
            k = k.repeat_interleave(nq_l // nkv_l, dim=0)
            v = v.repeat_interleave(nq_l // nkv_l, dim=0)
            scores = (q @ k.transpose(1, 2)) * hd**-0.5
            scores = scores.masked_fill(~causal, float("-inf"))
            attn = scores.softmax(dim=-1) @ v  # [nq_l, T, hd]
            attn = attn.transpose(0, 1).reshape(t, nq_l * hd)
            out = out + attn @ shards[f"{p}.o_proj.weight"].T  # all-reduce over tp
        return out

    # --- MLPs -------------------------------------------------------------------------
    def dense_mlp(self, hidden: Tensor, layer: str, ranks: list[Shards]) -> Tensor:
        out = torch.zeros_like(hidden)
        p = f"{layer}.mlp"
        for shards in ranks:
            x = rms_norm(hidden, shards[f"{layer}.post_attention_layernorm.weight"], self.eps)
            gate, up = (x @ shards[f"{p}.gate_up_proj.weight"].T).chunk(2, dim=-1)
            out = out + (F.silu(gate) * up) @ shards[f"{p}.down_proj.weight"].T  # all-reduce
        return out

    def fused_moe(self, hidden: list[Tensor], layer: str, pp: int) -> Tensor:
        """Each moe rank gathers the tokens of all engine-DP ranks (each normed by the
        rank with its tp index), routes them itself and adds its experts' share."""
        par, cfg, p = self.par, self.cfg, f"{layer}.mlp"
        fe, m_size = cfg["moe_intermediate_size"], par.moe_size
        out = torch.zeros(sum(x.shape[0] for x in hidden), self.h)
        for edp in range(par.engine_dp):
            for s in range(par.tp):
                shards, m = self.grid[(self.replica, edp, pp, s)], edp * par.tp + s
                x = torch.cat(
                    [
                        rms_norm(
                            hidden[d],
                            self.grid[(self.replica, d, pp, s)][
                                f"{layer}.post_attention_layernorm.weight"
                            ],
                            self.eps,
                        )
                        for d in range(par.engine_dp)
                    ]
                )
                probs = (x @ shards[f"{p}.gate.weight"].T).softmax(dim=-1, dtype=torch.float32)
                weights, chosen = probs.topk(cfg["num_experts_per_tok"], dim=-1)
                if cfg.get("norm_topk_prob"):
                    weights = weights / weights.sum(dim=-1, keepdim=True)
                if par.expert_parallel:
                    experts, n = linear_expert_map(self.num_experts, m_size, m), fe
                else:
                    experts, n = list(range(self.num_experts)), fe // m_size
                w13 = shards[f"{p}.experts.routed_experts.w13_weight"]
                w2 = shards[f"{p}.experts.routed_experts.w2_weight"]
                assert w13.shape == (len(experts), 2 * n, self.h), w13.shape
                assert w2.shape == (len(experts), self.h, n), w2.shape
                for j, e in enumerate(experts):
                    tok, slot = (chosen == e).nonzero(as_tuple=True)
                    if tok.numel() == 0:
                        continue
                    gate, up = (x[tok] @ w13[j].T).chunk(2, dim=-1)
                    y = (F.silu(gate) * up) @ w2[j].T
                    out.index_add_(0, tok, y * weights[tok, slot, None])
        return out

    # --- the whole model --------------------------------------------------------------
    def forward(self, input_ids: Tensor) -> Tensor:
        """``input_ids`` ``[engine_dp, T]``: engine-DP rank ``d`` serves row ``d``.

        Stages run in order; each runs the layers its ranks hold."""
        par, dps = self.par, range(self.par.engine_dp)
        assert input_ids.shape[0] == par.engine_dp
        hidden = [self.embed(input_ids[d], self.ranks(d, 0)) for d in dps]
        seen: list[int] = []
        for pp in range(par.pp):
            for layer in self.stage_layers(pp):
                seen.append(layer)
                lp = f"model.layers.{layer}"
                hidden = [
                    h + self.attention(h, lp, self.ranks(d, pp)) for d, h in enumerate(hidden)
                ]
                if self.is_moe(layer):
                    ys = self.fused_moe(hidden, lp, pp).split([h.shape[0] for h in hidden])
                else:
                    ys = [self.dense_mlp(h, lp, self.ranks(d, pp)) for d, h in enumerate(hidden)]
                hidden = [h + y for h, y in zip(hidden, ys)]
        assert seen == list(range(self.cfg["num_hidden_layers"])), seen
        return torch.stack([self.lm_head(hidden[d], self.ranks(d, par.pp - 1)) for d in dps])


def case_id(case: tuple[str, Any]) -> str:
    """pytest id of a ``(model name, InferParallel)`` case: the non-default sizes."""
    name, par = case
    keys = ",".join(
        f"{f.name}{getattr(par, f.name)}"
        for f in dataclasses.fields(par)
        if getattr(par, f.name) != 1
    )
    return f"{name}-{keys or 'single'}"
