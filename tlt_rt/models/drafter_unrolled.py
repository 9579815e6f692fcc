"""Training-time test (EAGLE-3 / HASS) for the drafter: pass k of a dense batch feeds row t the previous pass's
prediction at row t-1, and row t attends to what the engine's depth-(k+1) draft from root r = t-k sees: the true
rows up to r, then its own chain (pass m's row r+m for m = 1..k), never other chains. `Drafter.forward_unrolled`
runs it; the drafter's trainer takes its loss over every pass (tlt_rt/train/drafter/loss.py).

A packed training row holds many samples (8,192 tokens of ~600-token answers on a GPU), and a row sees only its
own sample's rows, so attention runs over bands: the row cut into blocks of `block` queries, each block against the
keys that lie at most one sample's length behind its first row. Pass k then costs (k + 1) x T x (band) instead of
(k + 1) x T x T: the passes' quadratic cost is what made more than three of them dear.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tlt_rt.models.llama import ModelOutput
from tlt_rt.models.packed_attention import masked_attention

if TYPE_CHECKING:
    from tlt_rt.models.drafter import Drafter

BAND_BLOCK = 128  # queries a band holds (0: one dense mask over the whole row)


def longest_sample(segment_ids: torch.Tensor) -> int:
    """The most rows one sample (a run of one id >= 0) spans in any row of `segment_ids` [B, T]; padding (-1)
    counts as runs of one. One host sync."""
    b, t = segment_ids.shape
    pos = torch.arange(b * t, device=segment_ids.device).view(b, t)
    # padding rows get ids of their own; the row index keeps runs from joining across rows
    key = torch.where(segment_ids >= 0, segment_ids.long(), -2 - pos) * b + torch.arange(b, device=pos.device)[:, None]
    return int(torch.unique_consecutive(key.flatten(), return_counts=True)[1].max())


def _windows(x: torch.Tensor, back: int, block: int, padded: int, fill) -> torch.Tensor:
    """[B, T, ...] -> [B, nb, back + block, ...]: window i holds rows i*block - back .. (i+1)*block - 1, `fill`
    outside 0 .. T-1."""
    b, t = x.shape[:2]
    left = x.new_full((b, back, *x.shape[2:]), fill)
    right = x.new_full((b, padded - t, *x.shape[2:]), fill)
    return torch.cat([left, x, right], 1).unfold(1, back + block, block).movedim(-1, 2)


def chain_attention(q, ks, vs, segment_ids, scale: float, block: int = BAND_BLOCK, longest: int | None = None):
    """Pass k = len(ks) - 1's attention: q [B, T, Hq, D], ks / vs pass m's keys / values [B, T, Hk, D]; row t
    sees pass 0's rows of its sample up to t - k, pass m's row t - k + m (0 < m < k) of its sample, and itself
    in pass k. `block` > 0 runs it in bands of that many queries (`longest`: `longest_sample`, else computed);
    0, or a band no shorter than the row, runs one dense [T, (k + 1) T] mask."""
    b, t = segment_ids.shape
    k = len(ks) - 1
    if block > 0:
        longest = longest_sample(segment_ids) if longest is None else longest
        back = -(-(longest - 1) // block) * block
        padded = -(-t // block) * block
        if back + block < padded:
            return _banded(q, ks, vs, segment_ids, scale, block, back, padded)
    rows = torch.arange(t, device=q.device)
    d = rows[None, :] - rows[:, None]  # key row - query row
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T(query), T(key)]
    masks = [_pass_mask(same, d, k, m) for m in range(k + 1)]
    return masked_attention(q, torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(masks, -1), scale)


def _pass_mask(same: torch.Tensor, d: torch.Tensor, k: int, m: int) -> torch.Tensor:
    """Which of pass m's keys pass k's queries see, from `same` [..., Tq, Tk] and key - query offsets `d`."""
    if m == 0:
        return same & (d <= -k)  # the true rows up to the root
    if m < k:
        return same & (d == m - k)  # the chain: pass m's row t - k + m
    # the row itself is always a key, so that rows with no valid chain still see something
    return (d == 0).expand_as(same)


def _banded(q, ks, vs, segment_ids, scale, block, back, padded):
    b, t, hq, dim = q.shape
    k, nb, span = len(ks) - 1, padded // block, back + block
    qb = torch.cat([q, q.new_zeros(b, padded - t, hq, dim)], 1).view(b * nb, block, hq, dim)
    keys = torch.cat([_windows(x, back, block, padded, 0.0) for x in ks], 2).flatten(0, 1)
    vals = torch.cat([_windows(x, back, block, padded, 0.0) for x in vs], 2).flatten(0, 1)
    seg_q = torch.cat([segment_ids, segment_ids.new_full((b, padded - t), -2)], 1).view(b, nb, block)
    seg_k = _windows(segment_ids, back, block, padded, -2)  # [B, nb, span]; -2 outside the row
    same = seg_q[..., :, None] == seg_k[..., None, :]  # [B, nb, block, span]
    rows = torch.arange(block, device=q.device)
    d = torch.arange(span, device=q.device)[None, :] - back - rows[:, None]  # key - query, the same in every band
    mask = torch.cat([_pass_mask(same, d, k, m) for m in range(k + 1)], -1).flatten(0, 1)
    out = masked_attention(qb, keys, vals, mask, scale)
    # reshape: SDPA's math kernel returns heads-major memory, which no view can regroup into rows
    return out.reshape(b, padded, hq, dim)[:, :t]


def forward_unrolled(
    drafter: Drafter,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    segment_ids: torch.Tensor,
    steps: int,
    block: int = BAND_BLOCK,
) -> list[tuple[ModelOutput, torch.Tensor]]:
    """Training-time test: `steps` dense passes, pass k being every row's depth-(k+1) draft.

    input_ids [B, T] (x_{t+1}), hidden [B, T, H] input features of pass 0, positions [B, T], segment_ids
    [B, T] (one id per sample, -1 on padding). Pass k >= 1 feeds row t pass k-1's predicted feature at row
    t-1 and lets row t attend to pass-0 keys of rows <= t-k (the true rows up to the root) and to pass m's
    key at row t-k+m for m = 1..k (its own chain). Returns per pass (output, valid [B, T] bool): valid
    where rows t-k .. t are one sample (the chain's root lies in it); other rows are finite but moot.
    Pass 0 is `Drafter.forward` itself (dense causal within each segment). `block`: `chain_attention`'s.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    layer, attn = drafter.layer, drafter.layer.self_attn
    rot = drafter._rotary(input_ids.device)
    b, t = input_ids.shape
    longest = longest_sample(segment_ids) if block > 0 else None
    ks, vs, outs = [], [], []
    feed = hidden
    for k in range(steps):
        x = drafter._fuse(input_ids, feed)
        q, key, val = attn._qkv(x, positions, rot)  # [B, T, H, D]
        ks.append(key)
        vs.append(val)
        out = chain_attention(q, ks, vs, segment_ids, attn.scale, block, longest)
        h = x + attn.o_proj(out.flatten(-2))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        valid = segment_ids >= 0
        if k > 0:
            valid = valid & torch.cat(
                [torch.zeros(b, k, dtype=torch.bool, device=h.device), segment_ids[:, k:] == segment_ids[:, :-k]],
                1,
            )
        outs.append((ModelOutput(logits=drafter.logits(h), hidden=h), valid))
        if k + 1 < steps:
            feed = torch.cat([feed[:, :1], h[:, :-1].to(feed.dtype)], 1)
    return outs
