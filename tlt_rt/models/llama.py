"""Our torch implementation of the Llama family (Llama 2/3, Qwen2/2.5, SmolLM2) with grouped-query attention.

Two forwards share the same weights:
- `model(input_ids)`: dense causal forward for the learner, no cache, gradients flow.
- `model.forward_paged(...)`: the engine's prefill / decode / tree-verify over a paged KV cache, attention
  through an `AttentionBackend` (the torch reference or the Triton kernels).
Parameter names follow the HF layout so checkpoints load without renaming. The decoder layer and its parts
live in layers.py, the glue they run through (norms, rotary, activation, fused projections) in glue.py; their
names are importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.attention import AttentionBackend, AttnMetadata, TorchAttention, with_resolved_slots
from tlt_rt.models.glue import (
    GLUE_RECOMPILE_LIMIT,
    CompiledGlue,
    FusedLinears,
    Glue,
    add_rms_norm,
    apply_linear,
    embed_cat,
    fuse_linears,
    raise_recompile_limit,
    rms_norm,
    swiglu,
)
from tlt_rt.models.layers import MLP, Attention, DecoderLayer, RMSNorm, Rotary, fuse_projections, set_glue

__all__ = [
    "GLUE_RECOMPILE_LIMIT",
    "MLP",
    "Attention",
    "CausalLM",
    "CompiledGlue",
    "DecoderLayer",
    "FusedLinears",
    "Glue",
    "KVCache",
    "LlamaBackbone",
    "ModelOutput",
    "RMSNorm",
    "Rotary",
    "add_rms_norm",
    "apply_linear",
    "embed_cat",
    "feature_layer_ids",
    "fuse_linears",
    "fuse_projections",
    "raise_recompile_limit",
    "rms_norm",
    "set_glue",
    "swiglu",
]


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

    @property
    def trash_slot(self) -> int:
        """The last slot of the cache, where padding rows write (`attention.resolve_slots` sends -1 there)."""
        return self.num_blocks * self.block_size - 1

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


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
        """Route norms, rotary and the MLP activation through `glue` (default: torch.compile'd versions; the
        engine's, with device kernels, come from `tlt_rt.codegen.model_kernels.engine_glue`)."""
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
