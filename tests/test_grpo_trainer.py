"""GRPO trainer (real megatron-core GPTModel on gloo CPU), its loss and its toy task.

* loss / advantages / reward: hand-computed values.
* One spawn of 1 rank (tp=1) and one of 2 ranks (tp=2, pp=2, dp=2 in turn) build
  ``MegatronPolicyTrainer`` from the same seed and:
  - ``local_tensors()`` names/shapes equal the Megatron layout provider's, per rank;
  - ``logprobs`` equal on every rank, equal across parallelism, and equal an HF
    transformers Qwen3 forward on the same canonical weights (atol 1e-5);
  - two ``train_step``s on a fixed batch (clipping and KL active) give the same
    canonical weights (reassembled through the layout pieces) and the same metrics;
  - a 20-step tp=1 GRPO run (sampling with the trainer's own forward) raises the
    mean reward.

Megatron's CPU patches rewrite ``torch.cuda`` globally, so all Megatron work happens in
spawned processes, never in the pytest process.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from nemo_refit_reshard.grpo_cpu.loss import group_advantages, grpo_loss, k3_kl
from nemo_refit_reshard.grpo_cpu.task import (
    POLICY_CONFIG,
    VOCAB,
    CharTokenizer,
    StringTask,
    policy_spec,
)
from nemo_refit_reshard.grpo_cpu.trainer import GrpoConfig, init_canonical_weights
from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout, megatron_padded_vocab
from nemo_refit_reshard.spec.parallel import TrainParallel

SEED = 3
TASK = StringTask(length=4, alphabet="abcd", mode="copy")
# Large init so logits are far from uniform: a wrong shard would change logprobs a lot.
# adam_eps well above round-off: Adam's first steps are ~lr·sign(g), so with a tiny eps
# a gradient element that is 0 up to round-off could move by ±lr in either run; with
# this eps updates scale with |g|, so a wrongly scaled gradient shows in the weights.
CHECK_CFG = GrpoConfig(init_std=0.5, kl_coef=0.1, clip_eps=0.2, lr=1e-3, adam_eps=1e-3)
PARALLEL = {"tp2": TrainParallel(tp=2), "pp2": TrainParallel(pp=2), "dp2": TrainParallel(dp=2)}
GROUPS, G = 2, 4
LEARN_STEPS = 20


# ------------------------------------------------------------------------ pure functions
def test_group_advantages_hand_values() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.2, 0.6, 0.0, 0.0])
    # group 1: mean 0.25, unbiased std sqrt((0.75² + 3·0.25²)/3) = 0.5
    # group 2: all equal -> 0;  group 3 (G=4): [0.2, 0.6, 0, 0] mean 0.2,
    # std sqrt((0 + 0.16 + 0.04 + 0.04)/3) = sqrt(0.08)
    s3 = math.sqrt(0.08)
    want = [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0, 0, 0.4 / s3, -0.2 / s3, -0.2 / s3]
    got = group_advantages(rewards, 4, eps=1e-12)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=0)
    # eps keeps equal-reward groups at exactly 0 and shrinks the others slightly.
    assert group_advantages(rewards, 4)[0].item() == pytest.approx(0.75 / (0.5 + 1e-6), abs=1e-7)
    with pytest.raises(ValueError, match="groups of 5"):
        group_advantages(rewards, 5)


def _loss_case() -> dict[str, torch.Tensor]:
    # ratios exp(lp - old): [[1.5, 1.0], [0.5, 1.1]], advantages [1, -2], clip 0.2:
    #   (1.5, +1): min(1.5, 1.2)  = 1.2  -> pg -1.2 (clipped)
    #   (1.0, +1): min(1.0, 1.0)  = 1.0  -> pg -1.0
    #   (0.5, -2): min(-1.0, -1.6) = -1.6 -> pg +1.6 (clipped)
    #   (1.1, -2): min(-2.2, -2.2) = -2.2 -> pg +2.2 (masked out below)
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    lp = old + torch.log(torch.tensor([[1.5, 1.0], [0.5, 1.1]]))
    return dict(
        lp=lp.requires_grad_(True),
        old=old,
        adv=torch.tensor([1.0, -2.0]),
        mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        ref=lp.detach() + torch.tensor([[0.0, math.log(2.0)], [0.0, 0.0]]),
    )


def test_grpo_loss_hand_values() -> None:
    c = _loss_case()
    loss, stats = grpo_loss(c["lp"], c["old"], c["adv"], c["mask"], clip_eps=0.2)
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 1.6) / 3, abs=1e-6)
    assert stats["clipped"].item() == 2 and stats["tokens"].item() == 3
    assert stats["pg"].item() == pytest.approx(-0.6, abs=1e-6)
    assert stats["abs_log_ratio"].item() == pytest.approx(math.log(1.5) + math.log(2), abs=1e-6)
    loss.backward()
    # only the unclipped, unmasked token has a gradient: d(-r·A)/d lp = -r·A = -1, / 3 tokens
    torch.testing.assert_close(c["lp"].grad, torch.tensor([[0.0, -1 / 3], [0.0, 0.0]]))

    all_tokens = torch.ones(2, 2)
    loss, _ = grpo_loss(c["lp"], c["old"], c["adv"], all_tokens, clip_eps=0.2)
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 1.6 + 2.2) / 4, abs=1e-6)
    loss, _ = grpo_loss(c["lp"], c["old"], c["adv"], c["mask"], clip_eps=0.2, num_tokens=6)
    assert loss.item() == pytest.approx(-0.6 / 6, abs=1e-6)


def test_grpo_loss_k3_kl() -> None:
    c = _loss_case()
    # k3 with log(ref/p) = log 2 on token (0, 1): 2 - log 2 - 1
    k3 = 1 - math.log(2.0)
    torch.testing.assert_close(
        k3_kl(c["lp"].detach(), c["ref"]), torch.tensor([[0.0, k3], [0.0, 0.0]])
    )
    loss, stats = grpo_loss(
        c["lp"], c["old"], c["adv"], c["mask"], clip_eps=0.2, kl_coef=0.5, ref_logprobs=c["ref"]
    )
    assert loss.item() == pytest.approx((-0.6 + 0.5 * k3) / 3, abs=1e-6)
    assert stats["kl"].item() == pytest.approx(k3, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(c["lp"], c["old"], c["adv"], c["mask"], clip_eps=0.2, kl_coef=0.5)


def test_task_tokenizer_reward_and_spec() -> None:
    tok = CharTokenizer()
    assert len(VOCAB) == 23 and tok.decode(tok.encode("abc=", bos=True)) == "<bos>abc="
    prompts = torch.tensor([tok.encode("abca=", bos=True)] * 2)
    completions = torch.tensor([tok.encode("abcb"), tok.encode("acba")])
    # target abca: abcb -> 3 of 4; acba -> a, a right -> 2 of 4
    assert TASK.reward(prompts, completions).tolist() == [0.75, 0.5]
    reverse = StringTask(length=4, alphabet="abcd", mode="reverse")
    # target acba: abcb -> only the first a; acba -> all
    assert reverse.reward(prompts, completions).tolist() == [0.25, 1.0]
    gen = torch.Generator().manual_seed(0)
    p = TASK.sample_prompts(64, gen)
    assert p.shape == (64, TASK.prompt_len) and set(tok.decode(p[:, 1:5].flatten())) <= set("abcd")
    spec = policy_spec()
    assert spec.arch.vocab_size == 23 and spec.arch.tie_word_embeddings
    # padded on both sides: vLLM to 64, Megatron to 128·tp
    assert 23 % 64 and megatron_padded_vocab(23, 2) == 256


# ------------------------------------------------------------------------------ workers
def _canonical_from_locals(
    par: TrainParallel, locals_by_rank: dict[int, dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Reassemble canonical tensors from every rank's local tensors via the layout pieces;
    copies of one element on several ranks (TP/DP replicas, tied embedding) must agree."""
    spec = policy_spec()
    out = {t.name: torch.full(t.shape, float("nan")) for t in spec}
    for rank, local in locals_by_rank.items():
        layout = megatron_layout(spec, par, rank, MegatronOptions(params_dtype="float32"))
        for t in layout.tensors:
            for pad in t.padding:  # padded vocabulary rows never learn anything
                assert not local[t.name][pad.slices()].any(), f"{par} rank {rank} {t.name}"
            for piece in t.pieces:
                src = local[t.name][piece.local_box.slices()]
                dst = out[piece.canonical][piece.canonical_box.slices()]
                src = src.reshape(dst.shape)
                seen = ~dst.isnan()
                torch.testing.assert_close(
                    src[seen], dst[seen], atol=1e-6, rtol=0, msg=f"{par} {piece.canonical}"
                )
                dst.copy_(src)
    for name, value in out.items():
        assert not value.isnan().any(), f"{par}: {name} not fully covered"
    return out


def _check_config(par: TrainParallel, payload: dict[str, Any]) -> dict[str, Any]:
    """Build a trainer for ``par`` on this rank; names, logprobs, two train steps."""
    from nemo_refit_reshard.grpo_cpu.trainer import MegatronPolicyTrainer

    trainer = MegatronPolicyTrainer(policy_spec(), par, CHECK_CFG, seed=SEED)
    out: dict[str, Any] = {}
    out["names"] = {n: (tuple(p.shape), str(p.dtype)) for n, p in trainer.local_tensors().items()}
    tokens, prompt_len = payload["tokens"], TASK.prompt_len
    out["logprobs"] = trainer.logprobs(tokens, prompt_len)
    out["logits"] = trainer.logits(tokens)
    out["metrics"] = [
        trainer.train_step(tokens, prompt_len, payload["rewards"], payload["old"], G)
        for _ in range(2)
    ]
    out["after"] = {n: p.detach().clone() for n, p in trainer.local_tensors().items()}
    trainer.close()
    return out


def _learn() -> dict[str, Any]:
    """A short tp=1 GRPO run on the copy task, sampling with the trainer's own forward."""
    from nemo_refit_reshard.grpo_cpu.trainer import (
        MegatronPolicyTrainer,
        sample_completions,
    )

    cfg = GrpoConfig()
    trainer = MegatronPolicyTrainer(policy_spec(), TrainParallel(), cfg, seed=SEED)
    gen = torch.Generator().manual_seed(SEED)
    curve, mismatch, start = [], [], time.perf_counter()
    for _ in range(LEARN_STEPS):
        prompts = TASK.sample_prompts(cfg.prompts_per_step, gen)
        prompts = prompts.repeat_interleave(cfg.group_size, dim=0)
        tokens = sample_completions(
            trainer.logits, prompts, TASK.completion_len, cfg.temperature, gen
        )
        rewards = TASK.reward(prompts, tokens[:, TASK.prompt_len :])
        old = trainer.logprobs(tokens, TASK.prompt_len)
        metrics = trainer.train_step(tokens, TASK.prompt_len, rewards, old, cfg.group_size)
        curve.append(metrics["reward_mean"])
        mismatch.append(metrics["logprob_mismatch"])
    seconds = (time.perf_counter() - start) / LEARN_STEPS
    trainer.close()
    return dict(curve=curve, mismatch=mismatch, seconds_per_step=seconds)


def _worker(rank: int, tmp: str, world: int) -> None:
    warnings.filterwarnings("ignore")  # megatron's TE/Apex fallback notices
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/init{world}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    payload = torch.load(os.path.join(tmp, "payload.pt"))
    results: dict[str, Any] = {}
    configs = {"tp1": TrainParallel()} if world == 1 else PARALLEL
    try:
        for name, par in configs.items():
            results[name] = _check_config(par, payload)
        if world == 1:
            results["learn"] = _learn()
    except Exception as e:
        raise RuntimeError(f"world {world} rank {rank}:\n{traceback.format_exc()}") from e
    torch.save(results, os.path.join(tmp, f"world{world}_rank{rank}.pt"))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- parent
def _hf_model(canonical: dict[str, torch.Tensor]) -> torch.nn.Module:
    import transformers

    skip = ("architectures", "model_type", "torch_dtype")
    config = transformers.Qwen3Config(**{k: v for k, v in POLICY_CONFIG.items() if k not in skip})
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(canonical, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


@torch.no_grad()
def _hf_logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(_hf_logits(model, tokens)[:, TASK.prompt_len - 1 : -1], dim=-1)
    return lp.gather(-1, tokens[:, TASK.prompt_len :, None])[..., 0]


@torch.no_grad()
def _hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens).logits.float()


def _payload() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(SEED)
    prompts = TASK.sample_prompts(GROUPS, gen).repeat_interleave(G, dim=0)
    completions = torch.randint(3, len(VOCAB), (GROUPS * G, TASK.completion_len), generator=gen)
    tokens = torch.cat([prompts, completions], dim=1)
    canonical = init_canonical_weights(policy_spec(), SEED, CHECK_CFG.init_std)
    model = _hf_model(canonical)
    hf, hf_logits = _hf_logprobs(model, tokens), _hf_logits(model, tokens)
    # The sampler's logprobs off by up to ±0.4 nats: ratios leave [0.8, 1.2] on some tokens.
    old = hf + (torch.rand(hf.shape, generator=gen) - 0.5) * 0.8
    rewards = torch.tensor([1.0, 0.25, 0.5, 0.0, 0.75, 0.75, 0.0, 0.25])
    return dict(
        tokens=tokens, rewards=rewards, old=old, hf=hf, hf_logits=hf_logits, canonical=canonical
    )


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, Any], dict[str, dict[int, dict[str, Any]]]]:
    payload = _payload()
    results: dict[str, dict[int, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(payload, os.path.join(tmp, "payload.pt"))
        for world in (1, 2):
            mp.start_processes(_worker, args=(tmp, world), nprocs=world, start_method="spawn")
            for rank in range(world):
                part = torch.load(os.path.join(tmp, f"world{world}_rank{rank}.pt"))
                for name, value in part.items():
                    results.setdefault(name, {})[rank] = value
    return payload, results


ALL = {"tp1": TrainParallel(), **PARALLEL}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALL))
def test_local_tensors_match_layout(runs, name: str) -> None:
    _, results = runs
    par = ALL[name]
    spec = policy_spec()
    for rank in range(par.world_size):
        layout = megatron_layout(spec, par, rank, MegatronOptions(params_dtype="float32"))
        want = {t.name: (t.shape, "torch.float32") for t in layout.tensors}
        assert results[name][rank]["names"] == want, f"{name} rank {rank}"


@pytest.mark.slow
def test_hf_reference_is_discriminating(runs) -> None:
    """The HF comparison can fail: swapping layer 0's k/v projections moves logprobs."""
    payload, _ = runs
    canonical = dict(payload["canonical"])
    k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    canonical[k], canonical[v] = canonical[v], canonical[k]
    wrong = _hf_logprobs(_hf_model(canonical), payload["tokens"])
    assert (wrong - payload["hf"]).abs().max() > 1e-2
    assert payload["hf"].std() > 0.5, "logprobs too uniform to tell layouts apart"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALL))
def test_logprobs_match_hf_on_every_rank(runs, name: str) -> None:
    payload, results = runs
    for rank, res in results[name].items():
        torch.testing.assert_close(
            res["logprobs"],
            payload["hf"],
            atol=1e-5,
            rtol=0,
            msg=lambda m, r=rank: f"{name} {r}: {m}",
        )
        torch.testing.assert_close(
            res["logprobs"], results["tp1"][0]["logprobs"], atol=1e-5, rtol=0
        )
        # the gathered, unpadded logits (what sampling uses) equal HF's too
        torch.testing.assert_close(res["logits"], payload["hf_logits"], atol=1e-4, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARALLEL))
def test_train_step_matches_tp1(runs, name: str) -> None:
    _, results = runs
    ref = results["tp1"][0]
    par = PARALLEL[name]
    got = _canonical_from_locals(par, {r: res["after"] for r, res in results[name].items()})
    want = _canonical_from_locals(TrainParallel(), {0: ref["after"]})
    before = init_canonical_weights(policy_spec(), SEED, CHECK_CFG.init_std)
    for tensor, value in want.items():
        torch.testing.assert_close(got[tensor], value, atol=1e-5, rtol=0, msg=f"{name} {tensor}")
        assert not torch.equal(value, before[tensor]), f"{tensor} did not train"
    for rank, res in results[name].items():
        for step, (m, m1) in enumerate(zip(res["metrics"], ref["metrics"])):
            for key, value in m1.items():
                assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, rank, step, key)
    # both steps exercised clipping and the second the KL to the reference
    first, second = ref["metrics"]
    assert first["clip_fraction"] > 0 and first["kl"] == 0 and second["kl"] > 0


@pytest.mark.slow
def test_reward_rises_over_short_run(runs) -> None:
    _, results = runs
    learn = results["learn"][0]
    curve = learn["curve"]
    print(f"reward curve {[round(r, 3) for r in curve]}, {learn['seconds_per_step']:.3f} s/step")
    early, late = sum(curve[:3]) / 3, sum(curve[-5:]) / 5
    assert early < 0.1, curve  # ~1/23 per character from a random initialisation
    assert late > early + 0.1, curve
    # sampled and scored with the same weights: trainer/sampler logprobs agree
    assert max(learn["mismatch"]) < 1e-5


def test_trainer_refuses_unsupported_parallelism() -> None:
    from nemo_refit_reshard.grpo_cpu.trainer import check_trainer_supported

    with pytest.raises(ValueError, match="tp, pp and dp only"):
        check_trainer_supported(policy_spec(), TrainParallel(pp=2, vpp=2))
    with pytest.raises(ValueError, match="tp, pp and dp only"):
        check_trainer_supported(policy_spec(), TrainParallel(cp=2))
