"""The weight-side checks the decode matmul kernels share (`skinny_gemm`, `rows_gemm`, `tp_sum`): each launcher adds
its own limits on rows, dtypes and device."""

from __future__ import annotations

import torch

__all__ = ["weight_fits"]


def weight_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True where `weight` can multiply rows x [..., K] in these kernels: [N, K], unit stride along K, x's dtype and
    device; a bias, where given, of x's dtype and contiguous."""
    return (
        weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.shape[-1] == weight.shape[1]
        and x.device == weight.device
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )
