"""The pieces a forward runs between its matmuls and attention (norms, rotary, activation, the KV write), and
the fused projections of inference.

`Glue` holds the plain-torch references; every norm, rotary, attention and MLP module routes through the
`glue` it is given (`set_glue`), so a caller can swap in other implementations of the same functions:
`CompiledGlue` (torch.compile'd, here) or one with device kernels (`tlt_rt.codegen.model_kernels`, which the
engine installs on CUDA). Models never import those kernels themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tlt_rt.models.arch import rotate_pair
from tlt_rt.models.attention import write_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def embed_cat(weight: torch.Tensor, ids: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
    """[weight[ids], feature] along the last dim, in the feature's dtype (an EAGLE drafter's fc input);
    compiled, one kernel for the gather and the concatenation."""
    return torch.cat([F.embedding(ids, weight).to(feature.dtype), feature], dim=-1)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add then RMSNorm: returns (x + r, rms_norm(x + r)); compiled, one kernel for both."""
    s = x + r
    return s, rms_norm(s, weight, eps)


class FusedLinears:
    """Several nn.Linear layers reading the same input, run as one matmul over their concatenated weights.

    The layers keep their own parameters (state_dict, checkpoints and in-place weight updates are unchanged):
    each weight becomes a view into the concatenated tensor, so a `copy_` into one updates the fused matmul.
    Anything that re-allocates a weight (`.to()`, assigning `.data`) breaks the sharing; `intact()` sees that
    and callers fall back to the separate layers.
    """

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight.detach() for lin in linears])
            has_bias = [lin.bias is not None for lin in linears]
            if any(has_bias) and not all(has_bias):
                raise ValueError("fused linears need a bias on all of them or on none")
            self.bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
            start = 0
            for lin, n in zip(linears, self.sizes, strict=True):
                lin.weight.data = self.weight[start : start + n]
                if self.bias is not None:
                    lin.bias.data = self.bias[start : start + n]
                start += n
        self._ptrs = self._pointers()

    def _pointers(self) -> list[int]:
        return [lin.weight.data_ptr() for lin in self.linears] + [self.weight.data_ptr()]

    def intact(self) -> bool:
        """True while every layer's weight is still a view into the fused tensor (and no gradient is wanted)."""
        return not torch.is_grad_enabled() and self._pointers() == self._ptrs

    def __call__(self, x: torch.Tensor, linear=F.linear) -> list[torch.Tensor]:
        return list(linear(x, self.weight, self.bias).split(self.sizes, dim=-1))


def apply_linear(glue: Glue, lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """lin(x), through `glue.linear` where lin is a plain nn.Linear (tensor-parallel layers run as they are)."""
    if type(lin) is nn.Linear:
        return glue.linear(x, lin.weight, lin.bias)
    return lin(x)


def fuse_linears(current: FusedLinears | None, linears: list[nn.Linear]) -> FusedLinears | None:
    """`current` while it is intact, else a fresh FusedLinears over `linears`; None where they cannot fuse."""
    if current is not None and current.intact():
        return current
    return FusedLinears(linears) if _fusable(*linears) else None


def _fusable(*linears) -> bool:
    """Plain nn.Linear layers of one dtype / device / input size, or layers that say they compute F.linear of their
    input in inference (a class attribute `fusable = True`: the column-parallel shards of tensor parallelism, whose
    q/k/v and gate/up slices then run as one matmul on each rank, as on one GPU); row-parallel shards, which sum
    over the ranks, are left alone."""
    first = linears[0].weight
    return all(
        (type(lin) is nn.Linear or getattr(type(lin), "fusable", False))
        and lin.weight.dtype == first.dtype
        and lin.weight.device == first.device
        and lin.in_features == linears[0].in_features
        for lin in linears
    )


class Glue:
    """The elementwise pieces between the matmuls and attention. Plain torch by default; on CUDA the engine
    swaps in compiled versions with device kernels (`tlt_rt.codegen.model_kernels.engine_glue`), which fuse
    each into one kernel and cut the launches a decode step makes by more than half."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rotate_pair = staticmethod(rotate_pair)
    swiglu = staticmethod(swiglu)
    embed_cat = staticmethod(embed_cat)
    linear = staticmethod(F.linear)

    def linear_swiglu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """swiglu(gate, up) from a stacked [gate; up] weight (a fused gate/up projection)."""
        gate, up = self.linear(x, weight, bias).chunk(2, dim=-1)
        return self.swiglu(gate, up)

    def _add_norm(self, x: torch.Tensor, r: torch.Tensor | None, norm_weight: torch.Tensor, eps: float):
        if r is None:
            return x, self.rms_norm(x, norm_weight, eps)
        return self.add_rms_norm(x, r, norm_weight, eps)

    def add_norm_linear(
        self,
        x: torch.Tensor,
        r: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, linear(rms_norm(s))) with s = x + r (x where r is None): a residual add, the norm after it and the
        projection that reads it (a layer's fused q/k/v), which a device glue may run as one kernel."""
        s, h = self._add_norm(x, r, norm_weight, eps)
        return s, self.linear(h, weight, bias)

    def add_norm_linear_swiglu(
        self,
        x: torch.Tensor,
        r: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, linear_swiglu(rms_norm(s))) with s = x + r: `add_norm_linear` for a stacked [gate; up] weight."""
        s, h = self._add_norm(x, r, norm_weight, eps)
        return s, self.linear_swiglu(h, weight, bias)

    def rope_write(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        resolved: bool = False,
    ) -> torch.Tensor:
        """Rotate q and k, write k and v to the paged cache at `slots`; returns the rotated q."""
        q, k = self.rotate_pair(q, k, positions, inv_freq)
        write_kv(k, v, k_cache, v_cache, slots, resolved)
        return q


# variants one glue function is compiled in within one process: an RL worker runs each in the engine (no
# gradients, its batch of one a shape of its own), the drafter's trainer (fp32 under autocast) and the learner
# (gradients, bf16, a micro-batch of one its own shape again) -- more than dynamo's default of 8, past which a
# variant silently runs eagerly
GLUE_RECOMPILE_LIMIT = 32


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo keep at least `limit` compiled variants of a function (never lowers a larger setting)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the current name, and the older one
        if hasattr(cfg, name) and getattr(cfg, name) < limit:
            setattr(cfg, name, limit)


class CompiledGlue(Glue):
    """The elementwise pieces through torch.compile (dynamic shapes), each fused into one kernel.

    `pieces`: another glue whose functions to take instead of compiling anew (a CompiledGlue's, with the
    graphs they already hold)."""

    COMPILED = ("rms_norm", "add_rms_norm", "rotate_pair", "swiglu", "embed_cat")

    def __init__(self, pieces: Glue | None = None) -> None:
        if pieces is not None:
            for name in self.COMPILED:
                setattr(self, name, getattr(pieces, name))
            return
        # not fullgraph: past dynamo's recompile limit (8 variants a function; a process with several models,
        # dtypes and call sites reaches it, seen with embed_cat in the GPU tests) a variant runs eagerly, where
        # fullgraph turns the limit into an error
        opts = {"dynamic": True}
        raise_recompile_limit(GLUE_RECOMPILE_LIMIT)
        self.rms_norm = torch.compile(rms_norm, **opts)
        self.add_rms_norm = torch.compile(add_rms_norm, **opts)
        self.rotate_pair = torch.compile(rotate_pair, **opts)
        self.swiglu = torch.compile(swiglu, **opts)
        self.embed_cat = torch.compile(embed_cat, **opts)
