# Over ~300 lines on purpose: one model tree whose parameter names are HF's, with the glue (fused
# projections, compiled inference linears) its two forwards run through; split, the names would be spread out.
"""Our torch implementation of the Llama family (Llama 2/3, Qwen2/2.5, SmolLM2) with grouped-query attention.

Two forwards share the same weights:
- `model(input_ids)`: dense causal forward for the learner, no cache, gradients flow.
- `model.forward_paged(...)`: the engine's prefill / decode / tree-verify over a paged KV cache, attention
  through an `AttentionBackend` (the torch reference or the Triton kernels).
Parameter names follow the HF layout so checkpoints load without renaming.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tlt_rt.models.arch import ArchConfig, rope_inv_freq, rotate_pair
from tlt_rt.models.attention import (
    AttentionBackend,
    AttnMetadata,
    TorchAttention,
    causal_attention,
    with_resolved_slots,
    write_kv,
)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V] (dense) or [N, V] (paged); what `head` returns when one is given
    # the drafter's view of the target: the last decoder layer's output before the final norm, [B, T, H] or
    # [N, H]; with `CausalLM.feature_layers` the outputs of those layers first, concatenated: [..., F]
    hidden: torch.Tensor


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
    """Plain nn.Linear layers of one dtype / device / input size (tensor-parallel shards are left alone)."""
    first = linears[0].weight
    return all(
        type(lin) is nn.Linear
        and lin.weight.dtype == first.dtype
        and lin.weight.device == first.device
        and lin.in_features == linears[0].in_features
        for lin in linears
    )


class Glue:
    """The elementwise pieces between the matmuls and attention. Plain torch by default; on CUDA the engine
    swaps in torch.compile'd versions (`CausalLM.compile_glue`), which fuse each into one kernel and cut the
    launches a decode step makes by more than half."""

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


def _inference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The skinny Triton matmul for few-row inference calls, F.linear when gradients are wanted or the
    shape is outside its domain."""
    if torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    # local: the kernel imports Triton, a GPU-only dependency that the CPU paths must not need
    from tlt_rt.codegen.kernels.skinny_gemm import skinny_linear

    return skinny_linear(x, weight, bias)


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
    """skinny: one-row matmuls of large weights through `codegen.kernels.skinny_gemm` instead of cuBLAS (off
    by default: on an H100 the Qwen2.5-7B-shaped decode step measured the same with it, 5.84 against 5.86 ms
    at batch 1, within run-to-run noise). fused_rope: on CUDA, rotary and the KV-cache write as one Triton
    kernel (`codegen.kernels.rope_cache`)."""

    def __init__(self, skinny: bool = False, fused_rope: bool = True) -> None:
        self.skinny, self.fused_rope = skinny, fused_rope
        if skinny:
            self.linear = _inference_linear
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

    def linear_swiglu(self, x, weight, bias=None):
        if self.skinny and not torch.is_grad_enabled():
            # local: Triton, as in _inference_linear
            from tlt_rt.codegen.kernels.skinny_gemm import skinny_swiglu

            out = skinny_swiglu(x, weight, bias)  # one kernel with the activation as its epilogue, or None
            if out is not None:
                return out
        return super().linear_swiglu(x, weight, bias)

    def rope_write(self, q, k, v, positions, inv_freq, k_cache, v_cache, slots, resolved=False):
        if self.fused_rope and q.is_cuda and resolved:
            # local: Triton, as in _inference_linear
            from tlt_rt.codegen.kernels.rope_cache import rope_write_kv

            return rope_write_kv(q, k, v, positions, inv_freq, k_cache, v_cache, slots)
        return super().rope_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots, resolved)


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

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [..., Hq, D], k and v [..., Hkv, D] before rotary (views of one matmul's output when fused)."""
        shape = x.shape[:-1]
        if self.fused is not None and self.fused.intact():
            q, k, v = self.fused(x, self.glue.linear)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
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
        q, k, v = self._project(x)  # [N, H, D]
        q = self.glue.rope_write(
            q, k, v, positions, rotary.inv_freq, k_cache, v_cache, meta.slot_mapping, meta.slots_resolved
        )
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

    def _activated(self, x: torch.Tensor) -> torch.Tensor:
        """swiglu(gate, up) of x, the input of the down projection."""
        fused = self.fused if self.fused is not None and self.fused.intact() else None
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
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add(x, pending)
        h = self.self_attn.forward_paged(h, positions, rotary, *paged)
        x, h = self.post_attention_layernorm.add(x, h)
        return x, self.mlp(h)


class LlamaBackbone(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


def feature_layer_ids(layers, num_layers: int) -> tuple[int, ...]:
    """`layers` as the sorted tuple `CausalLM.feature_layers` holds: distinct decoder layers below the last of
    `num_layers` (the last one's output is always handed over)."""
    ids = tuple(sorted(int(i) for i in layers or ()))
    last = num_layers - 1
    if any(not 0 <= i < last for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"feature_layers must be distinct layers in [0, {last}), got {list(layers or ())}")
    return ids


class CausalLM(nn.Module):
    """The target model. `hidden` is the last layer's output before the final norm (the drafter's input).

    `feature_layers` (empty by default) names decoder layers (0-based, below the last) whose outputs are
    handed to the drafter too, as EAGLE-3 fuses low, middle and high features: `hidden` is then their
    outputs followed by the last layer's, concatenated, `feature_size` = (len(feature_layers) + 1) x H wide.
    """

    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.arch = arch
        self.model = LlamaBackbone(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(arch)
        self.attn_backend: AttentionBackend = TorchAttention()
        # while training, keep only each layer's input and recompute its insides in the backward
        self.checkpoint_layers = False
        # while training, run each decoder layer through torch.compile (`compiled_layers`)
        self.compile_layers = False
        self.feature_layers: tuple[int, ...] = ()

    @property
    def feature_size(self) -> int:
        """Width of `ModelOutput.hidden`: the hidden size times (1 + len(feature_layers))."""
        return self.arch.hidden_size * (1 + len(self.feature_layers))

    def set_feature_layers(self, layers) -> None:
        """Hand the outputs of these decoder layers (0-based, distinct, below the last) to the drafter too."""
        self.feature_layers = feature_layer_ids(layers, self.arch.num_hidden_layers)

    def compiled_layers(self) -> tuple[nn.Module, ...]:
        """The decoder layers, each through torch.compile with dynamic shapes (built once, kept out of the module
        tree and so out of state_dict). A layer's forward and backward then run as a few generated graphs instead
        of some 70 eager ops and autograd nodes: a learner's update on a GPU is bound by the host's launches and
        autograd work at these sizes (Qwen2.5-1.5B, 8k-token micro-batches: the GPU busy under half the update).
        The layers share their code, so each graph serves every layer; with dynamic shapes a few graphs serve
        every micro-batch shape (a batch of one, a length that is a multiple of 8 and some row-count bands get
        their own; `Learner.warm_up` meets them all at start-up)."""
        compiled = self.__dict__.get("_compiled_layers")
        if compiled is None or len(compiled) != len(self.model.layers):
            raise_recompile_limit(GLUE_RECOMPILE_LIMIT)
            compiled = tuple(torch.compile(layer, dynamic=True) for layer in self.model.layers)
            self.__dict__["_compiled_layers"] = compiled  # not an attribute nn.Module would register
        return compiled

    def _layers(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        taps = []
        grad = self.training and torch.is_grad_enabled()
        layers = self.compiled_layers() if self.compile_layers and grad else self.model.layers
        for i, layer in enumerate(layers):
            if self.checkpoint_layers and grad:
                x = checkpoint(layer, x, positions, self.rotary, use_reentrant=False)
            else:
                x = layer(x, positions, self.rotary)
            if i in self.feature_layers:
                taps.append(x)
        return x, taps

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, head: Callable | None = None
    ) -> ModelOutput:
        """Dense causal forward: input_ids [B, T] -> logits [B, T, V], hidden [B, T, H].

        With `head`, logits are `head(normed_hidden [B, T, H], lm_head.weight [V, H])` instead of the full
        projection: a learner takes the log-probs of its sampled tokens there, a chunk of rows at a time
        (train/rl/logprobs.py). Inside forward, so a sharded (FSDP) head is whole while it is read."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        x, taps = self._layers(self.model.embed_tokens(input_ids), positions)
        hidden = torch.cat([*taps, x], -1) if taps else x
        if head is not None:
            return ModelOutput(logits=head(self.model.norm(x), self.lm_head.weight), hidden=hidden)
        return ModelOutput(logits=self.lm_head(self.model.norm(x)), hidden=hidden)

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
        meta = with_resolved_slots(meta, cache.num_blocks * cache.block_size)
        x, pending, taps = self.model.embed_tokens(input_ids), None, []
        for i, layer in enumerate(self.model.layers):
            x, pending = layer.forward_paged(
                x, pending, positions, self.rotary, (cache.k[i], cache.v[i], meta, self.attn_backend)
            )
            if i in self.feature_layers:  # the layer's output; its last residual add is left to the next layer
                taps.append(x + pending)
        x = x + pending
        rows = x if logits_indices is None else x[logits_indices]
        norm = self.model.norm
        hidden = torch.cat([*taps, x], -1) if taps else x
        return ModelOutput(logits=apply_linear(norm.glue, self.lm_head, norm(rows)), hidden=hidden)

    def fuse_projections(self) -> int:
        """Fuse q/k/v and gate/up of every layer into single matmuls for inference; returns how many
        groups were fused. Call it after the model has its final device and dtype."""
        return fuse_projections(self)

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


def fuse_projections(module: nn.Module) -> int:
    """`Attention.fuse` and `MLP.fuse` on every such submodule of `module`; the number fused."""
    return sum(m.fuse() for m in module.modules() if isinstance(m, (Attention, MLP)))


def set_glue(module: nn.Module, glue: Glue) -> Glue:
    """Give every norm, rotary, attention and MLP under `module` the same glue functions."""
    for m in module.modules():
        if isinstance(m, (RMSNorm, Rotary, MLP, Attention)):
            m.glue = glue
    return glue
