"""GRPO pieces as small functions: group advantages, dropped groups, the clipped loss, the k3 KL.

Shapes: rewards are [G, N] (G prompt groups of N responses each); per-token tensors are [B, T] with a
0/1 `mask` marking response tokens (padding and prompt positions are 0).

The loss takes optional global normalisers (`num_tokens`, `num_seqs`) so that a batch split into
micro-batches and over data-parallel workers sums to exactly the loss of the whole batch: each part
returns sum(part) / global count, and summing gradients over parts gives the full-batch gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """[G, N] rewards -> [G, N] advantages (r - group mean) / (group std + eps), or r - mean without std.

    The std is the unbiased one (Bessel), as in the DeepSeekMath GRPO write-up and TRL.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, group_size >= 2], got shape {tuple(rewards.shape)}")
    r = rewards.float()
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv


def equal_reward_groups(rewards: Tensor) -> Tensor:
    """[G, N] -> [G] bool, True where every reward of the group is the same (zero advantage, no signal)."""
    return (rewards == rewards[:, :1]).all(dim=1)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(policy || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


@dataclass
class LossStats:
    """Sums over the tokens (or sequences) of one call; the caller divides by its global counts."""

    tokens: float
    clipped_low: float  # tokens whose ratio was clipped below (negative advantage, ratio < 1 - clip_low)
    clipped_high: float  # tokens whose ratio was clipped above (positive advantage, ratio > 1 + clip_high)
    ratio_sum: float
    kl_sum: float


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    agg: str = "token",
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    host_stats: bool = True,
) -> tuple[Tensor, LossStats]:
    """Clipped policy-gradient loss with separate low/high clip (DAPO clip-higher).

    logp, old_logp, mask: [B, T]; advantages: [B] (one per response) or [B, T].
    Per token: -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3(logp, ref_logp),
    r = exp(logp - old_logp). Aggregation:
      'token'    sum over all tokens / num_tokens (default: tokens in this batch)
      'sequence' sum over responses of (mean over the response's tokens) / num_seqs (default: B)
    `host_stats=False` leaves the stats as 0-dim device tensors: reading them as floats waits for the forward,
    which a learner that sums them on the device over its micro-batches need not do.
    """
    if agg not in ("token", "sequence"):
        raise ValueError(f"agg must be 'token' or 'sequence', got {agg!r}")
    mask = mask.to(logp.dtype)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    adv = adv.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    kl = None
    if ref_logp is not None and kl_coef > 0:
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + kl_coef * kl
    per_token = per_token * mask
    if agg == "token":
        denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=logp.dtype)
        loss = per_token.sum() / denom.clamp_min(1)
    else:
        lengths = mask.sum(dim=1).clamp_min(1)
        denom = mask.shape[0] if num_seqs is None else num_seqs
        loss = (per_token.sum(dim=1) / lengths).sum() / max(float(denom), 1.0)
    with torch.no_grad():
        m = mask.bool()
        low, high = (ratio < 1 - clip_low) & (adv < 0) & m, (ratio > 1 + clip_high) & (adv > 0) & m
        kl_sum = (kl * mask).sum() if kl is not None else mask.new_zeros(())
        sums = [m.sum(), low.sum(), high.sum(), (ratio * mask).sum(), kl_sum]
        stats = LossStats(*(float(x) if host_stats else x.detach().double() for x in sums))
    return loss, stats


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, keep: Tensor | None = None) -> Tensor:
    """log p(target) under softmax(logits / temperature), restricted to `keep` when given.

    logits [B, T, V], targets [B, T] -> [B, T] float32. `keep` [B, T, V] bool is the sampler's top-k/top-p
    kept set: the rollout sampled from the renormalised filtered distribution, so the learner's
    log-probs must be taken under the same one for the importance ratio to start at 1.
    """
    z = logits.float()
    if temperature > 0:
        z = z / temperature
    if keep is not None:
        z = z.masked_fill(~keep, float("-inf"))
    logz = torch.logsumexp(z, dim=-1)
    return z.gather(-1, targets[..., None]).squeeze(-1) - logz
