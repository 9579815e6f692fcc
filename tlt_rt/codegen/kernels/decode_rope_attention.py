"""Decode attention that also rotates the new token's q and k and writes its K/V to the paged cache: one launch for
what `rope_cache.rope_write_kv` and `decode_attention.paged_decode_attention` do in two.

For sequence b with L = seq_lens[b] positions after this step (the new token at L - 1, its un-rotated q / k / v
the rows of this step's projection, rotary position positions[b]):

    q', k' = rot(q), rot(k)                      (rotate-half, float32, rounded once: as rope_cache does)
    K/V cache at slots[b] <- k', v               (by the programs of split 0)
    out[b, h] = attention of q'[h] over cache positions 0 .. L - 2 and the new token's (k', v)

Each program (b, KV head, split) rotates its group's query heads and the KV head's new k itself (a few hundred
bytes), reads its chunk of the cache with the new position masked out (the write of another program of the same
launch is not visible to it), and the split whose chunk holds L - 1 adds the new token's score from registers.
Splits and their merge are `decode_attention`'s (chunks from the sequence's own length, the last program of a
(b, KV head) merging the partials). A decode step's layer thus launches one kernel fewer; at batch 1 the rotary
kernel cost ~2.6 us of a ~56 us layer on Qwen2.5-Coder-1.5B (H200). Launched with PDL, each program reads the
sequence's length, positions and block table and its chunk's first tile of the cache before its wait, while the
q/k/v projection still runs (`EARLY_LOADS`; a PDL step 1.02x / 1.04x on Qwen2.5-Coder-1.5B / 0.5B, H200).

The reference is `rope_write_kv_reference` followed by `paged_attention_reference` (mode "decode").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tlt_rt.codegen.kernels.decode_attention import (
    DECODE_META,
    LOG2E,
    TABLE_STRIDE,
    _arrive_last,
    _merge_splits,
)
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
from tlt_rt.codegen.kernels.pdl import enter, interpreting, launch_meta, leave, load_early
from tlt_rt.codegen.kernels.probe import Stamps, as_dep, clock, put, stamp

__all__ = ["EARLY_LOADS", "PROBE", "STAMPS", "decode_rope_attention"]

# Under PDL, each program reads the step's lengths, positions and tables and its chunk's first tile of the cache
# before its wait (`kernels.pdl`), while the q/k/v projection before it still runs; False waits first (kept so
# that `benchmarks/step_costs.py --compare` can measure what the early reads buy).
EARLY_LOADS = True
# A `probe.Stamps` to time each program's phases into (`benchmarks/attention_timeline.py`), or None (compiled out).
# Per program, STAMPS int64 in this order: placed, past its wait, q/k/v read, its chunk attended, arrived at the
# merge count (split launches), merged (the last program of a (sequence, KV head) only; 0 in the others).
PROBE: Stamps | None = None
STAMPS = 8


@triton.jit
def _rotate(x1, x2, c, s, dtype):
    """rot((x1, x2)) in float32, rounded to `dtype` and widened again: the halves as the cache / q hold them."""
    return (x1 * c - x2 * s).to(dtype).to(tl.float32), (x2 * c + x1 * s).to(dtype).to(tl.float32)


@triton.jit
def _kv_tile(
    K_CACHE, V_CACHE, bt_row, n0, lim, kvh, stride_cs, stride_ch, d, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Cache positions n0 .. n0 + BLOCK_N (those before `lim`) of KV head kvh: K as two [HALF, BLOCK_N] halves, V as
    two [BLOCK_N, HALF] ones, and the positions' mask. Loads `kernels.pdl` allows before the wait: the positions
    before the new token's were written by earlier steps, the block table before the step's first kernel."""
    pos = n0 + tl.arange(0, BLOCK_N)
    ok = pos < lim
    blk = load_early(bt_row + pos // PAGE_SIZE, ok, 0).to(tl.int64)
    row = (blk * PAGE_SIZE + pos % PAGE_SIZE) * stride_cs + kvh * stride_ch
    ka = load_early(K_CACHE + row[None, :] + d[:, None], ok[None, :], 0.0)
    kb = load_early(K_CACHE + row[None, :] + HALF + d[:, None], ok[None, :], 0.0)
    va = load_early(V_CACHE + row[:, None] + d[None, :], ok[:, None], 0.0)
    vb = load_early(V_CACHE + row[:, None] + HALF + d[None, :], ok[:, None], 0.0)
    if DOT_FP32:
        ka, kb, va, vb = ka.to(tl.float32), kb.to(tl.float32), va.to(tl.float32), vb.to(tl.float32)
    return ka, kb, va, vb, ok


@triton.jit
def _attend_tile(
    qa, qb, ka, kb, va, vb, ok, m_i, l_i, acc1, acc2, qk_scale, p_dtype: tl.constexpr, DOT_PRECISION: tl.constexpr
):  # fmt: skip
    """One tile of the online softmax: (m_i, l_i, acc1, acc2) after the positions `ok` of a `_kv_tile`."""
    sc = tl.dot(qa, ka, input_precision=DOT_PRECISION) + tl.dot(qb, kb, input_precision=DOT_PRECISION)
    sc = tl.where(ok[None, :], sc * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(p_dtype).to(va.dtype)  # rounded as `_attend_tile` of decode_attention rounds it
    acc1 = acc1 * alpha[:, None] + tl.dot(p, va, input_precision=DOT_PRECISION)
    acc2 = acc2 * alpha[:, None] + tl.dot(p, vb, input_precision=DOT_PRECISION)
    return m_new, l_i, acc1, acc2


@triton.jit(do_not_specialize=TABLE_STRIDE)
def _decode_rope_attention_kernel(
    Q, K, V,  # [B, Hq, D], [B, Hkv, D] x2: this step's projections, before rotary (strided views)
    POS, INV_FREQ, SLOTS,  # [B] rotary positions, [D/2] fp32, [B] resolved cache slots of the new token
    K_CACHE, V_CACHE,  # [num_blocks * page, Hkv, D] (slot-major views)
    BLOCK_TABLES, SEQ_LENS, OUT, O_PART, LSE_PART, COUNTERS, PROBE_BUF,
    n_kv_heads, num_splits, qk_scale, probe_off,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_cs, stride_ch, stride_btb,
    stride_ob, stride_oh, stride_od,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    PROBE_ON: tl.constexpr, N_STAMPS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # the merge's rows: BLOCK_G (the products' padded rows) or the group's power of two
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if PROBE_ON:
        probe = probe_off + (pid * num_splits + split) * N_STAMPS
        placed = clock(split)  # stored after the wait: nothing is written before it
    if not EARLY:
        enter(PDL)
    b = pid // n_kv_heads
    kvh = pid % n_kv_heads
    # With EARLY, ahead of the wait (kernels.pdl), what the kernel before (this step's q/k/v projection) does not
    # write: the step's lengths, positions and tables, and the chunk's first tile of the cache's earlier positions.
    seq_len = load_early(SEQ_LENS + b, True, 0)
    chunk_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk_len
    end = tl.minimum(start + chunk_len, seq_len)
    last = seq_len - 1  # the new token's position: from registers, never from the cache
    lim = tl.minimum(end, last)
    d = tl.arange(0, HALF)
    bt_row = BLOCK_TABLES + b * stride_btb
    ka, kb, va, vb, ok = _kv_tile(K_CACHE, V_CACHE, bt_row, start, lim, kvh, stride_cs, stride_ch, d, HALF, PAGE_SIZE,
                                  BLOCK_N, DOT_FP32)  # fmt: skip
    ang = load_early(POS + b, True, 0).to(tl.float32) * load_early(INV_FREQ + d, True, 0.0)
    if EARLY:
        enter(PDL)
    if PROBE_ON:
        put(PROBE_BUF, probe, placed)
        stamp(PROBE_BUF, probe + 1, split)
    c = tl.cos(ang)
    s = tl.sin(ang)
    offs_g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + offs_g
    g_ok = offs_g < GROUP
    src = Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q1, q2 = _rotate(tl.load(src, mask=g_ok[:, None], other=0.0).to(tl.float32),
                     tl.load(src + HALF, mask=g_ok[:, None], other=0.0).to(tl.float32), c[None, :], s[None, :],
                     Q.dtype.element_ty)  # fmt: skip
    if PROBE_ON:
        stamp(PROBE_BUF, probe + 2, as_dep(tl.sum(tl.sum(q1, 1), 0)))
    src = K + b * stride_kb + kvh * stride_kh + d
    k1, k2 = _rotate(tl.load(src).to(tl.float32), tl.load(src + HALF).to(tl.float32), c, s, K.dtype.element_ty)
    src = V + b * stride_vb + kvh * stride_vh + d
    v1 = tl.load(src).to(tl.float32)
    v2 = tl.load(src + HALF).to(tl.float32)
    cdt = K_CACHE.dtype.element_ty
    if split == 0:
        dst = tl.load(SLOTS + b).to(tl.int64) * stride_cs + kvh * stride_ch + d
        tl.store(K_CACHE + dst, k1.to(cdt))
        tl.store(K_CACHE + dst + HALF, k2.to(cdt))
        tl.store(V_CACHE + dst, v1.to(V_CACHE.dtype.element_ty))
        tl.store(V_CACHE + dst + HALF, v2.to(V_CACHE.dtype.element_ty))

    qa = q1.to(cdt)
    qb = q2.to(cdt)
    if DOT_FP32:  # see `paged.dot_in_fp32`
        qa = qa.to(tl.float32)
        qb = qb.to(tl.float32)
    m_i = tl.full([BLOCK_G], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_G, HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_G, HALF], dtype=tl.float32)
    pdt = V_CACHE.dtype.element_ty
    # the first tile (loaded ahead; all masked where the chunk is empty: a no-op on the running sums), then the rest
    m_i, l_i, acc1, acc2 = _attend_tile(qa, qb, ka, kb, va, vb, ok, m_i, l_i, acc1, acc2, qk_scale, pdt, DOT_PRECISION)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        ka, kb, va, vb, ok = _kv_tile(K_CACHE, V_CACHE, bt_row, n0, lim, kvh, stride_cs, stride_ch, d, HALF,
                                      PAGE_SIZE, BLOCK_N, DOT_FP32)  # fmt: skip
        m_i, l_i, acc1, acc2 = _attend_tile(qa, qb, ka, kb, va, vb, ok, m_i, l_i, acc1, acc2, qk_scale, pdt,
                                            DOT_PRECISION)  # fmt: skip
    if (start <= last) & (last < end):  # this split's chunk holds the new token
        kf1 = k1.to(cdt).to(tl.float32)
        kf2 = k2.to(cdt).to(tl.float32)
        sc = (tl.sum(qa.to(tl.float32) * kf1[None, :], 1) + tl.sum(qb.to(tl.float32) * kf2[None, :], 1)) * qk_scale
        m_new = tl.maximum(m_i, sc)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new)
        l_i = l_i * alpha + p
        p = p.to(V_CACHE.dtype.element_ty).to(tl.float32)
        vf1 = v1.to(V_CACHE.dtype.element_ty).to(tl.float32)
        vf2 = v2.to(V_CACHE.dtype.element_ty).to(tl.float32)
        acc1 = acc1 * alpha[:, None] + p[:, None] * vf1[None, :]
        acc2 = acc2 * alpha[:, None] + p[:, None] * vf2[None, :]
        m_i = m_new

    leave(PDL)
    if PROBE_ON:
        stamp(PROBE_BUF, probe + 3, as_dep(tl.sum(l_i, 0)))
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out_rows = b * stride_ob + heads * stride_oh
    if SPLIT:
        n_used = tl.cdiv(seq_len, tl.maximum(chunk_len, 1))
        write = tl.where(split < n_used, g_ok, False)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        o_rows = b * stride_pb + heads * stride_ph
        lse_rows = b * stride_lb + heads * stride_lh
        tl.store(LSE_PART + lse_rows + split, lse, mask=write)
        part = O_PART + o_rows[:, None] + split * stride_ps + d[None, :]
        tl.store(part, acc1 / l_safe[:, None], mask=write[:, None])
        tl.store(part + HALF, acc2 / l_safe[:, None], mask=write[:, None])
        if MERGE:
            last_one = _arrive_last(COUNTERS, pid, num_splits)
            if PROBE_ON:
                stamp(PROBE_BUF, probe + 4, last_one.to(tl.int32))
            if last_one:
                if BLOCK_M == BLOCK_G:
                    den = _merge_splits(O_PART, LSE_PART, OUT, o_rows, lse_rows, out_rows, g_ok, n_used, stride_ps,
                                        stride_od, BLOCK_G, BLOCK_S, 2 * HALF)  # fmt: skip
                else:  # the group's rows only: more splits a merge step in the same tile
                    m_heads = kvh * GROUP + tl.arange(0, BLOCK_M)
                    den = _merge_splits(O_PART, LSE_PART, OUT, b * stride_pb + m_heads * stride_ph,
                                        b * stride_lb + m_heads * stride_lh, b * stride_ob + m_heads * stride_oh,
                                        tl.arange(0, BLOCK_M) < GROUP, n_used, stride_ps, stride_od, BLOCK_M, BLOCK_S,
                                        2 * HALF)  # fmt: skip
                if PROBE_ON:
                    stamp(PROBE_BUF, probe + 5, as_dep(tl.sum(den, 0)))
    else:
        dst = OUT + out_rows[:, None] + d[None, :] * stride_od
        tl.store(dst, (acc1 / l_safe[:, None]).to(OUT.dtype.element_ty), mask=g_ok[:, None])
        tl.store(dst + HALF * stride_od, (acc2 / l_safe[:, None]).to(OUT.dtype.element_ty), mask=g_ok[:, None])


def decode_rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """One decode token per sequence: q [B, Hq, D], k / v [B, Hkv, D] before rotary (unit stride along D; views of
    a fused projection are fine), positions / slots [B] (slots resolved: no -1), caches [num_blocks, page, Hkv,
    D], block_tables [B, max_blocks] int32, seq_lens [B] int32 counting the new token -> [B, Hq, D] in q's dtype.
    The rotated k and v land in the caches at `slots`. No host sync: graph-capturable. pdl: launched with
    programmatic dependent launch where the device has it (`kernels.pdl`): placed while the kernel before runs."""
    check_paged_inputs(_decode_rope_attention_kernel, q, k_cache, v_cache, block_tables, seq_lens)
    b, n_heads, head_dim = q.shape
    nb, page, n_kv = k_cache.shape[:3]
    if k.shape != (b, n_kv, head_dim) or v.shape != k.shape or any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError(f"decode_rope_attention: k {tuple(k.shape)} / v {tuple(v.shape)} must be [B={b}, "
                         f"Hkv={n_kv}, D={head_dim}] and q, k, v unit-strided along D")  # fmt: skip
    if positions.shape != (b,) or slots.shape != (b,) or (b > 1 and (positions.stride(0) != 1 or slots.stride(0) != 1)):
        raise ValueError("decode_rope_attention needs contiguous positions / slots of shape [B]")
    if inv_freq.dtype != torch.float32 or inv_freq.numel() != head_dim // 2:
        raise ValueError(f"inv_freq must be float32 [{head_dim // 2}], got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_rope_attention addresses the caches by slot: they must be contiguous")
    if head_dim < 32:
        raise ValueError(f"decode_rope_attention needs a head size of at least 32 (two halves >= 16), got {head_dim}")
    group = n_heads // n_kv
    meta = DECODE_META
    block_n = meta["block_n"] if head_dim <= 128 else meta["block_n"] // 2
    max_ctx = block_tables.shape[1] * page
    if num_splits is None:
        num_splits = choose_num_splits(b * n_kv, max_ctx, num_sms(q.device), meta["split_waves"], block_n)
    num_splits = clamp_splits(num_splits, max_ctx, block_n)
    kc, vc = k_cache.view(nb * page, n_kv, head_dim), v_cache.view(nb * page, n_kv, head_dim)
    out = torch.empty((b, n_heads, head_dim), dtype=q.dtype, device=q.device)
    split = num_splits > 1
    counters = None
    if split:
        o_part = torch.empty(b, n_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(b, n_heads, num_splits, device=q.device, dtype=torch.float32)
        counters = split_counters(q.device, b * n_kv)
    else:
        o_part = lse_part = out
    block_g = max(16, triton.next_power_of_2(group))
    block_m = triton.next_power_of_2(group) if meta.get("tight_merge") else block_g  # the merge's rows
    probe = None if interpreting() else PROBE  # the interpreter has no timer
    fp32_dot = dot_in_fp32(_decode_rope_attention_kernel, q.dtype)
    _decode_rope_attention_kernel[(b * n_kv, num_splits)](
        q, k, v, positions, inv_freq, slots, kc, vc, block_tables, seq_lens, out, o_part, lse_part,
        seq_lens if counters is None else counters, seq_lens if probe is None else probe.buf,
        n_kv, num_splits, scale * LOG2E, 0 if probe is None else probe.take(b * n_kv * num_splits, STAMPS),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        GROUP=group, BLOCK_G=block_g, HALF=head_dim // 2, PAGE_SIZE=page, BLOCK_N=block_n, SPLIT=split,
        MERGE=counters is not None, BLOCK_S=merge_block_s(block_m, num_splits, head_dim, meta.get("merge_tile")),
        DOT_PRECISION=dot_precision(q.dtype, fp32_dot), DOT_FP32=fp32_dot, EARLY=EARLY_LOADS,
        PROBE_ON=probe is not None, N_STAMPS=STAMPS, BLOCK_M=block_m,
        num_warps=meta["num_warps"], num_stages=meta["num_stages"], **launch_meta(q.device, pdl, kind="attention"),
        **({"maxnreg": meta["maxnreg"]} if meta.get("maxnreg") else {}),
    )  # fmt: skip
    if split and counters is None:
        from tlt_rt.codegen.kernels.decode_attention import combine_splits

        combine_splits(o_part, lse_part, out)
    return out
