"""The drafter's training loss (EAGLE): feature regression plus next-token cross-entropy.

    f_t        = target.norm(h_t)                                   target features [N, H]
    pred, z    = drafter(x_{t+1}, f_t + noise)                      predicted f_{t+1}, draft logits
    p          = softmax(lm_head(f_{t+1}))                          the target's next-token distribution
    hidden     = mean_t SmoothL1(pred_t, f_{t+1})                   (mean over H, then over real rows)
    token      = mean_t -sum_v p_v log softmax(z)_v
    loss       = 1.0 * hidden + 0.1 * token                          (EAGLE's published weights)

Unrolled steps (`unroll` = U > 1, "training-time test" as in HASS / EAGLE-3): at draft time depth d >= 2
feeds the drafter its own output, which teacher forcing never shows it. Pass k = 2..U feeds row t the
previous pass's prediction of row t-1, so row t of pass k is the depth-k draft from root row t-k+1.
`unroll_context="chain"` (default) gives that row exactly the engine's attention context
(`Drafter.forward_unrolled`: the true rows up to the root, then its own chain) and counts only rows whose
root lies in the same sample; "shifted" is the older approximation (every row of pass k attends to pass k's
rows, a sample's first row keeps its true feature). Pass k's loss is added with weight
UNROLL_DECAY^(k-1), and the sum is divided by the weights' sum so the loss scale does not depend on U.
Metrics are pass 1's.

Targets at the sampling temperature: `temperature` T scales the target's logits before the softmax (the
distribution the rollout samples from, which a perfect drafter's tree would rank by); T = 0 gives one-hot
targets on the target's argmax (greedy decoding). `sampled_weight` adds a cross-entropy on the token the
rollout actually drew next (x_{t+2}; rows without one, or whose token lies outside a reduced draft
vocabulary, count nowhere there).

With a reduced draft vocabulary both distributions live on the draft ids (the target's restricted to them
and renormalised). Rows where `loss_mask` is False (padding of packed rows) count nowhere. Top-1
agreement is how often the drafter's argmax, mapped to a target id, equals the target's own argmax. With a
reduced draft vocabulary that argmax is over the target's whole vocabulary, a [rows x vocab] product the
loss has no other use for (13% of the warm-up's 1,024-token CPU step with an 8,192-id head, RESULTS.md), so
it is taken at up to TOP1_ROWS of the batch's loss rows (`metric_rows`): the agreement there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tlt_rt.models.drafter import Drafter
from tlt_rt.train.drafter.data import DrafterBatch

HIDDEN_WEIGHT = 1.0
TOKEN_WEIGHT = 0.1
UNROLL_DECAY = 0.8
UNROLL_CONTEXTS = ("chain", "shifted")
TOP1_ROWS = 256  # loss rows per batch at which a reduced-vocabulary top-1 takes the target's full argmax
_GOLDEN = 0.6180339887498949


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, carries the gradient
    hidden_loss: torch.Tensor  # scalar, detached
    token_loss: torch.Tensor  # scalar, detached
    top1: torch.Tensor  # scalar in [0, 1], detached
    num_tokens: int


def add_noise(x: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """x + N(0, std^2) noise, drawn from `generator` so that runs repeat exactly."""
    if std <= 0:
        return x
    noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return x + (noise * std).to(x.dtype)


def drafter_loss(
    pred_hidden: torch.Tensor,
    pred_logits: torch.Tensor,
    target_feature: torch.Tensor,
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden_weight: float = HIDDEN_WEIGHT,
    token_weight: float = TOKEN_WEIGHT,
    target_top1: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    temperature: float = 1.0,
    sampled_labels: torch.Tensor | None = None,
    sampled_weight: float = 0.0,
    num_tokens: int | None = None,
) -> LossOutput:
    """Weighted SmoothL1 + soft cross-entropy over the rows where `loss_mask` [...] is True.

    pred_hidden / target_feature [..., H]; pred_logits / target_logits [..., Vd] on the same (draft) vocab.
    The soft targets are softmax(target_logits / temperature), one-hot on the argmax at temperature 0.
    `sampled_labels` [...] draft ids of the tokens actually drawn next (-1: none), weighted `sampled_weight`.
    `target_top1` [...] is the target's argmax over its full vocabulary (default: argmax of target_logits),
    -1 at rows the agreement leaves out; `d2t` [Vd] maps draft ids to target ids for the agreement metric.
    `num_tokens`: the True rows of `loss_mask` where the caller knows them (None: counted, a host sync on a GPU).
    """
    m = loss_mask.to(torch.float32)
    n = m.sum().clamp(min=1.0)
    hidden = F.smooth_l1_loss(pred_hidden.float(), target_feature.float(), reduction="none").mean(-1)
    logq = torch.log_softmax(pred_logits.float(), -1)
    if temperature > 0:
        p = torch.softmax(target_logits.float() / temperature, -1)
        token = -(p * logq).sum(-1)
    else:
        token = -logq.gather(-1, target_logits.argmax(-1, keepdim=True)).squeeze(-1)
    hidden_loss = (hidden * m).sum() / n
    token_loss = (token * m).sum() / n
    extra = 0.0
    if sampled_labels is not None and sampled_weight > 0:
        ms = m * (sampled_labels >= 0).float()
        nll = -logq.gather(-1, sampled_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        extra = sampled_weight * (nll * ms).sum() / ms.sum().clamp(min=1.0)
    draft_top1 = pred_logits.argmax(-1)
    if d2t is not None:
        draft_top1 = d2t.to(draft_top1.device)[draft_top1]
    if target_top1 is None:
        target_top1 = target_logits.argmax(-1) if d2t is None else d2t.to(draft_top1.device)[target_logits.argmax(-1)]
    checked = m * (target_top1 >= 0).float()  # -1: a row whose target argmax was not taken (`metric_rows`)
    top1 = ((draft_top1 == target_top1).float() * checked).sum() / checked.sum().clamp(min=1.0)
    loss = hidden_weight * hidden_loss + token_weight * token_loss + extra
    n_rows = int(loss_mask.sum()) if num_tokens is None else num_tokens
    return LossOutput(loss, hidden_loss.detach(), token_loss.detach(), top1.detach(), n_rows)


def metric_rows(mask: torch.Tensor, rows: int = TOP1_ROWS) -> torch.Tensor:
    """Flat indices of `rows` positions of `mask` [...] (all of them if it has fewer): its True positions
    first, spread over the batch in a fixed low-discrepancy order. No random draw (the trainer's generator,
    and so a resumed run, is untouched) and no host sync."""
    flat = mask.flatten()
    n = flat.numel()
    if n <= rows:
        return torch.arange(n, device=flat.device)
    spread = torch.frac(torch.arange(n, device=flat.device, dtype=torch.float64) * _GOLDEN)
    return torch.argsort(spread + (~flat).double())[:rows]  # True positions' keys in [0, 1), False in [1, 2)


def full_vocab_top1(drafter: Drafter, feature: torch.Tensor, mask: torch.Tensor, rows: int = TOP1_ROWS):
    """[...] the target's argmax over its whole vocabulary from `feature` [..., H] at `metric_rows(mask)`,
    -1 elsewhere."""
    w = drafter.lm_head.weight.detach()
    idx = metric_rows(mask, rows)
    out = torch.full(mask.shape, -1, dtype=torch.long, device=feature.device)
    out.view(-1)[idx] = F.linear(feature.reshape(-1, feature.shape[-1])[idx].to(w.dtype), w).argmax(-1)
    return out


def sampled_next(batch: DrafterBatch, t2d: torch.Tensor | None = None) -> torch.Tensor:
    """[R, T] the token drawn after row t's target (x_{t+2} = input_ids[t+1] of the same sample), as a draft id
    through `t2d` [V]; -1 on a sample's last row, on padding and outside the draft vocabulary."""
    seg, ids = batch.segment_ids, batch.input_ids
    nxt = torch.full_like(ids, -1)
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
    nxt[:, :-1] = torch.where(same, ids[:, 1:], -1)
    if t2d is not None:
        nxt = torch.where(nxt >= 0, t2d.to(nxt.device)[nxt.clamp(min=0)], -1)
    return nxt


def batch_loss(
    drafter: Drafter,
    batch: DrafterBatch,
    hidden_weight: float = HIDDEN_WEIGHT,
    token_weight: float = TOKEN_WEIGHT,
    noise_std: float = 0.0,
    generator: torch.Generator | None = None,
    unroll: int = 1,
    *,
    temperature: float = 1.0,
    sampled_weight: float = 0.0,
    unroll_context: str = "chain",
) -> LossOutput:
    """Run the drafter on one (packed) batch already on its device and score it against the target
    (`unroll` passes, each fed the previous pass's predictions shifted by one row; module docstring)."""
    if unroll_context not in UNROLL_CONTEXTS:
        raise ValueError(f"unroll_context must be one of {UNROLL_CONTEXTS}, got {unroll_context!r}")
    # the input features carry gradients when the drafter fuses several target layers (its `fuse` trains)
    with torch.set_grad_enabled(torch.is_grad_enabled() and drafter.fuse is not None):
        inp = drafter.features(batch.hidden)
    with torch.no_grad():
        tgt = drafter.target_features(batch.target_hidden)
        target_logits = drafter.logits(tgt)
        target_top1 = None
        if drafter.d2t is not None:  # the metric compares with the target's argmax over its whole vocabulary
            target_top1 = full_vocab_top1(drafter, tgt, batch.loss_mask)
        labels = None
        if sampled_weight > 0:
            labels = sampled_next(batch, drafter.t2d() if drafter.d2t is not None else None)
    # block-diagonal attention only where a row holds several samples; right padding needs no mask (causal)
    seg = batch.segment_ids
    shared = batch.shared_rows
    if shared is None:
        shared = bool(((seg[:, 1:] != seg[:, :-1]) & (seg[:, 1:] >= 0)).any())
    segments = seg if shared else None
    feed = add_noise(inp, noise_std, generator)
    rows = batch.num_tokens  # pass 1's rows: loss_mask's (known on the host where the batch was packed)

    def score(out, mask, n=None):
        return drafter_loss(
            out.hidden,
            out.logits,
            tgt,
            target_logits,
            mask,
            hidden_weight,
            token_weight,
            target_top1,
            drafter.d2t,
            temperature,
            labels,
            sampled_weight,
            n,
        )

    if unroll > 1 and unroll_context == "chain":
        # pass 1's rows are loss_mask's; the later passes' counts are never read (their losses join pass 1's)
        results = [score(out, batch.loss_mask & valid, rows if k == 0 else 0) for k, (out, valid) in enumerate(
            drafter.forward_unrolled(batch.input_ids, feed, batch.positions, seg, unroll)
        )]  # fmt: skip
    else:
        # follows[r, t]: row t-1 is the same sample's previous row, whose prediction row t can be fed
        follows = torch.zeros_like(seg, dtype=torch.bool)
        follows[:, 1:] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
        results = []
        for k in range(unroll):
            out = drafter(batch.input_ids, feed, batch.positions, segments)
            results.append(score(out, batch.loss_mask, rows))
            if k + 1 < unroll:
                shifted = torch.cat([feed[:, :1], out.hidden[:, :-1].to(feed.dtype)], 1)
                feed = torch.where(follows[..., None], shifted, inp.to(feed.dtype))
    weights = [UNROLL_DECAY**k for k in range(len(results))]
    first = results[0]
    first.loss = sum(r.loss * w for r, w in zip(results, weights, strict=True)) / sum(weights)
    return first
