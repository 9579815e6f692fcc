"""The decoder layer of the Llama family and its parts, with HF's parameter names: RMSNorm, rotary, grouped-query
attention, the SwiGLU MLP.

Each part has a dense forward for the learner and, where it differs, a paged one for the engine (attention through
an `AttentionBackend`, K/V written to the paged cache). Norms, rotary, the activation and the inference matmuls run
through the module's `glue` (tlt_rt/models/glue.py), which `set_glue` swaps for a whole model at once.
"""

from __future__ import annotations

import torch
from torch import nn

from tlt_rt.models.arch import ArchConfig, rope_inv_freq
from tlt_rt.models.attention import AttentionBackend, AttnMetadata, causal_attention
from tlt_rt.models.glue import FusedLinears, Glue, apply_linear, fuse_linears


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.glue: Glue = Glue()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.glue.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, norm(x + r)): the residual add fused with the norm that follows it."""
        return self.glue.add_rms_norm(x, r, self.weight, self.eps)


class Rotary(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.arch = arch
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        self.glue: Glue = Glue()

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) casts buffers too: the frequencies stay fp32, recomputed rather than rounded back
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = rope_inv_freq(self.arch).to(self.inv_freq.device)
        return self

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        return self.glue.rotate_pair(q, k, positions, self.inv_freq)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
        )
        h = arch.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=arch.o_bias)
        self.scale = self.head_dim**-0.5
        self.fused: FusedLinears | None = None
        self.glue: Glue = Glue()

    def fuse(self) -> bool:
        """Run q/k/v as one matmul in inference (see FusedLinears); False where the layers cannot be fused."""
        self.fused = fuse_linears(self.fused, [self.q_proj, self.k_proj, self.v_proj])
        return self.fused is not None

    def _fused(self) -> FusedLinears | None:
        return self.fused if self.fused is not None and self.fused.intact() else None

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [..., Hq, D], k and v [..., Hkv, D] before rotary (views of one matmul's output when fused)."""
        fused = self._fused()
        if fused is not None:
            return self._heads(*fused(x, self.glue.linear))
        return self._heads(self.q_proj(x), self.k_proj(x), self.v_proj(x))

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        shape = q.shape[:-1]
        q = q.view(*shape, self.n_heads, self.head_dim)
        k = k.view(*shape, self.n_kv, self.head_dim)
        v = v.view(*shape, self.n_kv, self.head_dim)
        return q, k, v

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary):
        q, k, v = self._project(x)
        q, k = rotary(q, k, positions)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        q, k, v = self._qkv(x, positions, rotary)  # [B, T, H, D]
        out = causal_attention(q, k, v, self.scale)
        return self.o_proj(out.flatten(-2))

    def forward_paged(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q = self.project_write(x, positions, rotary, k_cache, v_cache, meta)
        return self.attend(q, k_cache, v_cache, meta, backend)

    def project_write(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
    ) -> torch.Tensor:
        """q/k/v of the rows x [N, H], rotary applied, K/V written to the cache at meta.slot_mapping; returns the
        rotated q [N, Hq, D]."""
        return self._rope_write(*self._project(x), positions, rotary, k_cache, v_cache, meta)

    def _rope_write(self, q, k, v, positions, rotary: Rotary, k_cache, v_cache, meta: AttnMetadata) -> torch.Tensor:
        return self.glue.rope_write(
            q, k, v, positions, rotary.inv_freq, k_cache, v_cache, meta.slot_mapping, meta.slots_resolved
        )

    def norm_project(
        self, x: torch.Tensor, r: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(s, q, k, v) with s = x + r (x where r is None) and q / k / v the projections of norm(s) before rotary,
        the add and the norm reaching the glue together with the fused q/k/v projection (`Glue.add_norm_linear`:
        one kernel where it fuses them)."""
        fused = self._fused()
        if fused is None:
            s, h = (x, norm(x)) if r is None else norm.add(x, r)
            return (s, *self._project(h))
        s, qkv = self.glue.add_norm_linear(x, r, norm.weight, norm.eps, fused.weight, fused.bias)
        return (s, *self._heads(*qkv.split(fused.sizes, dim=-1)))

    def write_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Rotary on q and k, their K/V into the cache, paged attention and the output projection: [N, H]. The first
        three are one kernel where the backend has it for this step (`rope_decode`: decode steps), else the glue's
        `rope_write` and then the backend."""
        # the backend's fused kernel answers None where it does not apply (not a decode step, ...)
        fused = getattr(backend, "rope_decode", None)
        out = None if fused is None else fused(q, k, v, positions, rotary.inv_freq, k_cache, v_cache, meta, self.scale)
        if out is None:
            q = self._rope_write(q, k, v, positions, rotary, k_cache, v_cache, meta)
            return self.attend(q, k_cache, v_cache, meta, backend)
        return apply_linear(self.glue, self.o_proj, out.flatten(-2))

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, backend
    ) -> torch.Tensor:
        """Paged attention of the rotated q [N, Hq, D] under `meta`, through the output projection: [N, H]."""
        out = backend(q, k_cache, v_cache, meta, self.scale)
        return apply_linear(self.glue, self.o_proj, out.flatten(-2))


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        h, i, b = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.glue: Glue = Glue()
        self.fused: FusedLinears | None = None

    def fuse(self) -> bool:
        """Run gate and up as one matmul in inference (see FusedLinears)."""
        self.fused = fuse_linears(self.fused, [self.gate_proj, self.up_proj])
        return self.fused is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(self.glue, self.down_proj, self._activated(x))

    def norm_forward(self, x: torch.Tensor, r: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, self(norm(s))) with s = x + r, the add and the norm reaching the glue together with the fused
        gate/up projection (`Glue.add_norm_linear_swiglu`: one kernel where it fuses them)."""
        fused = self._fused()
        if fused is None:
            s, h = norm.add(x, r)
            return s, self(h)
        s, act = self.glue.add_norm_linear_swiglu(x, r, norm.weight, norm.eps, fused.weight, fused.bias)
        return s, apply_linear(self.glue, self.down_proj, act)

    def _fused(self) -> FusedLinears | None:
        return self.fused if self.fused is not None and self.fused.intact() else None

    def _activated(self, x: torch.Tensor) -> torch.Tensor:
        """swiglu(gate, up) of x, the input of the down projection."""
        fused = self._fused()
        if fused is None:
            return self.glue.swiglu(self.gate_proj(x), self.up_proj(x))
        return self.glue.linear_swiglu(x, fused.weight, fused.bias)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x) for rows [N, H]. In inference, where the down projection is a bias-free nn.Linear
        of the residual's dtype, the add is the matmul's own (C input, accumulated in place: `residual` is
        overwritten and returned), one launch less than the add on its own. An out-of-place addmm would not
        save it: it copies C to its output first."""
        down = self.down_proj
        if (
            torch.is_grad_enabled()
            or type(down) is not nn.Linear
            or down.bias is not None
            or x.dim() != 2
            or residual.dtype != down.weight.dtype
            or not residual.is_contiguous()
        ):
            return residual + self(x)
        return residual.addmm_(self._activated(x).to(down.weight.dtype), down.weight.t())


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, paged=None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if paged is None:
            h = self.self_attn(h, positions, rotary)
        else:
            h = self.self_attn.forward_paged(h, positions, rotary, *paged)
        x, h = self.post_attention_layernorm.add(x, h)
        return x + self.mlp(h)

    def forward_paged(
        self, x: torch.Tensor, pending: torch.Tensor | None, positions: torch.Tensor, rotary: Rotary, paged
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Paged forward that leaves its last residual add to the caller: returns (x, mlp_out) with the
        layer's output x + mlp_out. `pending` is the previous layer's mlp_out, added here together with
        this layer's input norm (one kernel for both), so no residual add runs on its own."""
        at = self.self_attn
        x, q, k, v = at.norm_project(x, pending, self.input_layernorm)
        h = at.write_attend(q, k, v, positions, rotary, *paged)
        return self.mlp.norm_forward(x, h, self.post_attention_layernorm)


def fuse_projections(module: nn.Module) -> int:
    """`Attention.fuse` and `MLP.fuse` on every such submodule of `module`; the number fused."""
    return sum(m.fuse() for m in module.modules() if isinstance(m, (Attention, MLP)))


def set_glue(module: nn.Module, glue: Glue) -> Glue:
    """Give every norm, rotary, attention and MLP under `module` the same glue functions."""
    for m in module.modules():
        if isinstance(m, (RMSNorm, Rotary, MLP, Attention)):
            m.glue = glue
    return glue
