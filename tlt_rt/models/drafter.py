"""The one-layer EAGLE-style drafter, laid out as serving engines load an EAGLE(-2) draft model.

    feature f_t    = target.norm(h_t)                       # the target's final-norm output (EAGLE's "feature")
    z_t            = fc(concat(embed(x_{t+1}), f_t))         # Linear 2H -> H, with bias
    f'_{t+1}       = DecoderLayer(z_t)                      # one target-architecture layer, no input layernorm
    logits_{t+1}   = lm_head(f'_{t+1})                      # predicts x_{t+2}

This is SGLang's `LlamaForCausalLMEagle` / `Qwen2ForCausalLMEagle` (and vLLM's EAGLE-1 model): the target
hands over its hidden state AFTER the final norm, the draft layer skips its input layernorm, and the draft
output goes straight into the LM head with no norm. The drafter's own output is fed back as the next
feature when it drafts several steps. Our target's `ModelOutput.hidden` is taken BEFORE the final norm, so
target rows go through `Drafter.features(hidden)` first (one RMSNorm with the target's weights).

Embedding, final norm and LM head are the target's own modules, shared by reference: they are not
registered as submodules (not in `state_dict()` / `parameters()`) and their weights are used detached, so
drafter training never writes gradients into the policy.

Reduced draft vocabulary (off by default): `set_draft_vocab(d2t)` keeps only the target ids `d2t` [Vd]
(typically the most frequent tokens of the training data, see `draft_vocab_from_counts`). The LM head is
then a sliced copy of those rows of the target's head (the only non-shared case; call `refresh_head()`
after the policy's weights change), dense `forward` returns logits over the Vd draft ids, and
`forward_paged` scatters them back to the target vocabulary (-inf elsewhere) so the engine keeps target
ids. `forward_paged(..., full_vocab=False)` returns the draft-vocab logits as they are, so a caller can take
its top-k over the small head and map the chosen ids with `to_target_ids` (`d2t[i]`): the same ids and
scores as a top-k over the scattered logits, without the [N, V] scatter. `d2t` holds absolute target ids,
as SGLang's `--speculative-token-map` file does (EAGLE-3's `d2t` holds offsets instead). `load_state_dict`
adopts the `d2t` of the state it loads (another size, or none), so copying a trainer's weights into a
serving drafter also carries a rebuilt vocabulary across.

Fused features (EAGLE-3's low, middle and high layers; off by default): `Drafter(..., feature_layers=(i, j))`
reads the outputs of target layers i and j beside the last one (`CausalLM.set_feature_layers`, which the
engine sets from the drafter): the target's `hidden` is then [..., (k+1) H], and `features` maps it to the
drafter's H-wide input through `fuse`, a Linear (k+1) H -> H over the low layers' RMS-normalised outputs and
the final-norm feature. `fuse` starts as the identity on that last part, so a fresh fused drafter begins
where the one-layer drafter does; `target_features` is always the final-norm feature of the last layer (the
target's own logits, the regression target). The drafter's own outputs are fed back H wide, as before.
Serving engines' EAGLE loaders do not know `fuse`: a fused drafter serves in tlt_rt.

Training runs through packed attention (packed_attention.py) and the training-time test of EAGLE-3 / HASS
(`forward_unrolled`, drafter_unrolled.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.attention import AttentionBackend, AttnMetadata, TorchAttention
from tlt_rt.models.drafter_unrolled import BAND_BLOCK, forward_unrolled
from tlt_rt.models.glue import apply_linear
from tlt_rt.models.layers import DecoderLayer, Rotary
from tlt_rt.models.llama import CausalLM, KVCache, ModelOutput, feature_layer_ids
from tlt_rt.models.packed_attention import PackedAttn, packed_causal_attention, xformers_works

__all__ = ["Drafter", "PackedAttn", "draft_vocab_from_counts", "packed_causal_attention", "xformers_works"]


def draft_vocab_from_counts(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target ids (ties to the smaller id) from per-id counts [V] -> [size] int64."""
    if not 0 < size <= counts.numel():
        raise ValueError(f"draft_vocab_size must be in [1, {counts.numel()}], got {size}")
    order = torch.sort(counts.cpu(), descending=True, stable=True).indices
    return order[:size].to(torch.int64)


class Drafter(nn.Module):
    """One-layer EAGLE-2-layout draft model sharing embedding, final norm and LM head with `target`.

    `arch` describes the draft layer (usually `target.arch`); its hidden size must equal the target's.
    """

    def __init__(
        self,
        arch: ArchConfig,
        target: CausalLM,
        draft_vocab: torch.Tensor | None = None,
        fc_bias: bool = True,
        feature_layers=(),
    ):
        super().__init__()
        if arch.hidden_size != target.arch.hidden_size:
            raise ValueError(f"drafter hidden_size {arch.hidden_size} != target hidden_size {target.arch.hidden_size}")
        self.arch = arch
        h = arch.hidden_size
        self.feature_layers = feature_layer_ids(feature_layers, target.arch.num_hidden_layers)
        # EAGLE-3's fusion of several target layers into the drafter's input (None: the final-norm feature alone)
        self.fuse = nn.Linear(self.feature_size, h, bias=False) if self.feature_layers else None
        # SGLang's EAGLE models register fc.bias, vLLM's EagleLlamaForCausalLM does not (fc_bias=False serves there)
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(arch)])
        # EAGLE checkpoints and serving engines drop layer 0's input layernorm: fc's output enters attention as is
        self.layers[0].input_layernorm = nn.Identity()
        self.attn_backend: AttentionBackend = TorchAttention()
        self.packed_attn: PackedAttn = "auto"
        self.register_buffer("d2t", None)
        self.register_buffer("draft_head", None, persistent=False)
        # bumped whenever d2t or the reduced head become other tensors (not on an in-place copy): a captured step
        # reads the ones it was captured with, so an engine recaptures its speculative steps when this moves
        self.head_version = 0
        self._init_weights()
        if self.fuse is not None:  # the identity on the final-norm feature: a fresh fused drafter is today's
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -h:].copy_(torch.eye(h))
        self.bind(target)
        if draft_vocab is not None:
            self.set_draft_vocab(draft_vocab)

    @property
    def feature_size(self) -> int:
        """Width of the target hidden this drafter reads: H times (1 + len(feature_layers))."""
        return self.arch.hidden_size * (1 + len(self.feature_layers))

    def _init_weights(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    # -- the target's shared modules (plain attributes: never registered, never trained here) --
    def bind(self, target: CausalLM) -> Drafter:
        """Share `target`'s embedding, final norm and LM head (by reference); re-slices a reduced head."""
        if target.arch.hidden_size != self.arch.hidden_size:
            raise ValueError(f"target hidden_size {target.arch.hidden_size} != drafter {self.arch.hidden_size}")
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_rotaries", {})
        if self.d2t is not None:
            self.refresh_head()
        return self

    @property
    def target(self) -> CausalLM:
        return self._target

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target.model.embed_tokens

    @property
    def norm(self) -> nn.Module:
        return self._target.model.norm

    @property
    def lm_head(self) -> nn.Linear:
        return self._target.lm_head

    @property
    def layer(self) -> DecoderLayer:
        return self.layers[0]

    @property
    def draft_vocab_size(self) -> int:
        return self.arch.vocab_size if self.d2t is None else self.d2t.numel()

    def _rotary(self, device: torch.device) -> Rotary:
        # kept out of the module tree so that `.to(bfloat16)` never rounds the inverse frequencies
        if device not in self._rotaries:
            self._rotaries[device] = Rotary(self.arch).to(device)
        return self._rotaries[device]

    # -- reduced draft vocabulary --
    def set_draft_vocab(self, d2t: torch.Tensor | None) -> None:
        """Restrict drafting to target ids `d2t` [Vd] (None: the full vocabulary). A vocabulary of the size
        already set is copied into the existing tensors, so CUDA graphs that read them stay valid."""
        if d2t is None:
            if self.d2t is not None or self.draft_head is not None:
                self.head_version += 1
            self.d2t, self.draft_head = None, None
            return
        d2t = torch.as_tensor(d2t, dtype=torch.int64).flatten()
        v = self._target.arch.vocab_size
        if d2t.numel() == 0 or d2t.min() < 0 or d2t.max() >= v or d2t.unique().numel() != d2t.numel():
            raise ValueError(f"d2t must hold distinct target ids in [0, {v}), got {d2t.numel()} ids")
        if self.d2t is not None and self.d2t.shape == d2t.shape:
            self.d2t.copy_(d2t)
        else:
            self.d2t = d2t.to(self.fc.weight.device, copy=True)  # never aliases the caller's tensor
            self.head_version += 1
        self.refresh_head()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # the draft vocabulary is part of the state: adopt the loaded one (any size) before the copy
        d2t = state_dict.get(prefix + "d2t")
        if d2t is None and self.d2t is not None:
            self.set_draft_vocab(None)
        elif d2t is not None and (self.d2t is None or not torch.equal(d2t.cpu(), self.d2t.cpu())):
            self.set_draft_vocab(d2t)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids (e.g. a top-k over `forward_paged(..., full_vocab=False)` logits) -> target ids."""
        return draft_ids if self.d2t is None else self.d2t.to(draft_ids.device)[draft_ids]

    def t2d(self) -> torch.Tensor:
        """[V] int64: the draft id of each target id, -1 outside the draft vocabulary (identity when full)."""
        v = self._target.arch.vocab_size
        dev = self.fc.weight.device
        if self.d2t is None:
            return torch.arange(v, device=dev)
        out = torch.full((v,), -1, dtype=torch.int64, device=dev)
        return out.index_copy_(0, self.d2t.to(dev), torch.arange(self.d2t.numel(), device=dev))

    @torch.no_grad()
    def refresh_head(self) -> None:
        """Re-slice the reduced LM head from the target's current weights (after a policy update)."""
        w = self.lm_head.weight
        rows = w.detach()[self.d2t.to(w.device)]
        h = self.draft_head
        if h is not None and h.shape == rows.shape and h.dtype == rows.dtype and h.device == rows.device:
            h.copy_(rows)  # in place: a captured graph keeps reading the right rows
        else:
            self.draft_head = rows.clone()
            self.head_version += 1

    # -- the maths --
    def target_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Target hidden [..., F] (before the final norm; F = feature_size) -> the final norm's output of its
        last layer [..., H]: what the target's LM head reads."""
        n = self.norm
        x = target_hidden[..., -self.arch.hidden_size :].float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + n.eps)
        return n.weight.detach() * x.to(target_hidden.dtype)

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Target hidden before the final norm [..., F] -> the drafter's input feature [..., H]: the final
        norm's output, or with `feature_layers` `fuse` over every layer's part (module docstring)."""
        last = self.target_features(target_hidden)
        if self.fuse is None:
            return last
        h, k = self.arch.hidden_size, len(self.feature_layers)
        low = target_hidden[..., :-h].float().unflatten(-1, (k, h))
        low = low * torch.rsqrt(low.pow(2).mean(-1, keepdim=True) + self.norm.eps)  # each layer's part, unscaled
        x = torch.cat([low.flatten(-2).to(last.dtype), last], -1)
        return apply_linear(self.layer.mlp.glue, self.fuse, x.to(self.fuse.weight.dtype))

    def head_weight(self) -> torch.Tensor:
        """[Vd, H] the LM head rows the drafter scores (the target's own weight when the vocab is full)."""
        return self.lm_head.weight.detach() if self.draft_head is None else self.draft_head

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Feature [..., H] -> logits over the draft vocabulary [..., Vd]."""
        w = self.head_weight()
        return self.layer.mlp.glue.linear(feature.to(w.dtype), w)

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V], -inf outside the draft vocabulary."""
        if self.d2t is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self._target.arch.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.d2t.to(logits.device), logits)

    def _fuse(self, input_ids: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        glue = self.layer.mlp.glue
        x = glue.embed_cat(self.embed_tokens.weight.detach(), input_ids, feature.to(self.fc.weight.dtype))
        return apply_linear(glue, self.fc, x)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Dense forward for training: row t pairs token x_{t+1} with feature f_t and predicts f_{t+1}.

        input_ids [B, T], hidden [B, T, H] features (`features(target_hidden)` or fed-back drafter output),
        positions [B, T] (default 0..T-1), segment_ids [B, T] for packed rows (None: one sequence per row,
        causal). Returns hidden [B, T, H] (predicted next features) and logits [B, T, Vd].
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        x = self._fuse(input_ids, hidden)
        rotary = self._rotary(x.device)
        layer = self.layer
        if segment_ids is None:
            x = layer(x, positions, rotary)
        else:
            attn = layer.self_attn
            q, k, v = attn._qkv(x, positions, rotary)  # [B, T, H, D]; the input layernorm is the identity
            out = packed_causal_attention(q, k, v, attn.scale, segment_ids, self.packed_attn)
            x = x + attn.o_proj(out.flatten(-2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return ModelOutput(logits=self.logits(x), hidden=x)

    def forward_paged(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttnMetadata,
        logits_indices: torch.Tensor | None = None,
        full_vocab: bool = True,
    ) -> ModelOutput:
        """Engine forward over packed rows, as `CausalLM.forward_paged`: input_ids/positions [N], hidden [N, H].

        Returns logits [M, V] over the TARGET vocabulary (rows `logits_indices`, default all), or with
        `full_vocab=False` [M, Vd] over the draft vocabulary (map ids with `to_target_ids`), and hidden
        [N, H]. K/V go to the drafter's one-layer `cache` at meta.slot_mapping (the target's block tables).
        """
        meta.validate(input_ids.shape[0])
        x = self._fuse(input_ids, hidden)
        layer = self.layer  # its forward, with the last residual add inside the down projection's matmul
        h = layer.self_attn.forward_paged(layer.input_layernorm(x), positions, self._rotary(x.device), cache.k[0],
                                          cache.v[0], meta, self.attn_backend)  # fmt: skip
        x, h = layer.post_attention_layernorm.add(x, h)
        x = layer.mlp.forward_add(h, x)
        rows = x if logits_indices is None else x[logits_indices]
        logits = self.logits(rows)
        return ModelOutput(logits=self.to_target_vocab(logits) if full_vocab else logits, hidden=x)

    def forward_unrolled(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        segment_ids: torch.Tensor,
        steps: int,
        block: int = BAND_BLOCK,
    ) -> list[tuple[ModelOutput, torch.Tensor]]:
        """Training-time test: `steps` dense passes, pass k being every row's depth-(k+1) draft; per pass
        (output, valid [B, T]). See `drafter_unrolled.forward_unrolled` (`block`: its attention's bands)."""
        return forward_unrolled(self, input_ids, hidden, positions, segment_ids, steps, block)

    def make_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None, device=None) -> KVCache:
        p = self.fc.weight
        a = self.arch
        return KVCache(
            1, num_blocks, block_size, a.num_key_value_heads, a.head_dim, dtype or p.dtype, device or p.device
        )
