"""The vLLM layout, proven by running vLLM's sharded forward pass against HuggingFace.

Tiny random float32 HF models give the canonical tensors; every inference rank's
local tensors are filled from ``vllm_layout`` pieces alone, and an independent
plain-torch forward (``vllm_reference``) that follows vLLM's tensor-parallel,
pipeline, vocab-parallel and FusedMoE semantics must reproduce the HF logits.
Deliberately corrupted layouts must not.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import Tensor

from nemo_refit_reshard.layouts import LocalTensor, RankLayout, vllm_layout, vllm_pp_indices
from nemo_refit_reshard.spec import InferParallel, spec_from_hf_config
from tests.helpers.hf_models import HfModel, unit_scale_weights
from tests.helpers.vllm_reference import (
    Grid,
    VllmReference,
    canonical_state_dict,
    case_id,
    materialize,
)

transformers = pytest.importorskip("transformers")

Corruption = Callable[[list[RankLayout], InferParallel], list[RankLayout]]

VOCAB = 100  # not a multiple of 64: padded to 128, so the last tp ranks hold padding
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    dtype="float32",
)


def _configs() -> dict[str, Any]:
    t = transformers
    moe: dict[str, Any] = dict(
        COMMON,
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    )
    return {
        # GQA 4 q / 2 kv heads, 3 layers (pp=2 -> vLLM gives the extra layer to stage 0)
        "llama": t.LlamaConfig(
            **COMMON,
            architectures=["LlamaForCausalLM"],
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        # q/k/v bias; 8 q / 2 kv heads, so tp=4 and tp=8 replicate KV heads
        "qwen2": t.Qwen2Config(
            **COMMON,
            architectures=["Qwen2ForCausalLM"],
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
        ),
        # q_norm/k_norm, head_dim 24 != 64/4, tied lm_head, 3 layers
        "qwen3": t.Qwen3Config(
            **COMMON,
            architectures=["Qwen3ForCausalLM"],
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=True,
        ),
        # layer 0 MoE (4 experts, top-2), layer 1 dense
        "moe": t.Qwen3MoeConfig(**moe),
        "moe_nonorm": t.Qwen3MoeConfig(**dict(moe, norm_topk_prob=False)),
        # 3 experts: expert parallel over 2 ranks splits them 2 + 1
        "moe3": t.Qwen3MoeConfig(**dict(moe, num_experts=3)),
    }


@functools.cache
def model(name: str) -> HfModel:
    config = _configs()[name]
    torch.manual_seed(1234)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    unit_scale_weights(hf)
    cfg = config.to_dict()
    spec = spec_from_hf_config(cfg, name=name)
    return HfModel(hf, cfg, spec, canonical_state_dict(hf, bool(cfg.get("tie_word_embeddings"))))


def input_ids(rows: int, t: int = 10) -> Tensor:
    """Ids at every tp shard boundary of the padded vocab, plus the last real id."""
    g = torch.Generator().manual_seed(7)
    edge = torch.tensor([VOCAB - 1, 0, 31, 32, 63, 64, 95, 96])
    out = [
        torch.cat(
            [edge[torch.randperm(8, generator=g)], torch.randint(0, VOCAB, (t - 8,), generator=g)]
        )
        for _ in range(rows)
    ]
    return torch.stack(out)


def build_grid(m: HfModel, par: InferParallel, corrupt: Corruption | None = None) -> Grid:
    layouts = [vllm_layout(m.spec, par, r) for r in range(par.world_size)]
    if corrupt is not None:
        layouts = corrupt(layouts, par)
    grid: Grid = {}
    for lay in layouts:
        pos = lay.position
        key = (pos["dp"], pos["engine_dp"], pos["pp"], pos["tp"])
        # vLLM's rank order: ((replica·engine_dp + edp)·pp + pp_rank)·tp + tp_rank
        r, e, p, s = key
        assert lay.rank == ((r * par.engine_dp + e) * par.pp + p) * par.tp + s
        grid[key] = materialize(lay, m.canonical)
    assert len(grid) == par.world_size
    return grid


def run(
    name: str, par: InferParallel, corrupt: Corruption | None = None, replica: int = 0
) -> tuple[Tensor, Tensor]:
    m = model(name)
    ids = input_ids(par.engine_dp)
    grid = build_grid(m, par, corrupt)
    ref = VllmReference(m.cfg, par, grid, replica=replica).forward(ids)
    with torch.no_grad():
        want = m.hf(ids).logits
    return ref, want


# --- canonical tensors ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "moe", "moe3"])
def test_canonical_state_dict_matches_spec_and_checkpoint(name: str) -> None:
    m = model(name)
    assert {k: tuple(v.shape) for k, v in m.canonical.items()} == {
        t.name: t.shape for t in m.spec.tensors
    }
    with tempfile.TemporaryDirectory() as tmp:
        m.hf.save_pretrained(tmp)
        with safe_open(f"{tmp}/model.safetensors", "pt") as f:
            assert set(f.keys()) == set(m.canonical)
            for key in f.keys():
                assert torch.equal(f.get_tensor(key), m.canonical[key]), key


# --- forward equivalence --------------------------------------------------------------

P = InferParallel
CASES: list[tuple[str, InferParallel]] = [
    ("llama", P()),
    ("llama", P(tp=2)),
    ("llama", P(tp=4)),  # kv heads replicated twice; vocab rows 100..127 are padding
    ("llama", P(pp=2)),  # 3 layers: stage 0 [0, 1], stage 1 [2]
    ("llama", P(tp=2, pp=2)),
    ("llama", P(tp=2, dp=2)),  # two engine replicas
    ("llama", P(tp=2, engine_dp=2)),  # dense model under vLLM data parallel
    ("qwen2", P(tp=2)),
    ("qwen2", P(tp=4)),
    ("qwen2", P(tp=8)),  # one q head and one (4x replicated) kv head per rank
    ("qwen3", P()),
    ("qwen3", P(tp=2)),
    ("qwen3", P(tp=4)),
    ("qwen3", P(tp=2, pp=2)),  # tied: the last stage rebuilds embed_tokens for lm_head
    ("moe", P()),
    ("moe", P(tp=2)),
    ("moe", P(tp=4)),
    ("moe", P(tp=2, ep=2)),
    ("moe", P(engine_dp=2)),  # experts sliced over 2 ranks, no ep
    ("moe", P(engine_dp=2, ep=2)),
    ("moe", P(tp=2, engine_dp=2)),  # Fe/4 slices
    ("moe", P(tp=2, engine_dp=2, ep=4)),  # one whole expert per rank
    ("moe", P(tp=2, pp=2)),
    ("moe", P(engine_dp=2, pp=2)),  # stage 1 is dense only: replicated over edp
    ("moe", P(tp=2, engine_dp=2, ep=4, dp=2)),
    ("moe_nonorm", P(tp=2, engine_dp=2)),
    ("moe_nonorm", P(tp=2, ep=2)),
    ("moe3", P(tp=2)),
    ("moe3", P(tp=2, ep=2)),  # uneven: experts [0, 1] and [2]
    ("moe3", P(engine_dp=2, ep=2)),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_vllm_shards_reproduce_hf_logits(case: tuple[str, InferParallel]) -> None:
    name, par = case
    for replica in range(par.dp):
        ref, want = run(name, par, replica=replica)
        # float32 throughout; only the summation order differs (partial sums over
        # ranks, explicit softmax attention vs. SDPA), which stays far below 1e-5.
        torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_replicas_are_exactly_the_ranks_with_identical_pieces(
    case: tuple[str, InferParallel],
) -> None:
    name, par = case
    layouts = [vllm_layout(model(name).spec, par, r) for r in range(par.world_size)]
    for lay in layouts:
        same = tuple(o.rank for o in layouts if o.tensors == lay.tensors)
        assert lay.replicas == same, (lay.rank, lay.position)


def test_pp_stages_follow_vllm_remainder_rule() -> None:
    grid = build_grid(model("llama"), P(pp=2))
    ref = VllmReference(model("llama").cfg, P(pp=2), grid)
    assert [ref.stage_layers(0), ref.stage_layers(1)] == [[0, 1], [2]]
    assert vllm_pp_indices(3, 0, 2) == (0, 2)


# --- corrupted layouts must fail --------------------------------------------------------


def _rename(fn: Callable[[str, str], str]) -> Corruption:
    """Rewrite each piece's canonical name with ``fn(local_name, canonical_name)``."""

    def corrupt(layouts: list[RankLayout], par: InferParallel) -> list[RankLayout]:
        out = []
        for lay in layouts:
            tensors = tuple(
                dataclasses.replace(
                    t,
                    pieces=tuple(
                        dataclasses.replace(p, canonical=fn(t.name, p.canonical)) for p in t.pieces
                    ),
                )
                for t in lay.tensors
            )
            out.append(dataclasses.replace(lay, tensors=tensors))
        return out

    return corrupt


def _swap(a: str, b: str, where: tuple[str, ...]) -> Corruption:
    def fn(local: str, canonical: str) -> str:
        if not any(w in local for w in where):
            return canonical
        if a in canonical:
            return canonical.replace(a, b)
        return canonical.replace(b, a)

    return _rename(fn)


def _shift_expert(local: str, canonical: str) -> str:
    """Expert e's pieces read expert (e + 1) % 4 instead."""
    return re.sub(r"experts\.(\d+)\.", lambda mt: f"experts.{(int(mt[1]) + 1) % 4}.", canonical)


def _vocab_shift(layouts: list[RankLayout], par: InferParallel) -> list[RankLayout]:
    """Every tp rank gets the vocabulary shard (pieces and padding) of tp rank + 1."""
    at = {tuple(lay.position.values()): lay for lay in layouts}
    out = []
    for lay in layouts:
        pos = dict(lay.position, tp=(lay.position["tp"] + 1) % par.tp)
        nb = at[tuple(pos.values())]
        tensors = tuple(
            nb.tensor(t.name) if t.name in ("model.embed_tokens.weight", "lm_head.weight") else t
            for t in lay.tensors
        )
        out.append(dataclasses.replace(lay, tensors=tensors))
    return out


def _o_proj_shift(layouts: list[RankLayout], par: InferParallel) -> list[RankLayout]:
    """Row-parallel o_proj columns taken from the next tp rank's shard."""

    def fix(t: LocalTensor) -> LocalTensor:
        if not t.name.endswith("o_proj.weight"):
            return t
        pieces = []
        for p in t.pieces:
            (r0, c0), cols = p.canonical_box.offsets, p.canonical_box.sizes[1]
            box = dataclasses.replace(p.canonical_box, offsets=(r0, (c0 + cols) % (cols * par.tp)))
            pieces.append(dataclasses.replace(p, canonical_box=box))
        return dataclasses.replace(t, pieces=tuple(pieces))

    return [dataclasses.replace(lay, tensors=tuple(fix(t) for t in lay.tensors)) for lay in layouts]


CORRUPTIONS: list[tuple[str, str, InferParallel, Corruption]] = [
    ("qkv_k_v_swapped", "llama", P(tp=2), _swap(".k_proj.", ".v_proj.", ("qkv_proj",))),
    ("qkv_bias_k_v_swapped", "qwen2", P(tp=2), _swap(".k_proj.", ".v_proj.", ("qkv_proj.bias",))),
    ("gate_up_swapped", "llama", P(tp=2), _swap(".gate_proj.", ".up_proj.", ("gate_up_proj",))),
    (
        "w13_gate_up_swapped",
        "moe",
        P(engine_dp=2, ep=2),
        _swap(".gate_proj.", ".up_proj.", ("w13_weight",)),
    ),
    ("vocab_shard_shifted", "llama", P(tp=2), _vocab_shift),
    ("tied_vocab_shard_shifted", "qwen3", P(tp=4), _vocab_shift),
    ("experts_permuted", "moe", P(tp=2, ep=2), _rename(_shift_expert)),
    ("o_proj_columns_shifted", "qwen3", P(tp=2), _o_proj_shift),
]


@pytest.mark.parametrize(
    "name,par,corrupt", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS]
)
def test_corrupted_layout_changes_logits(
    name: str, par: InferParallel, corrupt: Corruption
) -> None:
    ref, want = run(name, par, corrupt)
    assert (ref - want).abs().max().item() > 1e-2
