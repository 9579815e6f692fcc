"""Matmul of a decode step's 9-64 rows (a batch, a speculative step's verify rows): y [M, N] = x [M, K] @ W[N, K]^T
(+ bias), on tensor cores with the weight as the MMA's wide side and split over K where the weight has few rows.

With M rows of activations and a weight read once per step, the step streams the weight. Products x . W^T put M
(16-64) on the MMA's row side, below Hopper's 64-row warpgroup tile; here each program computes W-slab . x^T
instead ([BLOCK_N weight rows, BLOCK_M activation rows], the transposed output), so the weight fills the wide side
and its tiles go from global memory through the software pipeline's shared-memory stages straight into the MMA
(16-bit operands loaded as they are stored: no conversion of the slab in registers, which the CUDA-core
`skinny_gemm` path needs). A weight of few rows (a Qwen2.5-Coder-1.5B o or down projection: 1,536) gives few
programs of BLOCK_N rows; those split K into SPLIT parts so that about `programs` programs (two waves of the SMs
by default) keep weight bytes in flight on every SM. Each part stores its fp32 partial and counts itself in; the
last to arrive sums the partials in split order (the same sum whichever program comes last: results are
deterministic), then adds the bias, applies SwiGLU (a stacked [gate; up] weight) and stores. With PDL the
programs wait for the kernel before (`kernels.pdl`) before their first load and signal the next one once their
loop is done.

`rows_linear_reference` is the plain-torch function it computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tlt_rt.codegen.kernels import pdl as pdl_module
from tlt_rt.codegen.kernels.paged import num_sms, split_counters
from tlt_rt.codegen.kernels.pdl import enter, interpreting, launch_meta, leave

__all__ = ["ROWS_META", "MIN_ROWS", "MAX_ROWS", "rows_linear", "rows_linear_reference", "rows_split", "supported"]

MIN_ROWS, MAX_ROWS = 9, 64  # 2-8 rows stay on CUDA cores (skinny_gemm) or cuBLAS; a block of 16 is tl.dot's least
# Launch meta: a program's weight rows (the MMA's M: 64 = one warpgroup's tile), K per pipeline stage, stages in
# flight, and the programs a launch aims for (0: two per SM) when it splits K.
ROWS_META = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "programs": 0}
MIN_SPLIT_TILES = 2  # fewest BLOCK_K tiles a split streams: below that its partial's store and sum cost more


@triton.jit
def _mma(w, xt, acc, PRODUCTS: tl.constexpr):
    """acc += w [BLOCK_N, BLOCK_K] . xt [BLOCK_K, BLOCK_M]: 16-bit operands as loaded (PRODUCTS 0), or IEEE fp32
    products (1: fp32 weights, and the interpreter, whose 16-bit dot is unreliable)."""
    if PRODUCTS == 0:
        return tl.dot(w, xt, acc)
    return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _finish(acc, acc_up, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, stride_ym, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    """Store rows rm, columns rn of y from the transposed fp32 sums acc [BLOCK_N, BLOCK_M] (acc_up: the up half's):
    bias, then silu(gate) * up with gate and up rounded to y's dtype first, as the unfused matmul + swiglu."""
    dtype = y_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if SWIGLU:
            acc_up += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if SWIGLU:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    out = y_ptr + rm[None, :] * stride_ym + rn[:, None]
    tl.store(out, acc.to(dtype), mask=m_ok[None, :] & n_ok[:, None])


@triton.jit
def _rows_kernel(
    # pointers
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] ([2N, K]: stacked [gate; up] with SWIGLU)
    b_ptr,  # [N] ([2N]) with HAS_BIAS
    y_ptr,  # [M, N]
    part_ptr,  # [SPLIT parts, N (2N), BLOCK_M] fp32 partial sums (with SPLIT)
    count_ptr,  # [>= N / BLOCK_N] int32 arrival counters, zero between launches (with SPLIT)
    # sizes
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    # strides
    stride_xm,
    stride_wn,
    stride_ym,
    # meta
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRODUCTS: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    # rows past N read row N - 1 (no mask along N in the loop); their sums are never stored
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # SWIGLU: rows N + rn of W (the up half)
    enter(PDL)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + rk
        k_ok = kk < k_hi
        xt = tl.load(x_ptr + rm[None, :] * stride_xm + kk[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
        acc = _mma(w, xt, acc, PRODUCTS)
        if SWIGLU:
            w_up = tl.load(w_rows + N * stride_wn + kk[None, :], mask=k_ok[None, :], other=0.0)
            acc_up = _mma(w_up, xt, acc_up, PRODUCTS)
    leave(PDL)
    if SPLIT:
        rows_total = N * 2 if SWIGLU else N
        part = part_ptr + (pid_k * rows_total + rn).to(tl.int64)[:, None] * BLOCK_M + rm[None, :]
        tl.store(part, acc, mask=n_ok[:, None])
        if SWIGLU:
            tl.store(part + N * BLOCK_M, acc_up, mask=n_ok[:, None])
        tl.debug_barrier()  # every thread's partial stored before the (release) count
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            tl.store(count_ptr + pid_n, 0)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(0, tl.num_programs(1)):  # split order, whichever program arrived last
                p = part_ptr + (s * rows_total + rn).to(tl.int64)[:, None] * BLOCK_M + rm[None, :]
                acc += tl.load(p, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    acc_up += tl.load(p + N * BLOCK_M, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
            _finish(acc, acc_up, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, stride_ym, HAS_BIAS, SWIGLU)
    else:
        _finish(acc, acc_up, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, stride_ym, HAS_BIAS, SWIGLU)


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True where the kernel applies: MIN_ROWS-MAX_ROWS rows of a 16-bit type (fp32 under the interpreter), at
    least 16 elements a row, a row-contiguous weight of the same dtype, a Triton device."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    dtypes = (torch.float16, torch.bfloat16, torch.float32) if interpreting() else (torch.float16, torch.bfloat16)
    return (
        (x.is_cuda or interpreting())
        and x.dtype in dtypes
        and MIN_ROWS <= rows <= MAX_ROWS
        and x.shape[-1] >= 16
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.shape[-1] == weight.shape[1]
        and x.device == weight.device
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )


def rows_split(n_blocks: int, k: int, block_k: int, programs: int) -> tuple[int, int]:
    """(parts, K per part) for `n_blocks` programs along N of rows of `k` elements: about `programs` programs in
    all, each part at least MIN_SPLIT_TILES tiles of `block_k`, K per part a whole number of tiles."""
    tiles = triton.cdiv(k, block_k)
    want = max(1, min(round(programs / n_blocks), tiles // MIN_SPLIT_TILES))
    per_part = triton.cdiv(tiles, want) * block_k
    return triton.cdiv(k, per_part), per_part


def rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    pdl: bool | int = False,
    meta: dict | None = None,
) -> torch.Tensor:
    """x [..., K] (MIN_ROWS-MAX_ROWS rows) @ weight [N, K]^T (+ bias) -> [..., N]; with swiglu the weight is a
    stacked [gate; up] ([2I, K]) and the result silu(x @ gate^T) * (x @ up^T), [..., I]. pdl: launched with
    programmatic dependent launch (`kernels.pdl`) where the device has it. meta: ROWS_META's keys."""
    if not supported(x, weight, bias):
        raise ValueError(
            f"rows_linear needs {MIN_ROWS}-{MAX_ROWS} rows of a 16-bit type, rows of >= 16 elements and a weight [N, "
            f"K] of the same dtype with unit stride along K; got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype} stride {weight.stride()}"
        )
    cfg = {**ROWS_META, **(meta or {})}
    n, k = weight.shape
    if swiglu:
        if n % 2:
            raise ValueError(f"swiglu needs a stacked [gate; up] weight with an even row count, got {n}")
        n //= 2
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    block_n, block_k = cfg["block_n"], min(cfg["block_k"], max(16, triton.next_power_of_2(k)))
    n_blocks = triton.cdiv(n, block_n)
    programs = cfg["programs"] or 2 * num_sms(x.device)
    parts, per_part = rows_split(n_blocks, k, block_k, programs)
    counters = split_counters(x.device, n_blocks) if parts > 1 else None
    if counters is None:  # one part (or, while capturing, no counters yet: the whole K a program)
        parts, per_part = 1, triton.cdiv(k, block_k) * block_k
    partials = torch.empty((parts, 2 * n if swiglu else n, block_m), dtype=torch.float32, device=x.device)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _rows_kernel[(n_blocks, parts)](
        x2, weight, bias if bias is not None else weight, y, partials, counters if counters is not None else y,
        m, n, k, per_part,
        x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SWIGLU=swiglu, SPLIT=parts > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=cfg["num_stages"],
        # not this module's `interpreting`, which the compile check lifts to launch on CPU tensors
        PRODUCTS=0 if x.dtype != torch.float32 and not pdl_module.interpreting() else 1,
        num_warps=cfg["num_warps"],
        **launch_meta(x2.device, pdl),
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)


def rows_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False
) -> torch.Tensor:
    """What `rows_linear` computes, in plain torch (fp32 sums, the SwiGLU halves rounded to x's dtype first)."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if not swiglu:
        return y.to(x.dtype)
    gate, up = y.to(x.dtype).float().chunk(2, dim=-1)
    return (F.silu(gate).to(x.dtype).float() * up).to(x.dtype)
