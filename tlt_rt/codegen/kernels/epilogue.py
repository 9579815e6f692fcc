"""The matmul epilogue the decode kernels share (`skinny_gemm`, `norm_linear`, `rows_gemm`): the bias, then SwiGLU of
a stacked [gate; up] weight's two halves, rounded as the unfused matmul and activation would round them."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bias_swiglu"]


@triton.jit
def bias_swiglu(acc, acc_up, b_ptr, y_ptr, rn, n_ok, N, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    """acc [M, BLOCK_N] fp32 sums of output columns rn (acc_up: the up half's, rows N + rn of the weight) -> fp32: the
    bias (both halves' with SWIGLU), then silu(gate) * up with gate and up rounded to y's dtype first."""
    dtype = y_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    return acc
