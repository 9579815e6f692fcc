"""Residual add, RMSNorm and the projection after them in one kernel, for the few rows of a decode step.

A decoder layer's decode step reads, for its q/k/v and its gate/up projections,

    s = x + r                       (the residual stream; r is the block before's output, none at layer 0)
    h = w_norm * rms_norm(s)        (rounded to the model dtype where the reference rounds)
    y = h @ W^T (+ b)               (or silu(h @ G^T) * (h @ U^T) for a stacked [G; U] weight)

On one GPU that is two launches (the compiled add + norm, then the matmul) and, for gate/up, a third for the
activation; at batch 1 on Qwen2.5-Coder-1.5B each costs ~1.3-1.8 us of a ~56 us layer whatever its size.
Here each program owns BLOCK_N output columns as in `skinny_gemm` (its [BLOCK_N, K] slab of W streamed in
BLOCK_K tiles against every row at once), and first makes one pass over the rows' K elements (a few KB, from
L2) for their sum of squares; program 0 also writes s. The rows are normalised tile by tile in the main loop,
so nothing but s and y is written. Where a row fits one tile (K <= BLOCK_K: the hidden sizes of Qwen2.5-Coder-0.5B
and 1.5B at the one-row tiles of 2,048), the rows and the slab of W are read once, all their loads issued
together. Products run on CUDA cores, accumulating in float32.

The reference is `tlt_rt.models.glue.Glue.add_norm_linear` / `add_norm_linear_swiglu` (the two-kernel path),
which the caller (`tlt_rt.codegen.model_kernels.KernelGlue`) falls back to outside this kernel's domain.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tlt_rt.codegen.kernels import skinny_gemm
from tlt_rt.codegen.kernels.epilogue import bias_swiglu
from tlt_rt.codegen.kernels.pdl import enter, launch_meta, leave
from tlt_rt.codegen.kernels.skinny_gemm import (
    _load_pieces,
    _prefetch_slab,
    _slab_products,
    _tile_products,
    max_rows,
    row_tiles,
    skinny_meta,
    supported,
)

__all__ = ["norm_linear", "norm_linear_supported"]


@triton.jit
def _residual_sum(
    x_ptr, r_ptr, s_ptr, rm, kk, mk, stride_xm, stride_rm, stride_sm, write, dtype: tl.constexpr,
    HAS_RES: tl.constexpr,
):  # fmt: skip
    """s = x (+ r) over columns kk of rows rm (mask mk), rounded to the model dtype as the reference's add rounds;
    where `write` (program 0, once) s also goes out to s_ptr, the residual stream after the add."""
    s = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=mk, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + rm[:, None] * stride_rm + kk[None, :], mask=mk, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
        if write:
            tl.store(s_ptr + rm[:, None] * stride_sm + kk[None, :], s, mask=mk)
    return s


@triton.jit
def _normed(s, rstd, nw_ptr, kk, k_ok, dtype: tl.constexpr):
    """h = w_norm * (s * rstd) over columns kk, rounded as the reference's two steps round, fp32 [M, BLOCK_K]
    (ready for the slab / tile products)."""
    nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    normed = (s.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
    return (nw[None, :] * normed).to(dtype).to(tl.float32)


@triton.jit
def _piece_sum(
    x_ptr, r_ptr, s_ptr, rm, m_ok, K, stride_xm, stride_rm, stride_sm, write, dtype: tl.constexpr,
    HAS_RES: tl.constexpr, START: tl.constexpr, SIZE: tl.constexpr,
):  # fmt: skip
    """(s, sum of s^2 per row) over columns START .. START + SIZE (`_residual_sum`); (0.0, 0.0) for an absent piece."""
    if SIZE > 0:
        kk = START + tl.arange(0, SIZE)
        mk = m_ok[:, None] & (kk < K)[None, :]
        s = _residual_sum(x_ptr, r_ptr, s_ptr, rm, kk, mk, stride_xm, stride_rm, stride_sm, write, dtype, HAS_RES)
        sf = s.to(tl.float32)
        sq = tl.sum(sf * sf, axis=1)
    else:
        s = 0.0
        sq = 0.0
    return s, sq


@triton.jit
def _piece_norm_products(
    s, rstd, nw_ptr, K, w, w_up, acc, acc_up, dtype: tl.constexpr, START: tl.constexpr, SIZE: tl.constexpr,
    SWIGLU: tl.constexpr, PRODUCTS: tl.constexpr,
):  # fmt: skip
    """acc (acc_up) += h = w_norm * (s * rstd) over columns START .. START + SIZE times a loaded piece of W."""
    if SIZE > 0:
        kk = START + tl.arange(0, SIZE)
        h = _normed(s, rstd, nw_ptr, kk, kk < K, dtype)
        acc, acc_up = _slab_products(h, w, w_up, acc, acc_up, SWIGLU, PRODUCTS)
    return acc, acc_up


@triton.jit
def _norm_linear_kernel(
    x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, eps,
    stride_xm, stride_rm, stride_sm, stride_wn, stride_ym,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr, ONE_TILE: tl.constexpr,
    K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr, PRODUCTS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SWIGLU: rows N + rn of W (the up half)
    if ONE_TILE:  # the rows and the slab of W read once, in `row_tiles`' pieces, the slab before the wait (kernels.pdl)
        P1: tl.constexpr = BLOCK_K
        P2: tl.constexpr = BLOCK_K + K1
        P3: tl.constexpr = BLOCK_K + K1 + K2
        w0, u0, w1, u1, w2, u2, w3, u3 = _load_pieces(w_ptr, rn, n_ok, N, K, stride_wn, BLOCK_K, K1, K2, K3, SWIGLU)
        enter(PDL)
        wr = pid == 0
        s0, q0 = _piece_sum(x_ptr, r_ptr, s_ptr, rm, m_ok, K, stride_xm, stride_rm, stride_sm, wr, dtype, HAS_RES, 0,
                            BLOCK_K)  # fmt: skip
        s1, q1 = _piece_sum(x_ptr, r_ptr, s_ptr, rm, m_ok, K, stride_xm, stride_rm, stride_sm, wr, dtype, HAS_RES, P1,
                            K1)  # fmt: skip
        s2, q2 = _piece_sum(x_ptr, r_ptr, s_ptr, rm, m_ok, K, stride_xm, stride_rm, stride_sm, wr, dtype, HAS_RES, P2,
                            K2)  # fmt: skip
        s3, q3 = _piece_sum(x_ptr, r_ptr, s_ptr, rm, m_ok, K, stride_xm, stride_rm, stride_sm, wr, dtype, HAS_RES, P3,
                            K3)  # fmt: skip
        rstd = 1.0 / tl.sqrt((q0 + q1 + q2 + q3) / K + eps)
        acc, acc_up = _piece_norm_products(
            s0, rstd, nw_ptr, K, w0, u0, acc, acc_up, dtype, 0, BLOCK_K, SWIGLU, PRODUCTS
        )
        acc, acc_up = _piece_norm_products(s1, rstd, nw_ptr, K, w1, u1, acc, acc_up, dtype, P1, K1, SWIGLU, PRODUCTS)
        acc, acc_up = _piece_norm_products(s2, rstd, nw_ptr, K, w2, u2, acc, acc_up, dtype, P2, K2, SWIGLU, PRODUCTS)
        acc, acc_up = _piece_norm_products(s3, rstd, nw_ptr, K, w3, u3, acc, acc_up, dtype, P3, K3, SWIGLU, PRODUCTS)
    else:
        if PREFETCH:  # as skinny_gemm's: this program's slab of W into L2 while the kernel before still runs
            _prefetch_slab(w_ptr, rn, N, K, stride_wn, SWIGLU, LINE, LINES)
        enter(PDL)
        acc, acc_up = _two_passes(x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, N, K, eps, stride_xm, stride_rm, stride_sm,
                                  stride_wn, pid, rn, rm, rk, n_ok, m_ok, acc, acc_up, dtype, HAS_RES, SWIGLU,
                                  BLOCK_M, BLOCK_K, PRODUCTS)  # fmt: skip
    leave(PDL)
    acc = bias_swiglu(acc, acc_up, b_ptr, y_ptr, rn, n_ok, N, HAS_BIAS, SWIGLU)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _two_passes(
    x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, N, K, eps, stride_xm, stride_rm, stride_sm, stride_wn,
    pid, rn, rm, rk, n_ok, m_ok, acc, acc_up, dtype: tl.constexpr,
    HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRODUCTS: tl.constexpr,
):  # fmt: skip
    """Rows wider than a tile: a first pass for each row's mean square, then the projection tile by tile."""
    # pass 1: each row's mean square of s = x (+ r), s rounded to the model dtype as the reference's add rounds
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mk = m_ok[:, None] & (kk < K)[None, :]
        s = _residual_sum(x_ptr, r_ptr, s_ptr, rm, kk, mk, stride_xm, stride_rm, stride_sm, pid == 0, dtype, HAS_RES)
        sf = s.to(tl.float32)
        sq += tl.sum(sf * sf, axis=1)
    rstd = 1.0 / tl.sqrt(sq / K + eps)
    # pass 2: the projection of h = w_norm * (s * rstd), each tile normalised as it is read
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        mk = m_ok[:, None] & k_ok[None, :]
        s = _residual_sum(x_ptr, r_ptr, s_ptr, rm, kk, mk, stride_xm, stride_rm, stride_sm, False, dtype, HAS_RES)
        h = _normed(s, rstd, nw_ptr, kk, k_ok, dtype)
        tile = w_ptr + rn[:, None] * stride_wn + kk[None, :]
        acc, acc_up = _tile_products(
            h, tile, n_ok[:, None] & k_ok[None, :], N, stride_wn, acc, acc_up, SWIGLU, PRODUCTS
        )
    return acc, acc_up


def norm_linear_supported(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> bool:
    """True where `norm_linear` applies: rows [M, K] as `skinny_gemm` takes them (M <= `skinny_gemm.max_rows`,
    unit stride along K), a residual of the same shape, dtype and strides along K, a contiguous norm weight [K] of the
    rows' dtype."""
    return (
        x.dim() == 2
        and x.stride(1) == 1
        and supported(x, weight, bias)
        and norm_weight.shape == (x.shape[1],)
        and norm_weight.dtype == x.dtype
        and norm_weight.is_contiguous()
        and norm_weight.device == x.device
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1))
    )


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    meta: dict | None = None,
    pdl: bool = False,
    prefetch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y) for rows x [M, K] (M <= `skinny_gemm.max_rows`): s = x + residual (x itself when residual is None) and
    y = linear(rms_norm(s) * norm_weight, weight, bias) [M, N] in one launch; with swiglu, weight is a stacked
    [gate; up] ([2I, K]) and y = silu(gate) * up [M, I]. pdl, prefetch: as `skinny_gemm.skinny_linear_triton`'s.
    ValueError outside `norm_linear_supported`."""
    if not norm_linear_supported(x, residual, norm_weight, weight, bias):
        raise ValueError(
            f"norm_linear needs rows [M <= {max_rows(x.dtype)}, K] with unit stride along K, a residual like them, "
            f"a norm weight [K] of their dtype and a weight [N, K] as skinny_gemm takes it; got x {tuple(x.shape)} "
            f"{x.dtype}, residual {None if residual is None else tuple(residual.shape)}, norm weight "
            f"{tuple(norm_weight.shape)} {norm_weight.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    m, k = x.shape
    n = weight.shape[0]
    if swiglu:
        if n % 2:
            raise ValueError(f"swiglu needs a stacked [gate; up] weight with an even row count, got {n}")
        n //= 2
    block_m = triton.next_power_of_2(m)
    cfg = meta or skinny_meta(m, weight.shape[0], k)
    s = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = row_tiles(k, cfg, cfg["block_n"] * (2 if swiglu else 1))
    _norm_linear_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x, x if residual is None else residual, norm_weight, s, weight, bias if bias is not None else weight, y,
        m, n, k, float(eps),
        x.stride(0), x.stride(0) if residual is None else residual.stride(0), s.stride(0), weight.stride(0),
        y.stride(0),
        HAS_RES=residual is not None, HAS_BIAS=bias is not None, SWIGLU=swiglu,
        BLOCK_M=block_m, BLOCK_N=cfg["block_n"], **tiles, PRODUCTS=skinny_gemm.products(block_m, weight.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **launch_meta(x.device, pdl, weight.dtype, tiles["BLOCK_K"], prefetch, kind="norm"),
    )  # fmt: skip
    return s, y
