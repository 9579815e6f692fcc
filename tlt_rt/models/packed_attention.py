"""Packed (block-diagonal causal) attention for training: several samples back to back in one row, each token
seeing only earlier tokens of its own sample. xformers' block-diagonal kernel where it works here, else SDPA
with a boolean mask; the drafter's dense training forward runs through it (`Drafter.forward(segment_ids=...)`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PackedAttn = str  # "auto" | "xformers" | "sdpa"


def segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] segment ids -> [B, T, T] bool: same segment and key <= query (block-diagonal causal)."""
    t = segment_ids.shape[-1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return same & torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()


def masked_attention(q, k, v, mask, scale):
    """SDPA over q [N, Tq, Hq, D] and k / v [N, Tk, Hkv, D] where `mask` [N, Tq, Tk] is True -> [N, Tq, Hq, D]."""
    rep = q.shape[2] // k.shape[2]
    # K/V heads expanded here rather than enable_gqa: with a mask, SDPA's fused kernel takes no GQA and
    # would fall back to the (much slower) math path
    qt, kt, vt = (
        q.transpose(1, 2),
        k.repeat_interleave(rep, 2).transpose(1, 2),
        v.repeat_interleave(rep, 2).transpose(1, 2),
    )
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)


def _sdpa_packed(q, k, v, scale, segment_ids):
    return masked_attention(q, k, v, segment_mask(segment_ids), scale)


def _run_lengths(segment_ids: torch.Tensor) -> list[int]:
    """Lengths of the runs of equal ids in row-major order, a row end always closing a run."""
    b, t = segment_ids.shape
    key = segment_ids.long() + torch.arange(b, device=segment_ids.device).view(b, 1) * (segment_ids.max() + 2)
    return torch.unique_consecutive(key.flatten(), return_counts=True)[1].tolist()


def _xformers_packed(q, k, v, scale, segment_ids):
    from xformers.ops import fmha, memory_efficient_attention  # local: optional extra (tlt_rt[xformers])

    b, t, hq, d = q.shape
    rep = hq // k.shape[2]
    bias = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens(_run_lengths(segment_ids))
    # every row's segments become one long batch-1 sequence: [1, B*T, H, D]
    kf = k.repeat_interleave(rep, dim=2).reshape(1, b * t, hq, d)
    vf = v.repeat_interleave(rep, dim=2).reshape(1, b * t, hq, d)
    out = memory_efficient_attention(q.reshape(1, b * t, hq, d), kf, vf, attn_bias=bias, scale=scale)
    return out.view(b, t, hq, d)


@functools.cache
def xformers_works(device_type: str, dtype: torch.dtype = torch.float32) -> bool:
    """True when xformers imports AND its kernel runs a tiny packed call on this device type and dtype.

    Some installs import fine but fail when a kernel loads, so this tries once instead of trusting the import.
    """
    try:
        x = torch.randn(1, 8, 2, 16, device=device_type, dtype=dtype)
        seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], device=device_type)
        got = _xformers_packed(x, x, x, 0.25, seg)
        return bool(torch.allclose(got.float(), _sdpa_packed(x, x, x, 0.25, seg).float(), atol=2e-2, rtol=2e-2))
    except Exception:  # ImportError, missing kernels, unsupported device: all mean "use our path"
        return False


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    segment_ids: torch.Tensor,
    impl: PackedAttn = "auto",
) -> torch.Tensor:
    """q [B, T, Hq, D], k/v [B, T, Hkv, D], segment_ids [B, T] -> [B, T, Hq, D], attention block-diagonal causal.

    Each row holds several samples back to back; a token sees only earlier tokens of its own segment.
    Segments must be contiguous runs within a row. `impl`: "xformers", "sdpa" or "auto" (xformers when it
    works here, else SDPA with a boolean block-diagonal mask).
    """
    if impl not in ("auto", "xformers", "sdpa"):
        raise ValueError(f"packed attention impl must be 'auto', 'xformers' or 'sdpa', got {impl!r}")
    if impl == "xformers" or (impl == "auto" and xformers_works(q.device.type, q.dtype)):
        return _xformers_packed(q, k, v, scale, segment_ids)
    return _sdpa_packed(q, k, v, scale, segment_ids)
