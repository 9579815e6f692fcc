"""Rotary embedding of q and k fused with the paged KV-cache write: one kernel where torch takes four.

For token n at rotary position p_n and every head, with f = p_n * inv_freq (float32, D/2 frequencies) and
x = (x1, x2) the two halves of a head vector (rotate-half convention, HF layout):

    rot(x) = (x1 cos f - x2 sin f,  x2 cos f + x1 sin f)

q_out[n] = rot(q[n]) is returned; rot(k[n]) and v[n] are stored at cache slot slots[n] of k_cache / v_cache
([num_blocks, page, Hkv, D], a slot is block * page + row). Slots must be resolved already (no -1: see
`tlt_rt.models.attention.resolve_slots`). Arithmetic in float32, rounded once to the output dtype, as
`tlt_rt.models.arch.rotate_pair` does; the reference is that function plus `write_kv`. One program per
(token, KV head) rotates that KV head's k, copies its v and rotates the query heads that share it, so a
one-token decode still spreads over Hkv programs; q / k / v may be strided views of a fused projection
(unit stride along D).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tlt_rt.models.arch import rotate_pair
from tlt_rt.models.attention import write_kv

__all__ = ["rope_write_kv", "rope_write_kv_reference"]


@triton.jit
def _rope_write_kernel(
    Q, K, V, POS, INV_FREQ, K_CACHE, V_CACHE, SLOTS, Q_OUT,
    group, half,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ks, stride_kch, stride_vs, stride_vch, stride_on, stride_oh,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < half
    ang = tl.load(POS + n).to(tl.float32) * tl.load(INV_FREQ + d, mask=d_ok, other=0.0)
    c = tl.cos(ang)[None, :]
    s = tl.sin(ang)[None, :]

    offs_g = tl.arange(0, BLOCK_G)
    h = kv * group + offs_g
    ok = (offs_g < group)[:, None] & d_ok[None, :]
    src = Q + n * stride_qn + h[:, None] * stride_qh + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=ok, other=0.0).to(tl.float32)
    dst = Q_OUT + n * stride_on + h[:, None] * stride_oh + d[None, :]
    tl.store(dst, (x1 * c - x2 * s).to(Q_OUT.dtype.element_ty), mask=ok)
    tl.store(dst + half, (x2 * c + x1 * s).to(Q_OUT.dtype.element_ty), mask=ok)

    slot = tl.load(SLOTS + n).to(tl.int64)
    ok = d_ok[None, :]
    g = tl.full([1], 0, tl.int64) + kv
    src = K + n * stride_kn + g[:, None] * stride_kh + d[None, :]
    # rounded to k's dtype first, as the reference rotates in k's dtype and then casts to the cache's
    k1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    k2 = tl.load(src + half, mask=ok, other=0.0).to(tl.float32)
    r1 = (k1 * c - k2 * s).to(K.dtype.element_ty).to(K_CACHE.dtype.element_ty)
    r2 = (k2 * c + k1 * s).to(K.dtype.element_ty).to(K_CACHE.dtype.element_ty)
    dst = K_CACHE + slot * stride_ks + g[:, None] * stride_kch + d[None, :]
    tl.store(dst, r1, mask=ok)
    tl.store(dst + half, r2, mask=ok)
    src = V + n * stride_vn + g[:, None] * stride_vh + d[None, :]
    dst = V_CACHE + slot * stride_vs + g[:, None] * stride_vch + d[None, :]
    tl.store(dst, tl.load(src, mask=ok, other=0.0).to(V_CACHE.dtype.element_ty), mask=ok)
    tl.store(dst + half, tl.load(src + half, mask=ok, other=0.0).to(V_CACHE.dtype.element_ty), mask=ok)


def rope_write_kv_reference(q, k, v, positions, inv_freq, k_cache, v_cache, slots) -> torch.Tensor:
    """What the kernel computes, in torch: rotate q and k, write k and v at `slots`; returns rotated q."""
    q, k = rotate_pair(q, k, positions, inv_freq)
    write_kv(k, v, k_cache, v_cache, slots, resolved=True)
    return q


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """q [N, Hq, D], k / v [N, Hkv, D] (unit stride along D), positions / slots [N] -> rotated q [N, Hq, D];
    rotated k and v land in the paged caches [num_blocks, page, Hkv, D] at `slots` (no -1)."""
    n, n_heads, dim = q.shape
    n_kv = k.shape[1]
    if (
        dim % 2
        or n_heads % n_kv
        or k.shape != (n, n_kv, dim)
        or v.shape != k.shape
        or k_cache.shape[-2:] != (n_kv, dim)
    ):
        raise ValueError(
            f"rope_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cache "
            f"{tuple(k_cache.shape)} do not fit [N, Hq, D], [N, Hkv, D] with an even D"
        )
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)) or positions.shape != (n,) or slots.shape != (n,):
        raise ValueError("rope_write_kv needs unit stride along D and positions / slots of shape [N]")
    if n > 1 and (positions.stride(0) != 1 or slots.stride(0) != 1):
        raise ValueError(f"rope_write_kv reads positions / slots contiguous, got strides "
                         f"{positions.stride()} / {slots.stride()}")  # fmt: skip
    if inv_freq.dtype != torch.float32 or inv_freq.numel() != dim // 2:
        raise ValueError(f"inv_freq must be float32 [{dim // 2}], got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    nb, page = k_cache.shape[:2]
    kc, vc = k_cache.view(nb * page, n_kv, dim), v_cache.view(nb * page, n_kv, dim)
    out = torch.empty((n, n_heads, dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    _rope_write_kernel[(n, n_kv)](
        q, k, v, positions, inv_freq, kc, vc, slots, out,
        n_heads // n_kv, dim // 2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), out.stride(0), out.stride(1),
        BLOCK_G=triton.next_power_of_2(n_heads // n_kv), BLOCK_D=triton.next_power_of_2(dim // 2), num_warps=2,
    )  # fmt: skip
    return out
