"""Training-time test (EAGLE-3 / HASS) for the drafter: pass k of a dense batch feeds row t the previous pass's
prediction at row t-1, and row t attends to what the engine's depth-(k+1) draft from root r = t-k sees: the true
rows up to r, then its own chain (pass m's row r+m for m = 1..k), never other chains. `Drafter.forward_unrolled`
runs it; the drafter's trainer takes its loss over every pass (tlt_rt/train/drafter/loss.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tlt_rt.models.llama import ModelOutput

if TYPE_CHECKING:
    from tlt_rt.models.drafter import Drafter


def forward_unrolled(
    drafter: Drafter,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    segment_ids: torch.Tensor,
    steps: int,
) -> list[tuple[ModelOutput, torch.Tensor]]:
    """Training-time test: `steps` dense passes, pass k being every row's depth-(k+1) draft.

    input_ids [B, T] (x_{t+1}), hidden [B, T, H] input features of pass 0, positions [B, T], segment_ids
    [B, T] (one id per sample, -1 on padding). Pass k >= 1 feeds row t pass k-1's predicted feature at row
    t-1 and lets row t attend to pass-0 keys of rows <= t-k (the true rows up to the root) and to pass m's
    key at row t-k+m for m = 1..k (its own chain). Returns per pass (output, valid [B, T] bool): valid
    where rows t-k .. t are one sample (the chain's root lies in it); other rows are finite but moot.
    Pass 0 is `Drafter.forward` itself (dense causal within each segment).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    layer, attn = drafter.layer, drafter.layer.self_attn
    rot = drafter._rotary(input_ids.device)
    b, t = input_ids.shape
    rows = torch.arange(t, device=input_ids.device)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T(query), T(key)]
    ks, vs, outs = [], [], []
    feed = hidden
    for k in range(steps):
        x = drafter._fuse(input_ids, feed)
        q, key, val = attn._qkv(x, positions, rot)  # [B, T, H, D]
        ks.append(key)
        vs.append(val)
        masks = [same & (rows[None, :] <= rows[:, None] - k)[None]]  # the true rows up to the root
        for m in range(1, k + 1):  # own chain: pass m's row t-k+m (m = k: the row itself)
            diag = rows[None, :] == rows[:, None] - (k - m)
            # the row itself is always a key, so that rows with no valid chain still see something
            masks.append(diag[None].expand_as(same) if m == k else same & diag[None])
        mask = torch.cat(masks, -1)  # [B, T, (k+1) T]
        kk, vv = torch.cat(ks, 1), torch.cat(vs, 1)
        rep = q.shape[2] // kk.shape[2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            kk.repeat_interleave(rep, 2).transpose(1, 2),
            vv.repeat_interleave(rep, 2).transpose(1, 2),
            attn_mask=mask[:, None],
            scale=attn.scale,
        ).transpose(1, 2)
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
