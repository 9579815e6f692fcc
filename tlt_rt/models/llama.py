"""Our torch implementation of the Llama family (Llama 2/3, Qwen2/2.5, SmolLM2) with grouped-query attention.

Two forwards share the same weights:
- `model(input_ids)`: dense causal forward for the learner, no cache, gradients flow.
- `model.forward_paged(...)`: the engine's prefill / decode / tree-verify over a paged KV cache, attention
  through an `AttentionBackend` (the torch reference or the Triton kernels).
Parameter names follow the HF layout so checkpoints load without renaming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tlt_rt.models.arch import ArchConfig, rope_inv_freq
from tlt_rt.models.attention import AttentionBackend, AttnMetadata, TorchAttention, causal_attention, write_kv


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V] (dense) or [N, V] (paged)
    hidden: torch.Tensor  # last decoder layer output before the final norm, [B, T, H] or [N, H]


class KVCache:
    """Paged K/V storage for every layer: k[l], v[l] are [num_blocks, block_size, n_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # one allocation per K and V so that commit kernels can address all layers at once
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_pair(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k [..., T, H, D] at positions [..., T]; rotate-half convention (HF layout)."""
    freqs = positions.unsqueeze(-1).float() * inv_freq  # [..., T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)  # [..., T, 1, D]
    cos, sin = emb.cos(), emb.sin()

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

    return rot(q), rot(k)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class Glue:
    """The elementwise pieces between the matmuls and attention. Plain torch by default; on CUDA the engine
    swaps in torch.compile'd versions (`CausalLM.compile_glue`), which fuse each into one kernel and cut the
    launches a decode step makes by more than half."""

    rms_norm = staticmethod(rms_norm)
    rotate_pair = staticmethod(rotate_pair)
    swiglu = staticmethod(swiglu)


class CompiledGlue(Glue):
    def __init__(self) -> None:
        opts = {"dynamic": True, "fullgraph": True}
        self.rms_norm = torch.compile(rms_norm, **opts)
        self.rotate_pair = torch.compile(rotate_pair, **opts)
        self.swiglu = torch.compile(swiglu, **opts)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.glue: Glue = Glue()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.glue.rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        self.glue: Glue = Glue()

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

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary):
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*shape, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(*shape, self.n_kv, self.head_dim)
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
        q, k, v = self._qkv(x, positions, rotary)  # [N, H, D]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.flatten(-2))


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        h, i, b = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.glue: Glue = Glue()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glue.swiglu(self.gate_proj(x), self.up_proj(x)))


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
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class CausalLM(nn.Module):
    """The target model. `hidden` is the last layer's output before the final norm (the drafter's input)."""

    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.arch = arch
        self.model = LlamaBackbone(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(arch)
        self.attn_backend: AttentionBackend = TorchAttention()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> ModelOutput:
        """Dense causal forward: input_ids [B, T] -> logits [B, T, V], hidden [B, T, H]."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rotary)
        return ModelOutput(logits=self.lm_head(self.model.norm(x)), hidden=x)

    def forward_paged(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttnMetadata,
        logits_indices: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Engine forward over packed tokens: input_ids/positions [N] -> logits [M, V], hidden [N, H].

        `logits_indices` [M] picks the rows that need logits (the last token of each prefill chunk, say);
        None computes them for every row. K/V of the new tokens are written to `cache` at meta.slot_mapping.
        """
        meta.validate(input_ids.shape[0])
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, self.rotary, (cache.k[i], cache.v[i], meta, self.attn_backend))
        rows = x if logits_indices is None else x[logits_indices]
        return ModelOutput(logits=self.lm_head(self.model.norm(rows)), hidden=x)

    def compile_glue(self, glue: Glue | None = None) -> Glue:
        """Route norms, rotary and the MLP activation through `glue` (default: torch.compile'd versions)."""
        if glue is None and isinstance(self.model.norm.glue, CompiledGlue):
            return self.model.norm.glue  # compiled once per model
        return set_glue(self, glue or CompiledGlue())

    def make_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None, device=None) -> KVCache:
        p = self.lm_head.weight
        a = self.arch
        return KVCache(
            a.num_hidden_layers,
            num_blocks,
            block_size,
            a.num_key_value_heads,
            a.head_dim,
            dtype or p.dtype,
            device or p.device,
        )


def set_glue(module: nn.Module, glue: Glue) -> Glue:
    """Give every norm, rotary and MLP under `module` the same glue functions."""
    for m in module.modules():
        if isinstance(m, (RMSNorm, Rotary, MLP)):
            m.glue = glue
    return glue
