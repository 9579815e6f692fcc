"""One draft level's bookkeeping in one launch: score the level, choose the next frontier, gather its inputs.

B sequences, K frontier nodes per level, each with K children (the level's K*K candidates, frontier-major):

    score[b, c]      = front_score[b, c // K] + child_lp[b, c]                       c < K*K
    sel[b, j]        = the j-th best c by score (ties: the lower c), j < K            (the next frontier)
    front_flat[b, j] = offset + sel[b, j]         front_tok[b, j] = child_tok[b, sel]   front_score = score[sel]
    feats[b, j]      = hidden[b*K + sel // K]     (the drafter output at the node's parent: its next input)
    mask_out[b, j]   = mask_in[b, sel // K] ++ onehot(j)    [W + K]: the parent's ancestors, then itself

torch does this as an add, a stable sort, a division, an add and five gathers and a cat (about a dozen
launches a level, each a few microseconds of launch gap inside the captured step). Here one program per
sequence keeps the K*K scores in registers and takes K rounds of max (lowest index on ties, which is what
a stable descending sort then a cut to K gives), copying the chosen rows as it goes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _draft_level_kernel(
    # pointers
    FRONT_SCORE,  # [B, K] f32
    CHILD_LP,  # [B, K*K] f32
    CHILD_TOK,  # [B, K*K] int64
    HIDDEN,  # [B*K, H]
    MASK_IN,  # [B, K, W] uint8
    SCORE,  # [B, K*K] f32 out
    NEXT_FLAT,  # [B, K] int64 out
    NEXT_TOK,  # [B, K] int64 out
    NEXT_SCORE,  # [B, K] f32 out
    FEATS,  # [B, K, H] out
    MASK_OUT,  # [B, K, W + K] uint8 out
    # sizes
    H,
    W,
    offset,
    # meta
    K: tl.constexpr,
    BLOCK_KK: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kk = K * K
    c = tl.arange(0, BLOCK_KK)
    in_level = c < kk
    score = tl.load(FRONT_SCORE + b * K + c // K, mask=in_level, other=0.0) + tl.load(
        CHILD_LP + b * kk + c, mask=in_level, other=0.0
    )
    tl.store(SCORE + b * kk + c, score, mask=in_level)
    taken = c >= kk
    w = tl.arange(0, BLOCK_W)
    h = tl.arange(0, BLOCK_H)
    w_out = W + K
    for j in tl.static_range(K):
        open_score = tl.where(taken, -float("inf"), score)
        best = tl.max(open_score, axis=0)
        at = tl.min(tl.where((open_score == best) & ~taken, c, BLOCK_KK), axis=0)
        taken = taken | (c == at)
        parent = at // K
        tl.store(NEXT_FLAT + b * K + j, offset + at)
        tl.store(NEXT_SCORE + b * K + j, best)
        tl.store(NEXT_TOK + b * K + j, tl.load(CHILD_TOK + b * kk + at))
        row = tl.load(MASK_IN + (b * K + parent) * W + w, mask=w < W, other=0)
        tl.store(MASK_OUT + (b * K + j) * w_out + w, row, mask=w < W)
        tl.store(MASK_OUT + (b * K + j) * w_out + W + w, (w == j).to(tl.uint8), mask=w < K)
        for start in range(0, H, BLOCK_H):
            hh = start + h
            v = tl.load(HIDDEN + (b * K + parent) * H + hh, mask=hh < H)
            tl.store(FEATS + (b * K + j) * H + hh, v, mask=hh < H)


def draft_level(
    front_score: Tensor, child_lp: Tensor, child_tok: Tensor, hidden: Tensor, mask: Tensor, offset: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """front_score [B, K] f32, child_lp / child_tok [B*K, K] (f32 / int64), hidden [B*K, H], mask [B, K, W]
    bool, offset (flat index of the level's first candidate) -> (score [B, K*K], front_flat [B, K],
    front_tok [B, K], front_score [B, K], feats [B, K, H], mask [B, K, W+K] bool). One launch, no sync."""
    b, k = front_score.shape
    h, w = hidden.shape[-1], mask.shape[-1]
    assert child_lp.shape == (b * k, k) and child_tok.shape == (b * k, k), (
        f"child_lp / child_tok must be [B*K, K] = {(b * k, k)}, got {tuple(child_lp.shape)} / {tuple(child_tok.shape)}"
    )
    assert hidden.shape == (b * k, h) and mask.shape == (b, k, w), (
        f"hidden must be [B*K, H], mask [B, K, W]; got {tuple(hidden.shape)}, {tuple(mask.shape)}"
    )
    assert front_score.dtype == child_lp.dtype == torch.float32 and child_tok.dtype == torch.int64
    assert mask.dtype == torch.bool
    front_score, child_lp, child_tok, hidden, mask = (
        t.contiguous() for t in (front_score, child_lp, child_tok, hidden, mask)
    )
    dev = front_score.device
    score = torch.empty(b, k * k, dtype=torch.float32, device=dev)
    flat = torch.empty(b, k, dtype=torch.int64, device=dev)
    tok = torch.empty(b, k, dtype=torch.int64, device=dev)
    best = torch.empty(b, k, dtype=torch.float32, device=dev)
    feats = torch.empty(b, k, h, dtype=hidden.dtype, device=dev)
    mask_out = torch.empty(b, k, w + k, dtype=torch.bool, device=dev)
    _draft_level_kernel[(b,)](
        front_score, child_lp, child_tok, hidden, mask.view(torch.uint8),
        score, flat, tok, best, feats, mask_out.view(torch.uint8),
        h, w, offset,
        K=k, BLOCK_KK=max(16, triton.next_power_of_2(k * k)), BLOCK_W=max(16, triton.next_power_of_2(max(w, k))),
        BLOCK_H=min(1024, triton.next_power_of_2(h)), num_warps=4,
    )  # fmt: skip
    return score, flat, tok, best, feats, mask_out


def draft_level_reference(
    front_score: Tensor, child_lp: Tensor, child_tok: Tensor, hidden: Tensor, mask: Tensor, offset: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The same in torch: a stable descending sort cut to K, and gathers."""
    b, k = front_score.shape
    score = (front_score[:, :, None] + child_lp.view(b, k, k)).view(b, k * k)
    sel = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k]
    parent = sel // k
    tok = child_tok.view(b, k * k).gather(1, sel)
    feats = hidden.view(b, k, -1).gather(1, parent[..., None].expand(-1, -1, hidden.shape[-1]))
    inherited = mask.gather(1, parent[..., None].expand(-1, -1, mask.shape[-1]))
    eye = torch.eye(k, dtype=torch.bool, device=mask.device).expand(b, k, k)
    return score, sel + offset, tok, score.gather(1, sel), feats, torch.cat([inherited, eye], 2)
