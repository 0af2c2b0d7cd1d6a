"""GRPO policy trainer on a real megatron-core ``GPTModel`` (CPU, gloo, float32).

Every training rank builds its ``GPTModel`` chunk with the local layer spec and loads
it from seeded *canonical* (HF-named) weights through the Megatron layout provider's
pieces, so runs with any tp/pp start from identical weights and the parameters carry
exactly the names and shapes that refit plans are built from.

Forward and backward go through megatron's own ``get_forward_backward_func`` schedules
(one micro-batch; with pp > 1 the 1F1B schedule over gloo p2p). What Megatron's
``finalize_model_grads`` would do with a DDP wrapper is done here by hand:

* data parallel: every rank is given the whole batch; data-parallel rank d trains on
  its contiguous share of the prompt groups, its loss is normalised by the *global*
  token count, and gradients are summed over the data-parallel group;
* tensor parallel: ``q_layernorm``/``k_layernorm`` see only this rank's heads, so their
  gradients are summed over the tensor-parallel group (Megatron does the same for
  ``qk_layernorm``); all other TP communication is inside Megatron's autograd layers;
* pipeline parallel with tied embeddings: the last stage's ``output_layer`` copy and
  the first stage's embedding sum their gradients over the embedding group.

Log-probabilities use the vocabulary-parallel logits as they are: padded vocabulary
columns are set to ``-inf`` and ``tensor_parallel.vocab_parallel_cross_entropy`` does
the TP max/sum-exp reductions, so no rank ever materialises the full vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..integrations.megatron import cpu as megatron_cpu
from ..integrations.megatron import load_canonical
from ..layouts import MegatronOptions, megatron_layout, megatron_padded_vocab
from ..spec.model import ModelSpec
from ..spec.parallel import TrainParallel
from .loss import group_advantages, grpo_loss


@dataclass(frozen=True)
class GrpoConfig:
    """GRPO hyper-parameters, plus the two numerics the ``ModelSpec`` does not carry."""

    lr: float = 5e-3
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # > 0: keep a frozen copy of the initial policy as reference
    group_size: int = 8  # samples per prompt
    prompts_per_step: int = 16
    max_new_tokens: int = 4
    temperature: float = 1.0  # sampling temperature (the trainer scores at temperature 1)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # global-norm clipping; None: off
    advantage_eps: float = 1e-6
    init_std: float = 0.02  # normal(0, init_std) for every matrix; norms 1, biases 0
    rope_theta: float = 10000.0  # must equal the HF config's
    rms_norm_eps: float = 1e-6  # must equal the HF config's


# The layout options of the GPTModel this trainer builds (local spec, float32 parameters,
# Megatron-LM's default vocabulary padding): a refit plan's sources must use exactly these.
TRAINER_LAYOUT_OPTIONS = MegatronOptions(params_dtype="float32")


def init_canonical_weights(spec: ModelSpec, seed: int, std: float) -> dict[str, Tensor]:
    """Seeded float32 canonical tensors (HF names), drawn in checkpoint order."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in spec:
        if t.name.endswith("norm.weight"):
            out[t.name] = torch.ones(t.shape)
        elif len(t.shape) == 1:
            out[t.name] = torch.zeros(t.shape)
        else:
            out[t.name] = torch.randn(t.shape, generator=gen) * std
    return out


def check_trainer_supported(spec: ModelSpec, train: TrainParallel) -> None:
    """Raise ``ValueError`` for a model or parallelism :class:`MegatronPolicyTrainer`
    does not run (MoE, MLA, MTP; virtual pipeline, context or expert parallelism)."""
    a = spec.arch
    if a.moe is not None or a.mla is not None or a.num_mtp_layers:
        raise ValueError("MegatronPolicyTrainer supports dense Llama/Qwen2/Qwen3 models only")
    if train.vpp > 1 or train.cp > 1 or train.ep > 1:
        raise ValueError(
            f"MegatronPolicyTrainer supports tp, pp and dp only (got {train}); virtual "
            "pipeline chunks, context and expert parallelism are not wired up"
        )


class MegatronPolicyTrainer:
    """One training rank of a GRPO policy: its GPTModel chunk, optimizer and loss."""

    def __init__(
        self, spec: ModelSpec, train: TrainParallel, cfg: GrpoConfig, seed: int = 0
    ) -> None:
        """Called on every training rank after torch.distributed is initialised (gloo)
        with world size ``train.world_size``; initialises megatron ``parallel_state`` and
        builds this rank's GPTModel (local spec, float32) from seeded canonical weights,
        plus an Adam optimizer. Same seed -> same canonical weights for any tp/pp/dp.
        The global CPU RNG state is left as it was found."""
        check_trainer_supported(spec, train)
        if dist.get_world_size() != train.world_size:
            raise ValueError(
                f"torch.distributed world size {dist.get_world_size()} != "
                f"training world size {train.world_size} ({train})"
            )
        megatron_cpu.apply_cpu_patches()
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        self.spec, self.train, self.cfg = spec, train, cfg
        self.rank = dist.get_rank()
        rng = torch.get_rng_state()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=train.tp, pipeline_model_parallel_size=train.pp
        )
        # The attention forward forks Megatron's "model-parallel-rng" state even with
        # dropout 0, so the tracker must exist (no dropout: its value never matters).
        model_parallel_cuda_manual_seed(seed)
        self.layout = megatron_layout(spec, train, self.rank, TRAINER_LAYOUT_OPTIONS)
        self.vocab = spec.arch.vocab_size
        self.padded_vocab = megatron_padded_vocab(
            self.vocab, train.tp, TRAINER_LAYOUT_OPTIONS.make_vocab_size_divisible_by
        )
        canonical = init_canonical_weights(spec, seed, cfg.init_std)
        self.model = self._build(canonical)
        # Frozen initial policy for the KL term (a second model is simpler and safer than
        # swapping parameters in and out of Megatron modules).
        self.reference = self._build(canonical).requires_grad_(False) if cfg.kl_coef else None
        torch.set_rng_state(rng)
        self.optimizer = torch.optim.Adam(
            self.model.parameters(),
            lr=cfg.lr,
            betas=cfg.adam_betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )

    # -- construction ---------------------------------------------------------------------
    def _build(self, canonical: dict[str, Tensor]) -> torch.nn.Module:
        arch = self.spec.arch
        config = megatron_cpu.transformer_config(
            arch,
            self.train,
            norm_eps=self.cfg.rms_norm_eps,
            # Kept on although every value is overwritten from `canonical` below: only the
            # initialising path tags TP-sharded weights (`tensor_model_parallel`), which
            # the gradient norm needs. Its RNG draws are undone by the caller.
            perform_initialization=True,
        )
        (model,) = megatron_cpu.build_gpt(
            config,
            arch,
            self.train,
            self.padded_vocab,
            rope_theta=self.cfg.rope_theta,
            max_sequence_length=512,  # used by learned position embeddings only, not rope
        )
        params = dict(model.named_parameters())
        got = {n: tuple(p.shape) for n, p in params.items()}
        want = {t.name: t.shape for t in self.layout.tensors}
        if got != want:
            raise RuntimeError(
                f"rank {self.rank}: GPTModel parameters differ from the Megatron layout: "
                f"model-only {sorted(set(got) - set(want))}, layout-only "
                f"{sorted(set(want) - set(got))}, shapes "
                f"{[(n, got[n], want[n]) for n in got.keys() & want.keys() if got[n] != want[n]]}"
            )
        load_canonical(params, self.layout, canonical)
        return model

    def close(self) -> None:
        """Tear down megatron ``parallel_state`` (to build another trainer in-process)."""
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()

    # -- public interface -----------------------------------------------------------------
    def local_tensors(self) -> dict[str, Tensor]:
        """This rank's live parameters by Megatron layout-provider name."""
        return dict(self.model.named_parameters())

    @torch.no_grad()
    def logprobs(self, tokens: Tensor, prompt_len: int) -> Tensor:
        """float32 [B, N] log-probabilities of ``tokens[:, prompt_len:]`` (temperature 1,
        padded vocabulary excluded); the same on every rank."""
        return self._logprobs(self.model, tokens, prompt_len)

    @torch.no_grad()
    def logits(self, tokens: Tensor) -> Tensor:
        """float32 [B, S, V] logits over the real vocabulary, the same on every rank
        (for sampling with the trainer's own forward in tests and examples)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        def gather(out: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            full = gather_from_tensor_model_parallel_region(out.float())[..., : self.vocab]
            return out.new_zeros(()), {"out": full}

        b, s = tokens.shape
        return self._from_last_stage(
            self._run(self.model, tokens, gather, True), (b, s, self.vocab)
        )

    def train_step(
        self,
        tokens: Tensor,
        prompt_len: int,
        rewards: Tensor,
        old_logprobs: Tensor,
        group_size: int,
    ) -> dict[str, float]:
        """One GRPO optimizer step on the whole batch (every rank passes the same tensors;
        data-parallel ranks each train on their share of the groups)."""
        b, n = tokens.shape[0], tokens.shape[1] - prompt_len
        if rewards.shape != (b,) or old_logprobs.shape != (b, n):
            raise ValueError(
                f"rewards {tuple(rewards.shape)} / old_logprobs {tuple(old_logprobs.shape)} "
                f"do not fit tokens {tuple(tokens.shape)} with prompt_len {prompt_len}"
            )
        rows = self._dp_rows(b, group_size)
        advantages = group_advantages(rewards.float(), group_size, self.cfg.advantage_eps)[rows]
        local = tokens[rows]
        ref = None if self.reference is None else self._logprobs(self.reference, local, prompt_len)
        old = old_logprobs[rows].float()
        mask = torch.ones_like(old)
        num_tokens = float(b * n)  # global: summed DP gradients equal the full-batch one

        def loss_fn(out: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            lp = self._token_logprobs(out, local, prompt_len)
            loss, stats = grpo_loss(
                lp,
                old,
                advantages,
                mask,
                clip_eps=self.cfg.clip_eps,
                kl_coef=self.cfg.kl_coef,
                ref_logprobs=ref,
                num_tokens=num_tokens,
            )
            return loss, {"stats": torch.stack(list(stats.values()))}

        self.optimizer.zero_grad(set_to_none=False)
        store = self._run(self.model, local, loss_fn, False)
        self._reduce_grads()
        grad_norm = self._clip_grads()
        self.optimizer.step()
        stats = self._from_last_stage(store, (5,), key="stats", dp_sum=True)
        pg, kl, clipped, abs_log_ratio, count = stats.tolist()
        return {
            "loss": (pg + self.cfg.kl_coef * kl) / count,
            "reward_mean": float(rewards.float().mean()),
            "kl": kl / count,
            "clip_fraction": clipped / count,
            "grad_norm": grad_norm,
            "logprob_mismatch": abs_log_ratio / count,
        }

    # -- forward plumbing -----------------------------------------------------------------
    def _dp_rows(self, batch: int, group_size: int) -> slice:
        from megatron.core import parallel_state as ps

        dp, groups = self.train.dp, batch // group_size
        if batch % group_size or groups % dp:
            raise ValueError(
                f"batch {batch} must be whole groups of {group_size}, and the {groups} "
                f"groups must split evenly over dp={dp}"
            )
        per = batch // dp
        d = ps.get_data_parallel_rank()
        return slice(d * per, (d + 1) * per)

    def _run(
        self,
        model: torch.nn.Module,
        tokens: Tensor,
        loss_fn: Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]],
        forward_only: bool,
    ) -> list[dict[str, Tensor]]:
        """One micro-batch through megatron's schedule; the last stage's ``loss_fn``
        outputs (an empty list on other stages)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        b, s = tokens.shape
        positions = torch.arange(s).expand(b, s)
        mask = megatron_cpu.causal_mask(s)

        def step(_data: Any, chunk: torch.nn.Module) -> tuple[Tensor, Callable]:
            # Non-first stages ignore input_ids (the schedule sets their input tensor).
            return chunk(tokens, positions, mask), loss_fn

        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=None,
            model=[model],
            num_microbatches=1,
            seq_length=s,
            micro_batch_size=b,
            forward_only=forward_only,
        )

    def _token_logprobs(self, logits: Tensor, tokens: Tensor, prompt_len: int) -> Tensor:
        """[B, N] log-probs of ``tokens[:, prompt_len:]`` from this rank's vocab shard
        ``logits`` [B, S, Vp/tp], padded columns excluded; differentiable."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        shard = logits.shape[-1]
        ids = ps.get_tensor_model_parallel_rank() * shard + torch.arange(shard)
        pred = logits[:, prompt_len - 1 : -1].float().masked_fill(ids >= self.vocab, float("-inf"))
        return -vocab_parallel_cross_entropy(pred, tokens[:, prompt_len:])

    def _logprobs(self, model: torch.nn.Module, tokens: Tensor, prompt_len: int) -> Tensor:
        def score(out: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            return out.new_zeros(()), {"out": self._token_logprobs(out, tokens, prompt_len)}

        with torch.no_grad():
            store = self._run(model, tokens, score, True)
        shape = (tokens.shape[0], tokens.shape[1] - prompt_len)
        return self._from_last_stage(store, shape)

    def _from_last_stage(
        self,
        store: list[dict[str, Tensor]],
        shape: tuple[int, ...],
        key: str = "out",
        dp_sum: bool = False,
    ) -> Tensor:
        """The last stage's ``store[0][key]`` on every rank of this pipeline (summed over
        data-parallel ranks if ``dp_sum``)."""
        from megatron.core import parallel_state as ps

        # contiguous: gloo would broadcast a sliced view's underlying storage layout wrongly
        out = store[0][key].detach().float().contiguous() if store else torch.zeros(shape)
        if self.train.pp > 1:
            dist.broadcast(
                out,
                src=ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
        if dp_sum and self.train.dp > 1:
            dist.all_reduce(out, group=ps.get_data_parallel_group())
        return out

    # -- gradients ------------------------------------------------------------------------
    def _reduce_grads(self) -> None:
        """What ``finalize_model_grads`` does for a DDP-wrapped model, for plain grads."""
        from megatron.core import parallel_state as ps

        named = [(n, p) for n, p in self.model.named_parameters() if p.grad is not None]
        if self.train.dp > 1:
            _all_reduce_flat([p.grad for _, p in named], ps.get_data_parallel_group())
        if self.train.tp > 1:
            qk = [p.grad for n, p in named if "q_layernorm" in n or "k_layernorm" in n]
            _all_reduce_flat(qk, ps.get_tensor_model_parallel_group())
        if (
            self.train.pp > 1
            and self.spec.arch.tie_word_embeddings
            and ps.is_rank_in_embedding_group()
        ):
            weight = self.model.shared_embedding_or_output_weight()
            dist.all_reduce(weight.grad, group=ps.get_embedding_group())

    def _clip_grads(self) -> float:
        """Global L2 norm over unique parameters (TP shards summed, TP-replicated ones and
        the last stage's tied embedding copy counted once); clip to ``max_grad_norm``."""
        from megatron.core import parallel_state as ps

        first_tp = ps.get_tensor_model_parallel_rank() == 0
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.model.parameters():
            if p.grad is None or getattr(p, "shared", False):
                continue
            if getattr(p, "tensor_model_parallel", False) or first_tp:
                sq += p.grad.double().pow(2).sum()
        if self.train.tp * self.train.pp > 1:
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        norm = float(sq.sqrt())
        limit = self.cfg.max_grad_norm
        if limit is not None and norm > limit:
            scale = limit / (norm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm


def _all_reduce_flat(grads: list[Tensor], group: Any) -> None:
    """Sum ``grads`` over ``group`` in one collective (same order on every rank)."""
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sample_completions(
    logits_fn: Callable[[Tensor], Tensor],
    prompts: Tensor,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> Tensor:
    """Autoregressive sampling without a cache: [B, P] prompts -> [B, P + max_new_tokens].
    ``logits_fn`` maps tokens [B, S] to float logits [B, S, V] over the real vocabulary."""
    tokens = prompts
    for _ in range(max_new_tokens):
        last = logits_fn(tokens)[:, -1].double() / temperature
        nxt = torch.multinomial(torch.softmax(last, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens
