"""A small reference generator over the paged forward: greedy or sampled, one batch, no speculation.

The engine (tlt_rt.rollout) is the real generator; this one is short enough to be obviously right, so it
serves as the oracle in tests and for quick looks at a model.
"""

from __future__ import annotations

import torch

from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.llama import CausalLM


@torch.no_grad()
def generate_simple(
    model: CausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: tuple[int, ...] | None = None,
    temperature: float = 0.0,
    block_size: int = 16,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Generate continuations of `prompts`; each stops at an EOS id (kept) or after max_new_tokens."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = set(model.arch.eos_token_ids if eos_ids is None else eos_ids)
    dev = model.lm_head.weight.device
    b = len(prompts)
    max_len = max(len(p) for p in prompts) + max_new_tokens
    per_seq = -(-max_len // block_size)
    cache = model.make_cache(b * per_seq, block_size)
    tables = torch.arange(b * per_seq, device=dev, dtype=torch.int32).view(b, per_seq)

    def slots(seq: int, pos: torch.Tensor) -> torch.Tensor:
        return tables[seq, pos // block_size].long() * block_size + pos % block_size

    lens = [len(p) for p in prompts]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    pos = [torch.arange(n, device=dev) for n in lens]
    meta = AttnMetadata(
        "prefill",
        cu,
        torch.tensor(lens, dtype=torch.int32, device=dev),
        tables,
        torch.cat([slots(i, p) for i, p in enumerate(pos)]),
        max(lens),
    )
    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    last = (cu[1:] - 1).long()
    logits = model.forward_paged(ids, torch.cat(pos), cache, meta, logits_indices=last).logits
    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    for _ in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=generator).flatten()
        else:
            nxt = logits.argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = t in eos or len(out[i]) >= max_new_tokens
        if all(done):
            break
        cur = torch.tensor([lens[i] + len(out[i]) - 1 for i in range(b)], device=dev)
        meta = AttnMetadata(
            "decode",
            torch.arange(b + 1, dtype=torch.int32, device=dev),
            (cur + 1).int(),
            tables,
            torch.stack([slots(i, cur[i]) for i in range(b)]),
            1,
        )
        logits = model.forward_paged(nxt, cur, cache, meta).logits
    return out
