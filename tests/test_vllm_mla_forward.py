"""The vLLM layout for DeepSeek-V3 (MLA + MoE with shared experts), proven against HF.

A tiny random float32 ``DeepseekV3ForCausalLM`` gives the canonical (on-disk) tensors;
each vLLM rank's local tensors are filled from ``vllm_layout`` pieces alone, and an
independent plain-torch forward that reads only those local shards, with vLLM's
``DeepseekV2`` semantics, must reproduce the HF logits:

* ``fused_qkv_a_proj`` = ``[q_a_proj ; kv_a_proj_with_mqa]`` rows, replicated;
  ``q_a_layernorm``/``kv_a_layernorm`` replicated.
* ``q_b_proj``/``kv_b_proj`` column-parallel (the rank's ``nq/tp`` heads, per head
  ``[q_nope | q_pe]`` and ``[k_nope | v]``); ``o_proj`` row-parallel (partials summed).
* RoPE on the ``qk_rope_head_dim`` parts GPT-J style (``is_neox_style=False``): the
  checkpoint's rope dims are interleaved pairs. transformers' ``rope_interleave=True``
  de-interleaves q and k the same way before rotating, which leaves ``q·k`` unchanged.
* softmax scale ``qk_head_dim**-0.5`` (no yarn mscale: the tiny config has default rope).
* router: ``gate.weight`` and ``gate.e_score_correction_bias`` replicated; sigmoid scores,
  bias only for selection, group-limited top-k, ``norm_topk_prob``,
  ``routed_scaling_factor``; FusedMoE ``w13_weight[j] = [gate ; up]`` slices / whole
  experts, ``w2_weight``; shared experts ``gate_up_proj``/``down_proj`` tp-sharded, or
  whole on every rank under sequence-parallel MoE (expert parallel, tp > 1, engine_dp > 1).
* the first ``first_k_dense_replace`` layers are dense; vocab padded to 64, vocab-parallel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from nemo_refit_reshard.layouts import LocalTensor, RankLayout, vllm_layout
from nemo_refit_reshard.spec import InferParallel, spec_from_hf_config
from tests.helpers.hf_models import HfModel, checkpoint_state_dict, hf_config_dict, tiny_hf_model
from tests.helpers.vllm_reference import (
    Grid,
    Shards,
    VllmReference,
    case_id,
    linear_expert_map,
    materialize,
    rms_norm,
)

transformers = pytest.importorskip("transformers")

Corruption = Callable[[list[RankLayout], InferParallel], list[RankLayout]]

# "grouped": 2 groups of 2 experts, tokens restricted to the best group, no top-k renorm.
VARIANTS: dict[str, dict[str, Any]] = {
    "ds": {},
    "ds_grouped": dict(n_group=2, topk_group=1, norm_topk_prob=False),
}


@functools.cache
def model(name: str) -> HfModel:
    hf = tiny_hf_model("deepseek_v3", seed=1234, **VARIANTS[name])
    # Unit-scale signals, non-trivial norms and a router bias that changes the selection
    # (HF initialises with std 0.02, norms to 1 and the correction bias to 0).
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for pname, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=g)
            if pname.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in pname:
                param.copy_(0.5 * noise)
            else:
                param.copy_(noise * param.shape[-1] ** -0.5)
        for bname, buf in hf.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                buf.copy_(0.2 * torch.randn(buf.shape, generator=g))
    cfg = hf_config_dict(hf)
    # HF always applies the correction bias; vLLM builds it only for an explicit noaux_tc.
    cfg["topk_method"] = "noaux_tc"
    assert cfg["rope_interleave"] and cfg["rope_parameters"]["rope_type"] == "default"
    spec = spec_from_hf_config(cfg, name=name)
    return HfModel(hf, cfg, spec, checkpoint_state_dict(hf))


def rope_gptj(x: Tensor, theta: float) -> Tensor:
    """GPT-J (interleaved-pair) rotary embedding of ``x`` ``[..., T, d]``: vLLM's
    ``get_rope(..., is_neox_style=False)`` used by DeepSeek MLA."""
    d, t = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class MlaReference(VllmReference):
    """vLLM ``DeepseekV2ForCausalLM`` over local shards; embed/lm_head/pipeline reused."""

    def __init__(self, cfg: dict[str, Any], par: InferParallel, grid: Grid, replica: int = 0):
        super().__init__(cfg, par, grid, replica)
        self.num_experts = int(cfg["n_routed_experts"])
        self.nope, self.rope_d = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        self.vd, self.q_lora, self.kv_lora = (
            cfg["v_head_dim"],
            cfg["q_lora_rank"],
            cfg["kv_lora_rank"],
        )
        self.scale = (self.nope + self.rope_d) ** -0.5  # default rope: no yarn mscale

    def is_moe(self, layer: int) -> bool:
        return layer >= self.cfg["first_k_dense_replace"]

    def attention(self, hidden: Tensor, layer: str, ranks: list[Shards]) -> Tensor:
        t, p, nq_l = hidden.shape[0], f"{layer}.self_attn", self.nq // self.par.tp
        qk = self.nope + self.rope_d
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        out = torch.zeros_like(hidden)
        for shards in ranks:
            x = rms_norm(hidden, shards[f"{layer}.input_layernorm.weight"], self.eps)
            w_a = shards[f"{p}.fused_qkv_a_proj.weight"]
            assert w_a.shape == (self.q_lora + self.kv_lora + self.rope_d, self.h), w_a.shape
            q_c, kv_c, k_pe = (x @ w_a.T).split([self.q_lora, self.kv_lora, self.rope_d], -1)
            q_c = rms_norm(q_c, shards[f"{p}.q_a_layernorm.weight"], self.eps)
            w_qb = shards[f"{p}.q_b_proj.weight"]
            assert w_qb.shape == (nq_l * qk, self.q_lora), w_qb.shape
            q = (q_c @ w_qb.T).view(t, nq_l, qk).transpose(0, 1)  # [nq_l, T, qk]
            q_nope, q_pe = q.split([self.nope, self.rope_d], dim=-1)
            kv_c = rms_norm(kv_c, shards[f"{p}.kv_a_layernorm.weight"], self.eps)
            w_kvb = shards[f"{p}.kv_b_proj.weight"]
            assert w_kvb.shape == (nq_l * (self.nope + self.vd), self.kv_lora), w_kvb.shape
            kv = (kv_c @ w_kvb.T).view(t, nq_l, self.nope + self.vd).transpose(0, 1)
            k_nope, v = kv.split([self.nope, self.vd], dim=-1)
            q_pe, k_pe = rope_gptj(q_pe, self.theta), rope_gptj(k_pe, self.theta)
            q = torch.cat([q_nope, q_pe], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(nq_l, t, self.rope_d)], dim=-1)
            scores = (q @ k.transpose(1, 2)) * self.scale
            scores = scores.masked_fill(~causal, float("-inf"))
            attn = (scores.softmax(dim=-1) @ v).transpose(0, 1).reshape(t, nq_l * self.vd)
            out = out + attn @ shards[f"{p}.o_proj.weight"].T  # all-reduce over tp
        return out

    def route(self, x: Tensor, shards: Shards, p: str) -> tuple[Tensor, Tensor]:
        """vLLM ``grouped_topk`` (sigmoid scoring with ``e_score_correction_bias``)."""
        cfg, e = self.cfg, self.num_experts
        scores = (x @ shards[f"{p}.gate.weight"].T).sigmoid()
        choice = scores + shards[f"{p}.gate.e_score_correction_bias"]
        groups = choice.view(-1, cfg["n_group"], e // cfg["n_group"])
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(cfg["topk_group"], dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // cfg["n_group"], dim=1), -math.inf)
        chosen = choice.topk(cfg["num_experts_per_tok"], dim=-1).indices
        weights = scores.gather(1, chosen)
        if cfg["norm_topk_prob"]:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * cfg["routed_scaling_factor"], chosen

    def fused_moe(self, hidden: list[Tensor], layer: str, pp: int) -> Tensor:
        """Routed experts over the ``engine_dp·tp`` moe ranks (tokens of all engine-DP
        ranks gathered), plus each engine-DP rank's tp-sharded shared experts."""
        par, p, fe = self.par, f"{layer}.mlp", self.cfg["moe_intermediate_size"]
        post = f"{layer}.post_attention_layernorm.weight"
        out = torch.zeros(sum(x.shape[0] for x in hidden), self.h)
        for edp in range(par.engine_dp):
            for s in range(par.tp):
                shards, m = self.grid[(self.replica, edp, pp, s)], edp * par.tp + s
                grid = [self.grid[(self.replica, d, pp, s)] for d in range(par.engine_dp)]
                x = torch.cat([rms_norm(h, g[post], self.eps) for h, g in zip(hidden, grid)])
                weights, chosen = self.route(x, shards, p)
                if par.expert_parallel:
                    experts, n = linear_expert_map(self.num_experts, par.moe_size, m), fe
                else:
                    experts, n = list(range(self.num_experts)), fe // par.moe_size
                w13 = shards[f"{p}.experts.routed_experts.w13_weight"]
                w2 = shards[f"{p}.experts.routed_experts.w2_weight"]
                assert w13.shape == (len(experts), 2 * n, self.h), w13.shape
                assert w2.shape == (len(experts), self.h, n), w2.shape
                for j, e in enumerate(experts):
                    tok, slot = (chosen == e).nonzero(as_tuple=True)
                    gate, up = (x[tok] @ w13[j].T).chunk(2, dim=-1)
                    y = (F.silu(gate) * up) @ w2[j].T
                    out.index_add_(0, tok, y * weights[tok, slot, None])
        # vLLM's sequence-parallel MoE (EP, tp > 1, engine_dp > 1, default all2all backend)
        # builds the shared experts whole on every rank: one rank computes them.
        sequence_parallel = par.expert_parallel and par.tp > 1 and par.engine_dp > 1
        shared = []
        for d, h in enumerate(hidden):
            y = torch.zeros_like(h)
            for shards in self.ranks(d, pp)[: 1 if sequence_parallel else None]:
                x = rms_norm(h, shards[post], self.eps)
                gate, up = (x @ shards[f"{p}.shared_experts.gate_up_proj.weight"].T).chunk(2, -1)
                y = y + (F.silu(gate) * up) @ shards[f"{p}.shared_experts.down_proj.weight"].T
            shared.append(y)
        return out + torch.cat(shared)


def input_ids(rows: int, t: int = 10) -> Tensor:
    """Ids at every tp shard boundary of the padded vocabulary (128), plus the last id."""
    g = torch.Generator().manual_seed(7)
    edge = torch.tensor([99, 0, 31, 32, 63, 64, 95, 96])
    out = [
        torch.cat(
            [edge[torch.randperm(8, generator=g)], torch.randint(0, 100, (t - 8,), generator=g)]
        )
        for _ in range(rows)
    ]
    return torch.stack(out)


def run(name: str, par: InferParallel, corrupt: Corruption | None = None) -> tuple[Tensor, Tensor]:
    m = model(name)
    layouts = [vllm_layout(m.spec, par, r) for r in range(par.world_size)]
    if corrupt is not None:
        layouts = corrupt(layouts, par)
    grid: Grid = {}
    for lay in layouts:
        pos = lay.position
        grid[(pos["dp"], pos["engine_dp"], pos["pp"], pos["tp"])] = materialize(lay, m.canonical)
    ids = input_ids(par.engine_dp)
    ref = MlaReference(m.cfg, par, grid).forward(ids)
    with torch.no_grad():
        want = m.hf(ids).logits
    return ref, want


def test_checkpoint_names_match_spec() -> None:
    m = model("ds")
    assert {k: tuple(v.shape) for k, v in m.canonical.items()} == {
        t.name: t.shape for t in m.spec.tensors
    }
    assert m.canonical["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0


def test_reference_routing_matches_hf_router() -> None:
    """The router alone: bias-only selection, groups and weights agree with HF's."""
    for name in VARIANTS:
        m = model(name)
        gate = m.hf.model.layers[1].mlp.gate
        x = torch.randn(64, m.cfg["hidden_size"], generator=torch.Generator().manual_seed(3))
        shards = {
            "p.gate.weight": gate.weight.detach(),
            "p.gate.e_score_correction_bias": gate.e_score_correction_bias,
        }
        ref_w, ref_i = MlaReference(m.cfg, InferParallel(), {}).route(x, shards, "p")
        with torch.no_grad():
            _, hf_w, hf_i = gate(x)
        order_ref, order_hf = ref_i.sort(dim=-1), hf_i.sort(dim=-1)
        assert torch.equal(order_ref.values, order_hf.values), name
        ref_w, hf_w = ref_w.gather(1, order_ref.indices), hf_w.gather(1, order_hf.indices)
        torch.testing.assert_close(ref_w, hf_w, atol=1e-6, rtol=1e-6)


P = InferParallel
CASES: list[tuple[str, InferParallel]] = [
    ("ds", P()),
    ("ds", P(tp=2)),
    ("ds", P(tp=4)),  # one head per rank; vocab rows 100..127 are padding on rank 3
    ("ds", P(tp=2, ep=2)),  # two whole experts per rank
    ("ds", P(tp=4, ep=4)),
    ("ds", P(tp=2, engine_dp=2)),  # experts sliced Fe/4 over 4 moe ranks
    ("ds", P(tp=2, engine_dp=2, ep=4)),  # sequence-parallel MoE: shared experts whole
    ("ds_grouped", P()),
    ("ds_grouped", P(tp=2)),
    ("ds_grouped", P(tp=4)),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_vllm_mla_shards_reproduce_hf_logits(case: tuple[str, InferParallel]) -> None:
    name, par = case
    ref, want = run(name, par)
    # float32 throughout; only the summation order differs (partial sums over ranks,
    # explicit softmax attention vs. SDPA, pair-wise vs. de-interleaved RoPE).
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)


# --- corrupted layouts must fail --------------------------------------------------------


def _map_pieces(local_suffix: str, fn: Callable[[Any, InferParallel], Any]) -> Corruption:
    def corrupt(layouts: list[RankLayout], par: InferParallel) -> list[RankLayout]:
        def fix(t: LocalTensor) -> LocalTensor:
            if not t.name.endswith(local_suffix):
                return t
            return dataclasses.replace(t, pieces=tuple(fn(p, par) for p in t.pieces))

        return [
            dataclasses.replace(lay, tensors=tuple(fix(t) for t in lay.tensors)) for lay in layouts
        ]

    return corrupt


def _kv_a_from_q_a(piece: Any, par: InferParallel) -> Any:
    """The kv_a block of fused_qkv_a_proj reads q_a_proj's first rows instead."""
    name = piece.canonical.replace("kv_a_proj_with_mqa", "q_a_proj")
    return dataclasses.replace(piece, canonical=name)


def _kv_b_heads_shifted(piece: Any, par: InferParallel) -> Any:
    """Each rank's kv_b_proj rows (its heads) come from the next tp rank's heads."""
    (r0, c0), rows = piece.canonical_box.offsets, piece.canonical_box.sizes[0]
    box = dataclasses.replace(piece.canonical_box, offsets=((r0 + rows) % (rows * par.tp), c0))
    return dataclasses.replace(piece, canonical_box=box)


CORRUPTIONS: list[tuple[str, InferParallel, Corruption]] = [
    ("fused_qkv_a_kv_part_from_q_a", P(), _map_pieces("fused_qkv_a_proj.weight", _kv_a_from_q_a)),
    ("kv_b_heads_shifted", P(tp=2), _map_pieces("kv_b_proj.weight", _kv_b_heads_shifted)),
]


@pytest.mark.parametrize(
    "par,corrupt", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS]
)
def test_corrupted_mla_layout_changes_logits(par: InferParallel, corrupt: Corruption) -> None:
    ref, want = run("ds", par, corrupt)
    assert (ref - want).abs().max().item() > 1e-2
