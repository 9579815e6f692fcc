"""The drafter's eager catch-up over packed rows: K/V for every row, the layer's outputs for each sequence's last.

A plain stretch leaves every running sequence's drafter cache rows behind; before the next speculative step the
engine runs the drafter over them (rollout/step/drafting.py, `DrafterRunner.catch_up`). Only each sequence's
final row feeds the draft (its logits and hidden); the others need their K/V alone, which depend on the layer's
input only, the drafter having one decoder layer. So every row goes through the fused input (token embedding and
feature), the input norm and the K/V projection with rotary, and only the last rows through attention (each
attending to its whole sequence, as a decode step does), the MLP and the head. At batch 128 after 80 plain steps
that is ~10,000 rows, of which 128 need the whole layer.
"""

from __future__ import annotations

import torch

from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.llama import KVCache, ModelOutput


def catch_up_rows(
    drafter,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    cache: KVCache,
    meta: AttnMetadata,
    last: torch.Tensor,
) -> ModelOutput:
    """What `drafter.forward_paged(..., logits_indices=last, full_vocab=False)` gives at the `last` rows of the
    packed prefill `meta` (each sequence's final row), and the same K/V for every row: input_ids / positions [N],
    hidden [N, H] features, last [B]. Returns logits [B, Vd] over the draft vocabulary and hidden [B, H]."""
    meta.validate(input_ids.shape[0])
    x = drafter._fuse(input_ids, hidden)
    layer = drafter.layer
    attn = layer.self_attn
    q = attn.project_write(layer.input_layernorm(x), positions, drafter._rotary(x.device), cache.k[0], cache.v[0],
                           meta)  # fmt: skip
    b = last.shape[0]
    ends = AttnMetadata("decode", torch.arange(b + 1, dtype=torch.int32, device=x.device), meta.seq_lens,
                        meta.block_tables, meta.slot_mapping[last], 1)  # fmt: skip
    backend = drafter.attn_backend
    eager = getattr(backend, "eager", None)  # a Triton backend's fixed variant for eager calls (see its `eager`)
    h = attn.attend(q[last], cache.k[0], cache.v[0], ends, backend if eager is None else eager())
    x, h = layer.post_attention_layernorm.add(x[last], h)
    x = layer.mlp.forward_add(h, x)
    return ModelOutput(logits=drafter.logits(x), hidden=x)
