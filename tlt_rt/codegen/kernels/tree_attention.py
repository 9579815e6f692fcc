"""Paged tree attention for verification: T tree tokens per sequence over the paged prefix, split-K.

Sequence b has L = seq_lens[b] cached positions; its T tree tokens (rows b*T .. b*T+T-1 of q) sit at
the last T of them. The tree mask [B, T, W], W >= T, covers the last W positions (a drafter level sees its
ancestors among earlier levels through W > T), so prefix P = L - W. Tree token i, query head h (KV head
kv = h // group) attends to

    allowed(i, p) = p < P  or  (P <= p < L and tree_mask[b, i, p - P])
    out[b*T + i, h] = sum_{p allowed} softmax_p(scale * q . K[b, p, kv]) V[b, p, kv]

One program holds a tile of BLOCK_M rows of the flattened (token, head-in-group) axis of one KV head, so
all T tokens x group heads share every prefix K/V tile it reads (one M block whenever T * group <= 128).
Split-K cuts the prefix into chunks of whole tiles sized on the device from the real prefix, as decode
attention does; the last split that holds prefix positions (split 0 when there are none) also walks the W
window positions under the mask: in the prefix's own loop for small tiles (a tile may then hold the
prefix's tail and the window's head), in a loop of their own for large ones (MERGE_MAX_ROWS).
Partials are merged by a second kernel (`_combine_tree_kernel`). Above `EVERY_SPLIT_MAX` splits only those a
sequence's prefix reaches write partials, and the merge reads only those: the split count is sized from the
block table's capacity (an engine's whole context), so a short prefix under a wide table leaves most splits
empty (a 32,768-position table and a 100-token prefix: 2 of 64), and their partials were most of the launch's
traffic (~13 MB a layer for 32 tree tokens on Qwen2.5-1.5B's heads). Decode attention merges inside its launch
instead; here that made one program read the T x group rows of every split in turn, and a verify step slower
(H100, Qwen2.5-7B shape).
The reference is `tlt_rt.models.attention.paged_attention_reference` (mode "verify").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tlt_rt.codegen.kernels.decode_attention import (
    LOG2E,
    TABLE_STRIDE,
    _attend_tile,
    _merge_row_splits,
)
from tlt_rt.codegen.kernels.paged import (
    check_paged_inputs,
    choose_num_splits,
    clamp_splits,
    dot_in_fp32,
    dot_precision,
    merge_block_s,
    num_sms,
)
from tlt_rt.models.attention import paged_attention_reference

__all__ = ["paged_attention_reference", "paged_tree_attention"]

# Launch meta-parameters for head_dim <= 128 (256 halves block_m and block_n); num_warps applies to full
# tiles (small T * group gives smaller ones, which use 4). `benchmarks/bench_attention.py --tune` sweeps them.
# Optional "merge_tile": the fp32 partials one step of the split combine holds (`paged.MERGE_TILE` if absent; compiled
# for sm_90 the combine of head size 128 holds 255 registers and spills with it, and a 32-token verify of
# Qwen2.5-Coder-1.5B's heads 44 bytes in the attention kernel at 128 rows, none at 64: `step_costs.py pdl:tree:..`).
TREE_META = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2, "split_waves": 2}
# Tiles of at most this many rows walk the window in the prefix's loop (MERGE_WINDOW). On an H100 (SmolLM2,
# batch 1) that sped a 12-token verify's attention up by 12% and slowed a 32-token one (128-row tiles) by 17%:
# there the mask work every tile then does costs more than the loop iteration it saves.
MERGE_MAX_ROWS = 64
# Up to this many splits every split writes its partials and the combine reads them all, used or not; above it
# only the used ones. On an H200 (`bench_attention.py --tree-splits`, Qwen2.5-Coder-1.5B and Qwen2.5-7B heads,
# `c2ceae0`) the used splits alone took a 32-token verify's attention under a 32,768-position table (64 splits,
# 2 used) from 21.3 to 15.2 us, a drafter level's (4 tokens) from 14.2 to 9.4; under a 2,624-position table
# (10 splits) they cost 0.0-0.7 us more (the combine's length read before its loads), at batch 32 (2 splits, both
# used) 0.3 / 6.7 us more.
EVERY_SPLIT_MAX = 16
EVERY_SPLIT: bool | None = None  # True / False forces one way (side-by-side timing); None: by EVERY_SPLIT_MAX


@triton.jit
def _tree_chunks(seq_len, n_window, num_splits, BLOCK_N: tl.constexpr):
    """(prefix, chunk_len, n_used) of a sequence of `seq_len` positions (its last `n_window` the window): the
    prefix cut into `num_splits` chunks of whole tiles, and how many of them hold positions (at least one: the
    last used split also walks the window). The attention and combine kernels must agree on it."""
    prefix = seq_len - n_window
    chunk_len = tl.cdiv(tl.cdiv(tl.maximum(prefix, 0), num_splits), BLOCK_N) * BLOCK_N
    n_used = tl.maximum(tl.cdiv(tl.maximum(prefix, 0), tl.maximum(chunk_len, 1)), 1)
    return prefix, chunk_len, n_used


@triton.jit(do_not_specialize=TABLE_STRIDE)
def _tree_attention_kernel(
    # pointers
    Q,  # [B*T, Hq, D]
    K_CACHE,  # [num_blocks, page, Hkv, D]
    V_CACHE,  # [num_blocks, page, Hkv, D]
    BLOCK_TABLES,  # [B, max_blocks] int32
    SEQ_LENS,  # [B] int32, includes the T tree tokens
    TREE_MASK,  # [B, T, W] uint8 (a bool view): tree_mask[b, i, j] = window position j is i or an ancestor
    OUT,  # [B*T, Hq, D] (used when not SPLIT)
    O_PART,  # [B*T, Hq, S, D] fp32 (used when SPLIT)
    LSE_PART,  # [B*T, Hq, S] fp32 (used when SPLIT)
    # sizes
    n_tree,
    n_window,
    n_kv_heads,
    num_m_blocks,
    num_splits,
    qk_scale,
    # strides
    stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_btb,
    stride_mb, stride_mi, stride_mj,
    stride_on, stride_oh, stride_od,
    stride_pn, stride_ph, stride_ps,
    stride_ln, stride_lh,
    # meta
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVERY_SPLIT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    m_blk = pid % num_m_blocks
    kvh = (pid // num_m_blocks) % n_kv_heads
    b = pid // (num_m_blocks * n_kv_heads)
    seq_len = tl.load(SEQ_LENS + b)
    prefix, chunk_len, n_used = _tree_chunks(seq_len, n_window, num_splits, BLOCK_N)

    # rows of the tile: r = token * GROUP + head-in-group
    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_tree * GROUP
    tok = rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    q_rows = b * n_tree + tok
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + q_rows[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)  # fmt: skip

    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = BLOCK_TABLES + b * stride_btb

    # this split's chunk of the prefix (every row sees every position); with MERGE_WINDOW the last split
    # that holds prefix positions runs on through the W window positions in the same loop, under the tree
    # mask, so a tile can hold the prefix's tail and the window's head
    start = split * chunk_len
    end = tl.minimum(start + chunk_len, prefix)
    if MERGE_WINDOW:
        if split == n_used - 1:
            end = seq_len
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        ok = pos < end
        blk = tl.load(bt_row + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        slot_row = pos % PAGE_SIZE
        k = tl.load(K_CACHE + blk[None, :] * stride_kb + slot_row[None, :] * stride_kp + kvh * stride_kh
                    + offs_d[:, None] * stride_kd, mask=ok[None, :], other=0.0)  # fmt: skip
        v = tl.load(V_CACHE + blk[:, None] * stride_vb + slot_row[:, None] * stride_vp + kvh * stride_vh
                    + offs_d[None, :] * stride_vd, mask=ok[:, None], other=0.0)  # fmt: skip
        if MERGE_WINDOW:
            rel = pos - prefix
            in_window = ok & (rel >= 0)
            tree = tl.load(TREE_MASK + b * stride_mb + tok[:, None] * stride_mi + rel[None, :] * stride_mj,
                           mask=row_ok[:, None] & in_window[None, :], other=0) != 0  # fmt: skip
            allowed = (ok & (rel < 0))[None, :] | tree
        else:
            allowed = ok[None, :]
        m_i, l_i, acc = _attend_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_PRECISION, DOT_FP32)

    # otherwise the W window positions in a loop of their own, under the mask (last used split only)
    if not MERGE_WINDOW:
        if split == n_used - 1:
            for n0 in range(prefix, seq_len, BLOCK_N):
                pos = n0 + offs_n
                ok = (pos >= 0) & (pos < seq_len)  # a padding row (seq_len 0) would start at -W
                rel = pos - prefix
                blk = tl.load(bt_row + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
                slot_row = pos % PAGE_SIZE
                k = tl.load(K_CACHE + blk[None, :] * stride_kb + slot_row[None, :] * stride_kp + kvh * stride_kh
                            + offs_d[:, None] * stride_kd, mask=ok[None, :], other=0.0)  # fmt: skip
                v = tl.load(V_CACHE + blk[:, None] * stride_vb + slot_row[:, None] * stride_vp + kvh * stride_vh
                            + offs_d[None, :] * stride_vd, mask=ok[:, None], other=0.0)  # fmt: skip
                allowed = tl.load(TREE_MASK + b * stride_mb + tok[:, None] * stride_mi + rel[None, :] * stride_mj,
                                  mask=row_ok[:, None] & ok[None, :], other=0) != 0  # fmt: skip
                m_i, l_i, acc = _attend_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_PRECISION, DOT_FP32)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if SPLIT:  # the splits the prefix reaches write (a padding row's lse = -inf); the combine reads those only
        if EVERY_SPLIT:
            write = row_ok
        else:
            write = tl.where(split < n_used, row_ok, False)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(LSE_PART + q_rows * stride_ln + heads * stride_lh + split, lse, mask=write)
        tl.store(O_PART + q_rows[:, None] * stride_pn + heads[:, None] * stride_ph + split * stride_ps
                 + offs_d[None, :], o, mask=write[:, None])  # fmt: skip
    else:
        tl.store(OUT + q_rows[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(OUT.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip


@triton.jit
def _combine_tree_kernel(
    # pointers
    O_PART,  # [B*T, Hq, S, D] fp32: row n's splits 0 .. n_used(n)-1 written, the rest never
    LSE_PART,  # [B*T, Hq, S] fp32, base 2
    OUT,  # [B*T, Hq, D]
    SEQ_LENS,  # [B] int32, as the attention kernel read them
    # sizes
    n_rows,  # B * T * Hq
    n_heads,
    n_tree,
    n_window,
    num_splits,
    # strides
    stride_pn, stride_ph, stride_ps,
    stride_ln, stride_lh,
    stride_on, stride_oh, stride_od,
    # meta
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the attention kernel's tile: its chunks are whole tiles
    EVERY_SPLIT: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_ok = rows < n_rows
    n = rows // n_heads
    h = rows % n_heads
    if EVERY_SPLIT:
        n_used = tl.where(rows_ok, num_splits, 0)
    else:
        seq_len = tl.load(SEQ_LENS + n // n_tree, mask=rows_ok, other=0)
        _, _, n_used = _tree_chunks(seq_len, n_window, num_splits, BLOCK_N)
        n_used = tl.where(rows_ok, n_used, 0)
    _merge_row_splits(O_PART, LSE_PART, OUT, n * stride_pn + h * stride_ph, n * stride_ln + h * stride_lh,
                      n * stride_on + h * stride_oh, rows_ok, n_used[:, None], tl.max(n_used, 0), stride_ps,
                      stride_od, BLOCK_R, BLOCK_S, HEAD_DIM, True)  # fmt: skip


def split_partials(rows: int, n_heads: int, num_splits: int, head_dim: int, device) -> tuple[torch.Tensor, ...]:
    """(o_part [rows, Hq, S, D], lse_part [rows, Hq, S]), fp32, uninitialised: the splits a prefix does not reach
    are never written nor read."""
    o_part = torch.empty(rows, n_heads, num_splits, head_dim, device=device, dtype=torch.float32)
    return o_part, torch.empty(rows, n_heads, num_splits, device=device, dtype=torch.float32)


def tree_tiling(
    b: int, t: int, w: int, n_heads: int, n_kv: int, head_dim: int, table_positions: int, device, num_splits=None
) -> tuple[int, int, int, int]:
    """(block_m, num_m_blocks, block_n, num_splits) of a launch: B sequences of T tree tokens with a W-position
    window, block tables of `table_positions` positions. Host ints only (no sync on the lengths)."""
    meta = TREE_META
    wide = head_dim > 128
    block_m = min(meta["block_m"] // (2 if wide else 1), max(16, triton.next_power_of_2(t * (n_heads // n_kv))))
    num_m_blocks = triton.cdiv(t * (n_heads // n_kv), block_m)
    block_n = meta["block_n"] // (2 if wide else 1)
    max_prefix = max(table_positions - w, 0)
    if num_splits is None:
        num_splits = choose_num_splits(b * n_kv * num_m_blocks, max_prefix, num_sms(device), meta["split_waves"])
    return block_m, num_m_blocks, block_n, clamp_splits(num_splits, max_prefix, block_n)


def paged_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Tree-verify attention over a paged KV cache: q [B*T, Hq, D] -> [B*T, Hq, D], fp32 accumulation.

    The T tree tokens' K/V are already at cache positions seq_lens[b]-T .. seq_lens[b]-1; `tree_mask`
    [B, T, W] bool (W >= T, usually T) says which of the last W positions each one sees (itself and its
    ancestors). `num_splits` (None: chosen from B, heads, T and block_tables' capacity) splits the prefix;
    no host sync.
    """
    check_paged_inputs(_tree_attention_kernel, q, k_cache, v_cache, block_tables, seq_lens)
    b = block_tables.shape[0]
    n_heads, head_dim = q.shape[1:]
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    assert tree_mask.dtype == torch.bool and tree_mask.dim() == 3, (
        f"tree_mask must be [B, T, W] bool, got {tuple(tree_mask.shape)} {tree_mask.dtype}"
    )
    t, w = tree_mask.shape[1:]
    assert tree_mask.shape[0] == b and w >= t, f"tree_mask must be [B={b}, T, W>=T], got {tuple(tree_mask.shape)}"
    assert tree_mask.device == q.device, f"tree_mask is on {tree_mask.device}, q on {q.device}"
    assert q.shape[0] == b * t, f"q must hold B*T={b * t} rows, got {q.shape[0]}"

    block_m, num_m_blocks, block_n, num_splits = tree_tiling(
        b, t, w, n_heads, n_kv, head_dim, block_tables.shape[1] * page, q.device, num_splits
    )
    group, meta = n_heads // n_kv, TREE_META

    out = torch.empty_like(q)
    fp32_dot = dot_in_fp32(_tree_attention_kernel, q.dtype)
    split = num_splits > 1
    every = EVERY_SPLIT if EVERY_SPLIT is not None else num_splits <= EVERY_SPLIT_MAX
    if split:
        o_part, lse_part = split_partials(b * t, n_heads, num_splits, head_dim, q.device)
    else:
        o_part = lse_part = out  # unused by the kernel
    mask_u8 = tree_mask.view(torch.uint8)
    _tree_attention_kernel[(b * n_kv * num_m_blocks, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mask_u8, out, o_part, lse_part,
        t, w, n_kv, num_m_blocks, num_splits, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0),
        mask_u8.stride(0), mask_u8.stride(1), mask_u8.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        GROUP=group, BLOCK_M=block_m, HEAD_DIM=head_dim, PAGE_SIZE=page, BLOCK_N=block_n, SPLIT=split,
        MERGE_WINDOW=block_m <= MERGE_MAX_ROWS,
        DOT_PRECISION=dot_precision(q.dtype, fp32_dot), DOT_FP32=fp32_dot, EVERY_SPLIT=every,
        num_warps=meta["num_warps"] if block_m * head_dim >= meta["block_m"] * 128 else 4,
        num_stages=meta["num_stages"],
    )  # fmt: skip
    if split:
        block_r = 16
        _combine_tree_kernel[(triton.cdiv(b * t * n_heads, block_r),)](
            o_part, lse_part, out, seq_lens,
            b * t * n_heads, n_heads, t, w, num_splits,
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            BLOCK_R=block_r, BLOCK_S=merge_block_s(block_r, num_splits, head_dim, meta.get("merge_tile")),
            HEAD_DIM=head_dim, BLOCK_N=block_n, EVERY_SPLIT=every,
        )  # fmt: skip
    return out
