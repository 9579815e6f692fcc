"""Paged prefill attention: packed chunks of new tokens of many sequences, causal over each one's paged cache.

Sequence b has L = seq_lens[b] cached positions once its chunk is written; its q_len = cu[b+1] - cu[b] new
tokens (rows cu[b] .. cu[b+1]-1 of q) sit at the last q_len of them. New token i, query head h (KV head
kv = h // group) attends to every position up to its own:

    out[cu[b] + i, h] = sum_{p <= L - q_len + i} softmax_p(scale * q . K[b, p, kv]) V[b, p, kv]

This serves a prompt's (chunked) prefill and the drafter's eager catch-up over the rows a stretch of plain
steps left behind: both run once per request or per switch, eagerly. One program holds a tile of BLOCK_M
rows of one sequence's flattened (token, head-in-group) axis of one KV head, so the group's query heads
share every K/V tile it reads, and walks the positions that tile's last token sees (flash attention's online
softmax, fp32 accumulation); tiles past a sequence's chunk do nothing. The reference is
`tlt_rt.models.attention.paged_attention_reference` (mode "prefill"), which pads the batch's chunks into
groups and upcasts them to fp32: on a GPU that turned a catch-up of ~120 sequences into tens of milliseconds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tlt_rt.codegen.kernels.decode_attention import (
    LOG2E,
    TABLE_STRIDE,
    _attend_tile,
)
from tlt_rt.codegen.kernels.paged import (
    check_paged_inputs,
    dot_in_fp32,
    dot_precision,
)
from tlt_rt.models.attention import paged_attention_reference

__all__ = ["paged_attention_reference", "paged_prefill_attention"]

# Launch meta-parameters for head_dim <= 128 (256 halves block_m and block_n)
PREFILL_META = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}


@triton.jit(do_not_specialize=TABLE_STRIDE)
def _prefill_attention_kernel(
    Q,  # [N, Hq, D] packed new tokens
    K_CACHE,  # [num_blocks, page, Hkv, D]
    V_CACHE,  # [num_blocks, page, Hkv, D]
    BLOCK_TABLES,  # [B, max_blocks] int32
    SEQ_LENS,  # [B] int32, cached positions including the new ones
    CU_SEQLENS,  # [B+1] int32, offsets of each sequence's new tokens in Q
    OUT,  # [N, Hq, D]
    n_kv_heads,
    qk_scale,
    stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_btb,
    stride_on, stride_oh, stride_od,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    m_blk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kvh = tl.program_id(2)
    first = tl.load(CU_SEQLENS + b)
    q_len = tl.load(CU_SEQLENS + b + 1) - first
    seq_len = tl.load(SEQ_LENS + b)
    start = seq_len - q_len  # the cache position of the chunk's first token

    # rows of the tile: r = token * GROUP + head-in-group, tokens of this sequence's chunk only
    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * GROUP
    tok = rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    q_rows = first + tok
    q_pos = start + tok
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + q_rows[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)  # fmt: skip

    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = BLOCK_TABLES + b * stride_btb
    # the positions the tile's last token sees (none for a tile past the chunk)
    last_tok = (tl.minimum((m_blk + 1) * BLOCK_M, q_len * GROUP) - 1) // GROUP
    end = tl.where(m_blk * BLOCK_M < q_len * GROUP, start + last_tok + 1, 0)
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + offs_n
        ok = pos < end
        blk = tl.load(bt_row + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        slot_row = pos % PAGE_SIZE
        k = tl.load(K_CACHE + blk[None, :] * stride_kb + slot_row[None, :] * stride_kp + kvh * stride_kh
                    + offs_d[:, None] * stride_kd, mask=ok[None, :], other=0.0)  # fmt: skip
        v = tl.load(V_CACHE + blk[:, None] * stride_vb + slot_row[:, None] * stride_vp + kvh * stride_vh
                    + offs_d[None, :] * stride_vd, mask=ok[:, None], other=0.0)  # fmt: skip
        allowed = (ok[None, :] & (pos[None, :] <= q_pos[:, None])) & row_ok[:, None]
        m_i, l_i, acc = _attend_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_PRECISION, DOT_FP32)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(OUT + q_rows[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             o.to(OUT.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_q_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed new tokens over a paged cache: q [N, Hq, D] -> [N, Hq, D], fp32 accumulation.

    Sequence b's new tokens are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 of q, their K/V already written at
    its last cache positions (seq_lens[b] in all). `max_q_len` (a host int, at least the longest chunk) sizes
    the launch; no host sync.
    """
    check_paged_inputs(_prefill_attention_kernel, q, k_cache, v_cache, block_tables, seq_lens)
    b = block_tables.shape[0]
    n_heads, head_dim = q.shape[1:]
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    assert cu_seqlens_q.shape == (b + 1,) and cu_seqlens_q.dtype == torch.int32, (
        f"cu_seqlens_q must be [B+1={b + 1}] int32, got {tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}"
    )
    assert cu_seqlens_q.device == q.device, f"cu_seqlens_q is on {cu_seqlens_q.device}, q on {q.device}"
    out = torch.empty_like(q)
    if q.shape[0] == 0 or max_q_len <= 0:
        return out
    group = n_heads // n_kv
    wide = head_dim > 128
    meta = PREFILL_META
    block_m = meta["block_m"] // (2 if wide else 1)
    block_n = meta["block_n"] // (2 if wide else 1)
    num_m_blocks = triton.cdiv(max_q_len * group, block_m)
    fp32_dot = dot_in_fp32(_prefill_attention_kernel, q.dtype)
    _prefill_attention_kernel[(num_m_blocks, b, n_kv)](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
        n_kv, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, BLOCK_M=block_m, HEAD_DIM=head_dim, PAGE_SIZE=page, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype, fp32_dot), DOT_FP32=fp32_dot,
        num_warps=meta["num_warps"], num_stages=meta["num_stages"],
    )  # fmt: skip
    return out
