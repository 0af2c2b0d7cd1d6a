"""GRPO objective as pure tensor functions (no process groups, no model).

* :func:`group_advantages`: each prompt is sampled ``G`` times (contiguous rows); a
  sample's advantage is its reward relative to its own group,
  ``(r - mean_g) / (std_g + eps)`` with the unbiased (Bessel) standard deviation, as
  in DeepSeekMath's GRPO and TRL. A group whose rewards are all equal gets 0.
* :func:`grpo_loss`: the PPO clipped-ratio surrogate per completion token, plus an
  optional KL penalty to a reference policy with Schulman's k3 estimator
  ``exp(ref - lp) - (ref - lp) - 1`` (unbiased, always >= 0), averaged over the
  unmasked tokens (token-level mean, so long and short completions weigh by tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """``rewards`` [n·G] (the G samples of one prompt contiguous) -> advantages [n·G]."""
    if rewards.dim() != 1 or group_size < 2 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} cannot be cut into groups of "
            f"{group_size} (need a 1-D tensor, a multiple of group_size >= 2)"
        )
    groups = rewards.double().view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)  # unbiased, like torch.std / TRL
    return ((groups - mean) / (std + eps)).flatten().to(rewards.dtype)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference) from sampled-token logprobs."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    kl_coef: float = 0.0,
    ref_logprobs: Tensor | None = None,
    num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO loss of completion tokens and detached per-token *sums* for metrics.

    ``logprobs`` (current policy, with grad), ``old_logprobs`` (the sampler's),
    ``ref_logprobs``: [B, N]; ``advantages``: [B] (one per completion); ``mask``: [B, N],
    1 for tokens that count. The loss is ``sum(mask · token_loss) / num_tokens``;
    ``num_tokens`` defaults to ``mask.sum()`` — pass the global count when the batch is
    split over data-parallel ranks, so that summing their gradients gives the full-batch
    gradient. Returned sums: ``pg`` (surrogate), ``kl``, ``clipped`` (tokens whose
    clipped term won the min, i.e. got no gradient), ``abs_log_ratio`` (``|lp - old|``,
    trainer/sampler mismatch), ``tokens``.
    """
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype)[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    pg = -torch.minimum(unclipped, clipped)
    token_loss = pg
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)
        if kl_coef:
            token_loss = token_loss + kl_coef * kl
    denom = float(mask.sum()) if num_tokens is None else float(num_tokens)
    loss = (token_loss * mask).sum() / max(denom, 1.0)
    with torch.no_grad():
        stats = {
            "pg": (pg * mask).sum(),
            "kl": (kl * mask).sum(),
            "clipped": ((clipped < unclipped).to(mask.dtype) * mask).sum(),
            "abs_log_ratio": (log_ratio.abs() * mask).sum(),
            "tokens": mask.sum(),
        }
    return loss, stats
