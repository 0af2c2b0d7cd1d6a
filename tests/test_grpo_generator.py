"""The GRPO example's generator: sampling over vLLM-layout shards, checked against HF.

Tiny random float32 HF models give the canonical tensors; each generator's local
tensors are filled in place from the vLLM layout's pieces (as a refit would), and
the log-probabilities it returns must equal HF's ``log_softmax`` at the sampled
tokens when HF sees prompt + generation in one forward pass. The TP cases run in
real gloo processes (one spawn of 4 ranks for all of them) and must reproduce the
single-rank result token for token.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import Tensor

from nemo_refit_reshard.engine.rendezvous import free_port
from nemo_refit_reshard.grpo_cpu.generator import ForwardConfig, VllmLayoutGenerator
from nemo_refit_reshard.layouts import VllmOptions, vllm_layout
from nemo_refit_reshard.spec import InferParallel, ModelSpec, load_model_spec, spec_from_hf_config
from tests.helpers.hf_models import unit_scale_weights
from tests.helpers.vllm_reference import canonical_state_dict, materialize

P = InferParallel
VOCAB = 100  # padded to 128: tp ranks past id 100 hold padding rows
BATCH, PROMPT, NEW = 3, 6, 6
SEED = 1234
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # tp=4 replicates each KV head on two ranks
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    dtype="float32",
)
# family -> (transformers config class, extra keys)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(architectures=["LlamaForCausalLM"])),
    "qwen2": ("Qwen2Config", dict(architectures=["Qwen2ForCausalLM"])),  # qkv bias
    "qwen3": (  # q/k norm, head_dim != hidden/heads, tied lm_head
        "Qwen3Config",
        dict(architectures=["Qwen3ForCausalLM"], head_dim=24, tie_word_embeddings=True),
    ),
    "moe": (  # layer 0 MoE (4 experts, top-2), layer 1 dense
        "Qwen3MoeConfig",
        dict(
            architectures=["Qwen3MoeForCausalLM"],
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
}


@dataclasses.dataclass(frozen=True)
class Model:
    hf: torch.nn.Module
    cfg: dict[str, Any]
    spec: ModelSpec
    canonical: dict[str, Tensor]
    config: ForwardConfig


@functools.cache
def model(name: str) -> Model:
    transformers = pytest.importorskip("transformers")  # lazily: spawned ranks never need it
    cls, extra = CONFIGS[name]
    hf_config = getattr(transformers, cls)(**dict(COMMON, **extra))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    unit_scale_weights(hf)
    cfg = hf_config.to_dict()
    tied = bool(cfg.get("tie_word_embeddings"))
    return Model(
        hf,
        cfg,
        spec_from_hf_config(cfg, name=name),
        canonical_state_dict(hf, tied),
        ForwardConfig.from_hf_config(cfg),
    )


def prompts() -> Tensor:
    """Ids on both sides of every tp=4 vocabulary shard boundary (32, 64, 96)."""
    edge = torch.tensor([[0, 31, 32, 63, 64, 99], [95, 96, 1, 33, 65, 2], [50, 97, 31, 0, 99, 64]])
    assert edge.shape == (BATCH, PROMPT)
    return edge


def fill(gen: VllmLayoutGenerator, canonical: dict[str, Tensor]) -> None:
    """What a refit does: write every piece into the generator's own tensors in place."""
    shards = materialize(gen.layout, canonical)
    for name, local in gen.local_tensors().items():
        local.copy_(shards[name])


def hf_logprobs(m: Model, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """HF log-probabilities of ``tokens`` (and HF's argmax) from one full forward pass."""
    with torch.no_grad():
        logits = m.hf(torch.cat([prompts(), tokens], dim=1)).logits.float()
    logits = logits[:, PROMPT - 1 : -1]  # position t predicts token t + 1
    lp = logits.log_softmax(dim=-1).gather(-1, tokens[..., None])[..., 0]
    return lp, logits.argmax(dim=-1)


def describe(gen: VllmLayoutGenerator) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in gen.local_tensors().items()]


def single_rank(name: str) -> VllmLayoutGenerator:
    m = model(name)
    gen = VllmLayoutGenerator(m.spec, P(), 0, None, config=m.config)
    fill(gen, m.canonical)
    return gen


def sample(gen: VllmLayoutGenerator, temperature: float, seed: int = SEED) -> tuple[Tensor, Tensor]:
    return gen.generate(prompts(), NEW, temperature, torch.Generator().manual_seed(seed))


# --- single rank (no process group) -------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_logprobs_match_hf(name: str) -> None:
    tokens, lps = sample(single_rank(name), temperature=0.0)
    assert tokens.shape == (BATCH, NEW) and tokens.dtype == torch.int64
    assert lps.shape == (BATCH, NEW) and lps.dtype == torch.float32
    want, argmax = hf_logprobs(model(name), tokens)
    assert torch.equal(tokens, argmax)  # greedy under HF's logits, every step
    torch.testing.assert_close(lps, want, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sampled_logprobs_match_hf_and_no_cache_recompute(name: str) -> None:
    gen = single_rank(name)
    tokens, lps = sample(gen, temperature=1.0)
    want, _ = hf_logprobs(model(name), tokens)
    torch.testing.assert_close(lps, want, atol=1e-5, rtol=0)
    # The KV-cache path (prefill + one token a step) against one no-cache pass of ours.
    logits = gen.forward_logits(torch.cat([prompts(), tokens], dim=1))[:, PROMPT - 1 : -1]
    recompute = logits.log_softmax(dim=-1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(lps, recompute, atol=1e-5, rtol=0)
    # Seeded: the same seed gives the same tokens, another seed other tokens.
    assert torch.equal(sample(gen, 1.0)[0], tokens)
    assert not torch.equal(sample(gen, 1.0, seed=SEED + 1)[0], tokens)


def test_sampling_follows_the_tempered_distribution() -> None:
    gen = single_rank("llama")
    rows, temperature = 4000, 0.7
    batch = prompts()[:1].repeat(rows, 1)
    tokens, lps = gen.generate(batch, 1, temperature, torch.Generator().manual_seed(SEED))
    logits = gen.forward_logits(prompts()[:1])[0, -1]
    want = (logits / temperature).softmax(dim=-1)
    freq = torch.bincount(tokens[:, 0], minlength=VOCAB).float() / rows
    # 5 standard deviations of a frequency over 4000 draws is at most 0.04.
    assert (freq - want).abs().max().item() < 0.04
    # The returned logprobs are the temperature-1 policy's, not the tempered one's.
    # (a batch of 4000 rows sums in another order than one row: not bit-equal)
    torch.testing.assert_close(lps[:, 0], logits.log_softmax(-1)[tokens[:, 0]], atol=1e-5, rtol=0)
    assert (lps[:, 0] - want.log()[tokens[:, 0]]).abs().min().item() > 1e-2


def test_bfloat16_generator_stays_close_to_hf_float32() -> None:
    m = model("moe")
    gen = VllmLayoutGenerator(m.spec, P(), 0, None, torch.bfloat16, config=m.config)
    fill(gen, m.canonical)
    tokens, lps = sample(gen, temperature=1.0)
    assert lps.dtype == torch.float32
    # bf16 weights and activations (measured max error 0.02 on this model)
    torch.testing.assert_close(lps, hf_logprobs(m, tokens)[0], atol=0.1, rtol=0)


def test_swapped_kv_heads_break_logprobs_and_an_in_place_refit_repairs_them() -> None:
    m = model("qwen2")
    gen = single_rank("qwen2")
    qkv = gen.local_tensors()["model.layers.0.self_attn.qkv_proj.weight"]
    hd, nq = 16, 4
    k0, k1 = slice(nq * hd, (nq + 1) * hd), slice((nq + 1) * hd, (nq + 2) * hd)
    good = qkv.clone()
    qkv[k0], qkv[k1] = good[k1], good[k0]  # KV heads 0 and 1 swapped in the k rows
    tokens, lps = sample(gen, temperature=1.0)
    want, _ = hf_logprobs(m, tokens)
    assert (lps - want).abs().max().item() > 1e-2
    qkv.copy_(good)  # refit writes in place; the next generate must read the new values
    tokens, lps = sample(gen, temperature=1.0)
    torch.testing.assert_close(lps, hf_logprobs(m, tokens)[0], atol=1e-5, rtol=0)


def test_local_tensors_are_the_vllm_layout() -> None:
    m = model("moe")
    gen = VllmLayoutGenerator(m.spec, P(), 0, None, torch.bfloat16, config=m.config)
    layout = vllm_layout(m.spec, P(), 0, VllmOptions(params_dtype="bfloat16"))
    assert gen.layout == layout
    assert describe(gen) == [(t.name, t.shape, "torch.bfloat16") for t in layout.tensors]
    # No copies: every call hands out the same storages.
    assert all(
        gen.local_tensors()[n].data_ptr() == t.data_ptr() for n, t in gen.local_tensors().items()
    )


def test_refuses_what_it_cannot_run() -> None:
    m = model("moe")
    dense = model("llama")
    with pytest.raises(ValueError, match=r"inference pp=2: .* use pp=1 for the generator"):
        VllmLayoutGenerator(dense.spec, P(pp=2), 0, None, config=dense.config)
    with pytest.raises(ValueError, match=r"engine_dp=2 with a MoE model"):
        VllmLayoutGenerator(m.spec, P(engine_dp=2), 0, None, config=m.config)
    with pytest.raises(ValueError, match=r"needs ForwardConfig.num_experts_per_tok"):
        VllmLayoutGenerator(m.spec, P(), 0, None)
    with pytest.raises(ValueError, match=r"'deepseek_v3' is not supported"):
        VllmLayoutGenerator(load_model_spec("deepseek-v3"), P(), 0, None)
    with pytest.raises(ValueError, match=r"rope_type='llama3' is not supported"):
        ForwardConfig.from_hf_config({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match=r"tp=2 needs a tp_group"):
        VllmLayoutGenerator(dense.spec, P(tp=2), 0, None, config=dense.config)
    gen = single_rank("llama")
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=100\)"):
        gen.generate(torch.tensor([[VOCAB]]), 1)


# --- tensor parallel over gloo ---------------------------------------------------------------

# All four ranks run every case; tp=2 cases are two engines (dp=2) of two ranks.
TP_CASES: dict[str, tuple[str, InferParallel]] = {
    "llama-tp2-dp2": ("llama", P(tp=2, dp=2)),
    "llama-tp4-kv-replicated": ("llama", P(tp=4)),  # 2 KV heads over 4 ranks
    "qwen2-tp4-kv-replicated": ("qwen2", P(tp=4)),
    "qwen3-tied-tp2-dp2": ("qwen3", P(tp=2, dp=2)),
    "moe-tp2-dp2": ("moe", P(tp=2, dp=2)),  # every expert sliced over tp
    "moe-tp4": ("moe", P(tp=4)),
    "moe-ep2-dp2": ("moe", P(tp=2, ep=2, dp=2)),  # two whole experts per rank
}
CORRUPT_CASE = "llama-tp4-rank1-wrong-kv-head"  # rank 1 reads KV head 1 instead of 0
WORLD = 4


def _tp_worker(rank: int, port: int, payload: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    data = torch.load(payload, weights_only=False)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        groups: dict[tuple[int, ...], Any] = {}
        for tp in (2, 4):  # every rank creates every group, in the same order
            for first in range(0, WORLD, tp):
                groups[tuple(range(first, first + tp))] = dist.new_group(
                    list(range(first, first + tp))
                )
        results = {}
        for case, (name, par) in [*TP_CASES.items(), (CORRUPT_CASE, ("llama", P(tp=4)))]:
            m = data[name]
            first = rank - rank % par.tp
            group = groups[tuple(range(first, first + par.tp))]
            gen = VllmLayoutGenerator(m["spec"], par, rank, group, config=m["config"])
            fill(gen, m["canonical"])
            if case == CORRUPT_CASE and rank == 1:
                qkv = gen.local_tensors()["model.layers.0.self_attn.qkv_proj.weight"]
                hd = 16
                k_rows = m["canonical"]["model.layers.0.self_attn.k_proj.weight"][hd : 2 * hd]
                qkv[hd : 2 * hd] = k_rows  # one q head, then this rank's single KV head
            # Only tp rank 0 may draw: the other ranks get differently seeded generators.
            out = []
            for temperature in (0.0, 1.0):
                g = torch.Generator().manual_seed(SEED + 1000 * (rank % par.tp))
                out.append(gen.generate(data["prompts"], NEW, temperature, g))
            results[case] = (describe(gen), out)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results() -> dict[str, list[Any]]:
    """case -> per rank -> (local tensors described, [greedy, sampled] (tokens, logprobs))."""
    names = {name for name, _ in TP_CASES.values()}
    data: dict[str, Any] = {"prompts": prompts()}
    for name in names:
        m = model(name)
        data[name] = dict(spec=m.spec, config=m.config, canonical=m.canonical)
    with tempfile.TemporaryDirectory() as tmp:
        payload = os.path.join(tmp, "payload.pt")
        torch.save(data, payload)
        mp.start_processes(
            _tp_worker, args=(free_port(), payload, tmp), nprocs=WORLD, start_method="spawn"
        )
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    cases = [*TP_CASES, CORRUPT_CASE]
    return {case: [per_rank[r][case] for r in range(WORLD)] for case in cases}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TP_CASES))
def test_tp_ranks_reproduce_single_rank_sampling(
    case: str, tp_results: dict[str, list[Any]]
) -> None:
    name, par = TP_CASES[case]
    gen = single_rank(name)
    want = [sample(gen, 0.0), sample(gen, 1.0)]
    for rank, (tensors, runs) in enumerate(tp_results[case]):
        layout = vllm_layout(model(name).spec, par, rank, VllmOptions(params_dtype="float32"))
        assert tensors == [(t.name, t.shape, "torch.float32") for t in layout.tensors]
        for (tokens, lps), (want_tokens, want_lps) in zip(runs, want):
            assert torch.equal(tokens, want_tokens), (case, rank)
            torch.testing.assert_close(lps, want_lps, atol=1e-5, rtol=0)
            torch.testing.assert_close(lps, hf_logprobs(model(name), tokens)[0], atol=1e-5, rtol=0)
    # Every rank (and both engines of a dp=2 case) returns the same tokens.
    for _, runs in tp_results[case][1:]:
        for (tokens, _), (first, _) in zip(runs, tp_results[case][0][1]):
            assert torch.equal(tokens, first)


@pytest.mark.slow
def test_tp_wrong_replicated_kv_head_breaks_logprobs(
    tp_results: dict[str, list[Any]],
) -> None:
    for _, runs in tp_results[CORRUPT_CASE]:
        for tokens, lps in runs:
            want, _ = hf_logprobs(model("llama"), tokens)
            assert (lps - want).abs().max().item() > 1e-2
