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

import functools

import torch
import triton
import triton.language as tl

from tlt_rt.models.attention import paged_attention_reference

__all__ = [
    "choose_num_splits",
    "paged_attention_reference",
    "paged_decode_attention",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_CHUNK = 256  # fewest context positions per split: below this the combine step costs more than it saves
MAX_SPLITS = 64
# Launch meta-parameters (head_dim <= 128; 256 halves block_n). `benchmarks/bench_attention.py --tune`
# sweeps them on a GPU; split_waves is how many waves of programs split-K aims for.
DECODE_META = {"block_n": 64, "num_warps": 4, "num_stages": 2, "split_waves": 2}
LOG2E = 1.4426950408889634


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
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(LSE_PART + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)
        tl.store(O_PART + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
                 o, mask=g_ok[:, None])  # fmt: skip
    else:
        tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(OUT.dtype.element_ty), mask=g_ok[:, None])  # fmt: skip


@triton.jit
def _combine_splits_kernel(
    # pointers
    O_PART,  # [N, Hq, S, D] fp32
    LSE_PART,  # [N, Hq, S] fp32, base 2; -inf marks an empty split
    OUT,  # [N, Hq, D]
    # sizes
    n_heads,
    num_splits,
    # strides
    stride_pn, stride_ph, stride_ps,
    stride_ln, stride_lh,
    stride_on, stride_oh, stride_od,
    # meta
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    n = pid // n_heads
    h = pid % n_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    lse = tl.load(LSE_PART + n * stride_ln + h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights all 0, output 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    o = tl.load(O_PART + n * stride_pn + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                mask=s_ok[:, None], other=0.0)  # fmt: skip
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(OUT + n * stride_on + h * stride_oh + offs_d * stride_od, out.to(OUT.dtype.element_ty))


# ----------------------------------------------------------------------------------------------- host side
@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_num_splits(work_items: int, max_ctx: int, sm_count: int, waves: int = 2, min_chunk: int = MIN_CHUNK) -> int:
    """Splits per (sequence, KV head[, query block]) so that about `waves` waves of programs fill the GPU.

    `work_items` is the number of programs without split-K, `max_ctx` the longest context the block table
    can hold; each split keeps at least `min_chunk` positions of it. Host ints only: stable under capture.
    """
    target = waves * sm_count
    if work_items >= target:
        return 1
    want = triton.cdiv(target, work_items)
    return max(1, min(want, max_ctx // min_chunk, MAX_SPLITS))


def split_plan(num_splits: int, max_ctx: int, block_n: int) -> tuple[int, int]:
    """(num_splits, chunk_len): chunks are whole tiles of block_n positions, none left empty by rounding."""
    chunk = triton.cdiv(triton.cdiv(max(max_ctx, 1), num_splits), block_n) * block_n
    return triton.cdiv(max(max_ctx, 1), chunk), chunk


def check_paged_inputs(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:  # fmt: skip
    """Shape/dtype/device checks shared by the paged attention launchers (no device sync)."""
    if q.device.type != "cuda" and compiled_for_gpu(kernel):
        raise RuntimeError(f"Triton attention on {q.device} needs TRITON_INTERPRET=1 set before importing it")
    assert q.dim() == 3, f"q must be [N, Hq, D], got {tuple(q.shape)}"
    assert k_cache.dim() == 4, f"k_cache must be [num_blocks, page, Hkv, D], got {tuple(k_cache.shape)}"
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    n_heads, head_dim = q.shape[1:]
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape[3] == head_dim, f"head_dim: q has {head_dim}, cache has {k_cache.shape[3]}"
    assert n_heads % n_kv == 0, f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv}"
    assert head_dim in (16, 32, 64, 128, 256), f"head_dim must be a power of 2 in 16..256, got {head_dim}"
    assert page & (page - 1) == 0, f"block_size must be a power of 2, got {page}"
    assert q.dtype in SUPPORTED_DTYPES, f"dtype {q.dtype} not in {SUPPORTED_DTYPES}"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, (
        f"q/k_cache/v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
    )
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2, (
        f"block_tables must be [B, max_blocks] int32, got {tuple(block_tables.shape)} {block_tables.dtype}"
    )
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    b = block_tables.shape[0]
    assert seq_lens.shape == (b,) and seq_lens.dtype == torch.int32, (
        f"seq_lens must be [B={b}] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
    )
    assert seq_lens.is_contiguous(), "seq_lens must be contiguous"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        assert t.device == q.device, f"{name} is on {t.device}, q on {q.device}"


def compiled_for_gpu(kernel) -> bool:
    """False when `kernel` was decorated under TRITON_INTERPRET=1 (then it runs on CPU tensors)."""
    return isinstance(kernel, triton.runtime.JITFunction)


def dot_in_fp32(kernel, dtype: torch.dtype) -> bool:
    """True only for bf16 under Triton's interpreter, whose tl.dot multiplies bf16 bit patterns as integers
    (numpy has no bf16): there the operands are widened to fp32 (bf16 -> fp32 is exact). Compiled kernels
    always use the bf16 tensor-core dot."""
    return dtype == torch.bfloat16 and not compiled_for_gpu(kernel)


def dot_precision(dtype: torch.dtype, fp32_dot: bool = False) -> str:
    # fp32 operands keep full precision (no tf32) so they match the fp32 reference closely
    return "ieee" if dtype == torch.float32 or fp32_dot else "tf32"


def combine_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge split-K partials o_part [N, Hq, S, D] fp32 and lse_part [N, Hq, S] (base 2) into out [N, Hq, D]."""
    n, n_heads, num_splits, head_dim = o_part.shape
    assert o_part.dtype == torch.float32 and o_part.stride(3) == 1, "o_part must be fp32 with contiguous D"
    assert lse_part.shape == (n, n_heads, num_splits) and lse_part.stride(2) == 1, "lse_part must be [N, Hq, S]"
    assert out.shape == (n, n_heads, head_dim), f"out must be [N, Hq, D], got {tuple(out.shape)}"
    _combine_splits_kernel[(n * n_heads,)](
        o_part, lse_part, out,
        n_heads, num_splits,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
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
    num_splits = max(1, min(num_splits, triton.cdiv(max(max_ctx, 1), block_n)))

    out = torch.empty_like(q)
    fp32_dot = dot_in_fp32(_decode_attention_kernel, q.dtype)
    split = num_splits > 1
    if split:
        o_part = torch.empty(b, n_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(b, n_heads, num_splits, device=q.device, dtype=torch.float32)
    else:
        o_part = lse_part = out  # unused by the kernel
    _decode_attention_kernel[(b * n_kv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, o_part, lse_part,
        n_kv, num_splits, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE_SIZE=page,
        BLOCK_N=block_n, SPLIT=split, DOT_PRECISION=dot_precision(q.dtype, fp32_dot), DOT_FP32=fp32_dot,
        num_warps=meta["num_warps"], num_stages=meta["num_stages"],
    )  # fmt: skip
    if split:
        combine_splits(o_part, lse_part, out)
    return out
