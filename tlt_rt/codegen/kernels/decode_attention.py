"""Paged decode attention: one new query token per sequence over its paged KV cache, split-K.

For sequence b, query head h (KV head kv = h // group) and its L = seq_lens[b] cached positions
(the new token's own K/V sits at position L - 1):

    out[b, h] = sum_p softmax_p(scale * q[b, h] . K[b, p, kv]) V[b, p, kv],   0 <= p < L

with K[b, p] read from slot block_tables[b, p // page] * page + p % page.

Split-K: each context is cut into `num_splits` chunks of whole BLOCK_N tiles, sized on the device from the
sequence's own length (chunk = ceil(L / num_splits) rounded up to a tile), so the work spreads over the
splits whatever the block table's capacity, and a graph captured once serves every length. Program
(b, kv, s) reads chunk s once for all `group` query heads of KV head kv and writes the chunk's normalised partial output
o_s and its log-sum-exp lse_s (base 2); `_combine_splits_kernel` then forms

    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),   M = max_s lse_s.

With one split the first kernel writes `out` directly. The reference is
`tlt_rt.models.attention.paged_attention_reference` (mode "decode").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tlt_rt.codegen.kernels.paged import (
    check_paged_inputs,
    choose_num_splits,
    clamp_splits,
    dot_in_fp32,
    dot_precision,
    merge_block_s,
    num_sms,
    split_counters,
)
from tlt_rt.models.attention import paged_attention_reference

__all__ = [
    "choose_num_splits",
    "clamp_splits",
    "paged_attention_reference",
    "paged_decode_attention",
]

# Launch meta-parameters (head_dim <= 128; 256 halves block_n). `benchmarks/bench_attention.py --tune`
# sweeps them on a GPU; split_waves is how many waves of programs split-K aims for. Read by the fused rotary decode
# attention (`decode_rope_attention`) too, which also takes optional keys: "merge_tile", the fp32 partials one merge
# step holds (`paged.MERGE_TILE` if absent), "maxnreg", a cap on its registers a thread, and "tight_merge" (1: the
# split merge over the group's query heads, the next power of two, instead of the products' rows padded to 16: more
# splits a merge step). Compiled for sm_90 its programs hold 218 registers (168 without the merge), two programs of
# 4 warps an SM: the first two set how many fit.
DECODE_META = {"block_n": 64, "num_warps": 4, "num_stages": 2, "split_waves": 2}
LOG2E = 1.4426950408889634
# Left unspecialised in every paged kernel: the block tables' row stride (their width). Triton compiles a kernel
# apart for an int argument equal to 1 and for one divisible by 16, so eager launches over tables of changing width
# (the drafter's catch-up, a prefill) compiled anew mid-rollout (0.64 s inside one speculative step, H200); the
# stride as a runtime value costs one multiply.
TABLE_STRIDE = ["stride_btb"]


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _attend_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """One online-softmax step: q [M, D], k [D, N], v [N, D], allowed [M, N] -> updated (m, l, acc).

    Scores live in base-2 units (qk_scale = scale * log2 e). m starts at a finite -1e30, so a row whose
    keys are all masked keeps l = 0 and never computes inf - inf. P is rounded to V's dtype for the
    second product, as tensor cores need.
    """
    p_dtype = v.dtype
    if DOT_FP32:  # see `dot_in_fp32`
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(p_dtype).to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _merge_splits(
    O_PART, LSE_PART, OUT,  # partials [..., S, D] fp32 and [..., S] (base 2), output
    o_rows, lse_rows, out_rows, rows_ok,  # [BLOCK_R] element offsets of each (token, head) row, its mask
    n_used,  # splits holding positions: partials 0 .. n_used-1 are read
    stride_ps, stride_od,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) over BLOCK_S splits at a time (online in M); returns
    the rows' denominators (a timing probe's dependency).

    Loads bypass L1 (.cg): the partials were written by other programs of the same launch."""
    return _merge_row_splits(O_PART, LSE_PART, OUT, o_rows, lse_rows, out_rows, rows_ok, n_used, n_used,
                             stride_ps, stride_od, BLOCK_R, BLOCK_S, HEAD_DIM, False)  # fmt: skip


@triton.jit
def _merge_row_splits(
    O_PART, LSE_PART, OUT, o_rows, lse_rows, out_rows, rows_ok,
    row_used,  # with PER_ROW [BLOCK_R, 1]: the splits each row reads (else unused: every row reads n_used)
    n_used,  # the most any row reads (the loop's bound)
    stride_ps, stride_od,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, PER_ROW: tl.constexpr,
):  # fmt: skip
    """`_merge_splits` where rows may hold different numbers of written partials (tree attention's combine: rows
    of several sequences, each reading only the splits its own length used)."""
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_R], -1e30, dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, n_used, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        if PER_ROW:
            ok = rows_ok[:, None] & (offs_s[None, :] < row_used)
        else:
            ok = rows_ok[:, None] & (offs_s < n_used)[None, :]
        lse = tl.load(LSE_PART + lse_rows[:, None] + offs_s[None, :], mask=ok, other=float("-inf"),
                      cache_modifier=".cg")  # fmt: skip
        o = tl.load(O_PART + o_rows[:, None, None] + offs_s[None, :, None] * stride_ps + offs_d[None, None, :],
                    mask=ok[:, :, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m, tl.max(lse, 1))  # stays finite: an empty split's -inf weighs 0
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new[:, None])
        den = den * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(OUT + out_rows[:, None] + offs_d[None, :] * stride_od, out.to(OUT.dtype.element_ty),
             mask=rows_ok[:, None])  # fmt: skip
    return den


@triton.jit
def _arrive_last(COUNTERS, idx, num_splits):
    """True in the last of the `num_splits` programs sharing counter `idx` to get here; that one also
    zeroes the counter. The barrier orders every thread's partial stores before the (release) count."""
    tl.debug_barrier()
    arrived = tl.atomic_add(COUNTERS + idx, 1, sem="acq_rel", scope="gpu")
    last = arrived == num_splits - 1
    if last:
        tl.store(COUNTERS + idx, 0)
    return last


@triton.jit(do_not_specialize=TABLE_STRIDE)
def _decode_attention_kernel(
    # pointers
    Q,  # [B, Hq, D]
    K_CACHE,  # [num_blocks, page, Hkv, D]
    V_CACHE,  # [num_blocks, page, Hkv, D]
    BLOCK_TABLES,  # [B, max_blocks] int32
    SEQ_LENS,  # [B] int32
    OUT,  # [B, Hq, D] (used when not SPLIT)
    O_PART,  # [B, Hq, S, D] fp32 (used when SPLIT)
    LSE_PART,  # [B, Hq, S] fp32 (used when SPLIT)
    COUNTERS,  # [>= B * Hkv] int32 arrival counters, zero between launches (used when MERGE)
    # sizes
    n_kv_heads,
    num_splits,
    qk_scale,
    # strides
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_btb,
    stride_ob, stride_oh, stride_od,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    # meta
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE: tl.constexpr,  # SPLIT only: the last program to finish merges (else `_combine_splits_kernel`)
    BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid // n_kv_heads
    kvh = pid % n_kv_heads
    seq_len = tl.load(SEQ_LENS + b)
    chunk_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk_len
    end = tl.minimum(start + chunk_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_ok = offs_g < GROUP
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_ok[:, None], other=0.0)  # fmt: skip

    m_i = tl.full([BLOCK_G], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    bt_row = BLOCK_TABLES + b * stride_btb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        ok = pos < end
        blk = tl.load(bt_row + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        row = pos % PAGE_SIZE
        k = tl.load(K_CACHE + blk[None, :] * stride_kb + row[None, :] * stride_kp + kvh * stride_kh
                    + offs_d[:, None] * stride_kd, mask=ok[None, :], other=0.0)  # fmt: skip
        v = tl.load(V_CACHE + blk[:, None] * stride_vb + row[:, None] * stride_vp + kvh * stride_vh
                    + offs_d[None, :] * stride_vd, mask=ok[:, None], other=0.0)  # fmt: skip
        m_i, l_i, acc = _attend_tile(q, k, v, ok[None, :], m_i, l_i, acc, qk_scale, DOT_PRECISION, DOT_FP32)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    out_rows = b * stride_ob + heads * stride_oh
    if SPLIT:
        n_used = tl.cdiv(seq_len, tl.maximum(chunk_len, 1))
        write = tl.where(split < n_used, g_ok, False)  # the merge reads used splits only
        if not MERGE:
            write = g_ok  # the separate combine reads them all
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        o_rows = b * stride_pb + heads * stride_ph
        lse_rows = b * stride_lb + heads * stride_lh
        tl.store(LSE_PART + lse_rows + split, lse, mask=write)
        tl.store(O_PART + o_rows[:, None] + split * stride_ps + offs_d[None, :], o, mask=write[:, None])
        if MERGE:
            if _arrive_last(COUNTERS, pid, num_splits):
                _merge_splits(O_PART, LSE_PART, OUT, o_rows, lse_rows, out_rows, g_ok, n_used, stride_ps,
                              stride_od, BLOCK_G, BLOCK_S, HEAD_DIM)  # fmt: skip
    else:
        tl.store(OUT + out_rows[:, None] + offs_d[None, :] * stride_od, o.to(OUT.dtype.element_ty),
                 mask=g_ok[:, None])  # fmt: skip


@triton.jit
def _combine_splits_kernel(
    # pointers
    O_PART,  # [N, Hq, S, D] fp32
    LSE_PART,  # [N, Hq, S] fp32, base 2; -inf marks an empty split
    OUT,  # [N, Hq, D]
    # sizes
    n_rows,  # N * Hq
    n_heads,
    num_splits,
    # strides
    stride_pn, stride_ph, stride_ps,
    stride_ln, stride_lh,
    stride_on, stride_oh, stride_od,
    # meta
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = rows // n_heads
    h = rows % n_heads
    _merge_splits(O_PART, LSE_PART, OUT, n * stride_pn + h * stride_ph, n * stride_ln + h * stride_lh,
                  n * stride_on + h * stride_oh, rows < n_rows, num_splits, stride_ps, stride_od,
                  BLOCK_R, BLOCK_S, HEAD_DIM)  # fmt: skip


# ----------------------------------------------------------------------------------------------- host side
def combine_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge split-K partials o_part [N, Hq, S, D] fp32 and lse_part [N, Hq, S] (base 2) into out [N, Hq, D]."""
    n, n_heads, num_splits, head_dim = o_part.shape
    assert o_part.dtype == torch.float32 and o_part.stride(3) == 1, "o_part must be fp32 with contiguous D"
    assert lse_part.shape == (n, n_heads, num_splits) and lse_part.stride(2) == 1, "lse_part must be [N, Hq, S]"
    assert out.shape == (n, n_heads, head_dim), f"out must be [N, Hq, D], got {tuple(out.shape)}"
    block_r = 16
    _combine_splits_kernel[(triton.cdiv(n * n_heads, block_r),)](
        o_part, lse_part, out,
        n * n_heads, n_heads, num_splits,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_R=block_r, BLOCK_S=merge_block_s(block_r, num_splits, head_dim), HEAD_DIM=head_dim,
    )  # fmt: skip
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache: q [B, Hq, D] -> [B, Hq, D] in q's dtype, fp32 accumulation.

    Token b attends to cache positions 0 .. seq_lens[b]-1 (its own K/V already written at the last one).
    `num_splits` (None: chosen from B, heads and block_tables' capacity, see `choose_num_splits`) cuts
    each context into chunks read by separate programs; no host sync, so it can be graph-captured.
    """
    check_paged_inputs(_decode_attention_kernel, q, k_cache, v_cache, block_tables, seq_lens)
    b, n_heads, head_dim = q.shape
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    assert q.shape[0] == b == block_tables.shape[0], f"decode packs one token per sequence: q {tuple(q.shape)}"
    group = n_heads // n_kv
    meta = DECODE_META
    block_n = meta["block_n"] if head_dim <= 128 else meta["block_n"] // 2
    max_ctx = block_tables.shape[1] * page  # capacity bound known on the host: no sync on seq_lens
    if num_splits is None:
        # chunks follow the real lengths (see the module doc), so a split may be as short as one tile
        num_splits = choose_num_splits(b * n_kv, max_ctx, num_sms(q.device), meta["split_waves"], block_n)
    num_splits = clamp_splits(num_splits, max_ctx, block_n)

    out = torch.empty_like(q)
    fp32_dot = dot_in_fp32(_decode_attention_kernel, q.dtype)
    split = num_splits > 1
    counters = None
    if split:
        o_part = torch.empty(b, n_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(b, n_heads, num_splits, device=q.device, dtype=torch.float32)
        counters = split_counters(q.device, b * n_kv)
    else:
        o_part = lse_part = out  # unused by the kernel
    block_g = max(16, triton.next_power_of_2(group))
    _decode_attention_kernel[(b * n_kv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, o_part, lse_part,
        seq_lens if counters is None else counters,
        n_kv, num_splits, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, PAGE_SIZE=page, BLOCK_N=block_n, SPLIT=split,
        MERGE=counters is not None, BLOCK_S=merge_block_s(block_g, num_splits, head_dim),
        DOT_PRECISION=dot_precision(q.dtype, fp32_dot), DOT_FP32=fp32_dot,
        num_warps=meta["num_warps"], num_stages=meta["num_stages"],
    )  # fmt: skip
    if split and counters is None:
        combine_splits(o_part, lse_part, out)
    return out
