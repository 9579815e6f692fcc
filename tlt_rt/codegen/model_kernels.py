"""The model's glue with the Triton kernels the engine runs on CUDA, and the choice of where they run.

Models hold the plain-torch glue and its torch.compile'd form (tlt_rt/models/glue.py) and never import Triton;
the engine hands its model this one (`engine_glue`), as it hands it an attention backend (backend.py):
    rope_write -> kernels.rope_cache.rope_write_kv: rotary and the paged KV write as one kernel, on CUDA with
                  resolved slots (the paged forward's); elsewhere the reference
    linear, linear_swiglu -> kernels.skinny_gemm, only with skinny=True and no gradients (the kernel itself
                  sends what it does not win, more rows or small weights, to F.linear)
    add_norm_linear, add_norm_linear_swiglu -> kernels.norm_linear: the residual add, RMSNorm and the projection
                  after it in one launch, with fused_norm=True, no gradients and at most norm_rows rows (a decode
                  step's q/k/v and gate/up at small batch); elsewhere the two-kernel reference
With pdl=True these kernels are launched with programmatic dependent launch where the GPU has it (`kernels.pdl`),
with prefetch=True each also pulling its weight slab into L2 while the kernel before it runs. `decode_chain` sets
a one-row step's kernels as `rollout.decode_chain` / `rollout.pdl` ask.
Kernel modules are imported on first use, so importing this module never needs Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tlt_rt.models.glue import CompiledGlue, Glue

if TYPE_CHECKING:
    from tlt_rt.models.llama import CausalLM

__all__ = ["KernelGlue", "engine_glue"]


def _inference_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pdl: bool = False,
    prefetch: bool = False,
    min_weight: int | None = None,
    rows: int = 1,
) -> torch.Tensor:
    """The skinny Triton matmul for few-row inference calls (up to `rows`), F.linear when gradients are wanted or
    the shape is outside its domain."""
    if torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    # local: the kernel imports Triton, a GPU-only dependency that the CPU paths must not need
    from tlt_rt.codegen.kernels.skinny_gemm import skinny_linear

    return skinny_linear(x, weight, bias, pdl=pdl, prefetch=prefetch, min_weight=min_weight, rows=rows)


class KernelGlue(CompiledGlue):
    """CompiledGlue with Triton kernels. skinny: one-row matmuls of large weights through
    `kernels.skinny_gemm` instead of cuBLAS (off by default: on an H100 the Qwen2.5-7B-shaped decode step
    measured the same with it, 5.84 against 5.86 ms at batch 1, within run-to-run noise). fused_rope: on
    CUDA, rotary and the KV-cache write as one Triton kernel (`kernels.rope_cache`). fused_norm: a layer's
    residual add and RMSNorm inside its q/k/v and gate/up projections (`kernels.norm_linear`) for steps of at
    most norm_rows rows: one by default, where it pays on small weights (H200, `step_costs.py --compare`:
    Qwen2.5-Coder-0.5B batch 1 1.13x, 1.5B 1.00x); at 8 rows its CUDA-core products made the step 4-6x slower.
    pdl, prefetch: those Triton matmuls launched with programmatic dependent launch, prefetching their weights
    into L2 while the kernel before runs (`kernels.pdl`; the attention kernel's flag is its backend's).
    skinny_min_weight: the smallest weight (elements) the skinny kernel takes (None: its MIN_WEIGHT; 0 for a step
    of Triton kernels only, as PDL wants). skinny_rows: the most rows the skinny kernel takes (one by default; from
    16 rows of 16-bit weights its products run on tensor cores). max_weight: the largest weight (elements) the
    skinny and norm kernels take, 0 for any (larger ones: cuBLAS, the add + norm as the compiled glue's). pieces: as
    CompiledGlue's (the functions of another glue, taken instead of compiling anew)."""

    def __init__(
        self,
        skinny: bool = False,
        fused_rope: bool = True,
        pieces: Glue | None = None,
        fused_norm: bool = False,
        norm_rows: int = 1,
        pdl: bool = False,
        prefetch: bool = False,
        skinny_min_weight: int | None = None,
        skinny_rows: int = 1,
        max_weight: int = 0,
    ) -> None:
        super().__init__(pieces)
        self.max_weight = max_weight
        self.skinny, self.fused_rope = skinny, fused_rope
        self.fused_norm, self.norm_rows = fused_norm, norm_rows
        self.pdl, self.prefetch, self.skinny_min_weight = pdl, prefetch, skinny_min_weight
        self.skinny_rows = skinny_rows
        if skinny:
            self.linear = self._skinny_linear

    def decode_chain(self, on: bool = True, pdl: bool = False, rows: int = 1, max_weight: int = 0) -> None:
        """Make a decode step's layers a chain of Triton kernels for steps of up to `rows` rows (one by default):
        the add + norm inside q/k/v and gate/up (`fused_norm`), the skinny kernel for every other matmul (o, down,
        the head); with pdl, launched with programmatic dependent launch (the attention kernel joins through its
        backend's `fuse_rope` and `pdl`); weights over `max_weight` elements (0: none) left to cuBLAS. on=False:
        back to the defaults (cuBLAS for the matmuls, fused_norm off, no PDL)."""
        self.fused_norm = self.skinny = on
        self.pdl, self.prefetch = on and pdl, False
        self.skinny_min_weight = 0 if on else None
        self.norm_rows = self.skinny_rows = rows if on else 1
        self.max_weight = max_weight if on else 0
        if on:
            self.linear = self._skinny_linear
        else:
            self.__dict__.pop("linear", None)  # the class's F.linear

    def _takes(self, weight: torch.Tensor) -> bool:
        """Whether the Triton kernels may take this weight (`max_weight`)."""
        return not self.max_weight or weight.numel() <= self.max_weight

    def _skinny_linear(self, x, weight, bias=None):
        if not self._takes(weight):
            return F.linear(x, weight, bias)
        return _inference_linear(x, weight, bias, self.pdl, self.prefetch, self.skinny_min_weight, self.skinny_rows)

    def _norm_kernel(self, x, r, norm_weight, eps, weight, bias, swiglu: bool):
        """The one-launch add + norm + projection (`kernels.norm_linear`) where this glue takes it, else None."""
        if not (self.fused_norm and x.is_cuda and not torch.is_grad_enabled() and x.dim() == 2 and self._takes(weight)):
            return None
        if not 0 < x.shape[0] <= self.norm_rows:
            return None
        # local: Triton, as in _inference_linear
        from tlt_rt.codegen.kernels.norm_linear import norm_linear, norm_linear_supported
        from tlt_rt.codegen.kernels.skinny_gemm import one_or_dot

        if self.skinny_rows > 1 and not one_or_dot(x.shape[0], x.dtype):  # a chain of more rows: not 2-8 of them
            return None

        if not norm_linear_supported(x, r, norm_weight, weight, bias) or (swiglu and weight.shape[0] % 2):
            return None
        return norm_linear(x, r, norm_weight, eps, weight, bias, swiglu=swiglu, pdl=self.pdl, prefetch=self.prefetch)

    def add_norm_linear(self, x, r, norm_weight, eps, weight, bias=None):
        out = self._norm_kernel(x, r, norm_weight, eps, weight, bias, swiglu=False)
        return out if out is not None else super().add_norm_linear(x, r, norm_weight, eps, weight, bias)

    def add_norm_linear_swiglu(self, x, r, norm_weight, eps, weight, bias=None):
        out = self._norm_kernel(x, r, norm_weight, eps, weight, bias, swiglu=True)
        return out if out is not None else super().add_norm_linear_swiglu(x, r, norm_weight, eps, weight, bias)

    def linear_swiglu(self, x, weight, bias=None):
        if self.skinny and not torch.is_grad_enabled() and self._takes(weight):
            # local: Triton, as in _inference_linear
            from tlt_rt.codegen.kernels.skinny_gemm import skinny_swiglu

            # one kernel with the activation as its epilogue, or None
            out = skinny_swiglu(x, weight, bias, self.pdl, self.prefetch, self.skinny_min_weight, self.skinny_rows)
            if out is not None:
                return out
        return super().linear_swiglu(x, weight, bias)

    def rope_write(self, q, k, v, positions, inv_freq, k_cache, v_cache, slots, resolved=False):
        if self.fused_rope and q.is_cuda and resolved:
            # local: Triton, as in _inference_linear
            from tlt_rt.codegen.kernels.rope_cache import rope_write_kv

            return rope_write_kv(q, k, v, positions, inv_freq, k_cache, v_cache, slots)
        return super().rope_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots, resolved)


def engine_glue(model: CausalLM) -> Glue:
    """Give `model` (every norm, rotary, attention and MLP) the glue the engine runs it with on CUDA and return
    it: the KernelGlue it already has (compiled once per model), else a fresh one, which takes over the compiled
    functions of a plain CompiledGlue the model holds (`model.compile_glue()`, a learner's) with their graphs."""
    current = model.model.norm.glue
    if isinstance(current, KernelGlue):
        return current
    return model.compile_glue(KernelGlue(pieces=current if isinstance(current, CompiledGlue) else None))
