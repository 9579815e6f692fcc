"""How one engine step runs on the device: batch layout, attention metadata, forwards and sampling.

The scheduler (engine.py) decides what runs; this module turns its choice into tensors. Sampling uses the
same filtered distribution and inverse-CDF rule as tree acceptance (`codegen/kernels/accept.py`), with
uniforms from each sequence's own counter-based stream, so plain and speculative steps draw identically
distributed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_rt.codegen.kernels.sampling import filtered_probs
from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.llama import CausalLM, KVCache
from tlt_rt.rollout.params import SamplingParams
from tlt_rt.rollout.rng import counter_uniforms


@dataclass
class Layout:
    """Host-side description of a packed batch: per sequence its block table, q range and cache length."""

    tables: list[list[int]]
    q_lens: list[int]
    seq_lens: list[int]
    positions: list[list[int]]  # rotary position of each new token
    cache_pos: list[list[int]]  # cache position of each new token (-1: do not write)


def build_meta(layout: Layout, mode: str, block_size: int, device, tree_mask: torch.Tensor | None = None):
    """AttnMetadata and flat positions for a layout (one host->device copy per tensor)."""
    width = max(1, max(len(t) for t in layout.tables))
    tables = torch.zeros(len(layout.tables), width, dtype=torch.int32)
    for i, t in enumerate(layout.tables):
        tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    cu = torch.zeros(len(layout.q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(layout.q_lens).cumsum(0)
    slots = []
    for t, cps in zip(layout.tables, layout.cache_pos, strict=True):
        slots += [t[p // block_size] * block_size + p % block_size if p >= 0 else -1 for p in cps]
    positions = torch.tensor([p for ps in layout.positions for p in ps], dtype=torch.long)
    meta = AttnMetadata(
        mode=mode,
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(layout.seq_lens, dtype=torch.int32).to(device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
        max_q_len=max(layout.q_lens),
        tree_mask=tree_mask,
    )
    return meta, positions.to(device)


class Sampler:
    """Draws one token per row from the target's filtered distribution, or the argmax when greedy."""

    def __init__(self, params: SamplingParams, device):
        self.params = params
        self.device = device

    def row_params(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.params
        return (
            torch.full((b,), float(p.temperature), device=self.device),
            torch.full((b,), int(p.top_k), dtype=torch.int32, device=self.device),
            torch.full((b,), float(p.top_p), device=self.device),
        )

    def log_dist(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] log of the filtered distribution (log_softmax of raw logits when greedy)."""
        if self.params.greedy or not self.params.filtering:
            scale = 1.0 if self.params.greedy else 1.0 / self.params.temperature
            return torch.log_softmax(logits.float() * scale, dim=-1)
        t, k, p = self.row_params(logits.shape[0])
        return filtered_probs(logits[:, None], t, k, p)[:, 0].log()

    def sample(self, logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor):
        """logits [B, V] -> (tokens [B], logprobs [B]). Inverse CDF over token ids with one uniform."""
        logp = self.log_dist(logits)
        if self.params.greedy:
            tok = logits.argmax(-1)
        else:
            probs = logp.exp()
            cdf = probs.cumsum(-1)
            u = counter_uniforms(seeds, counters, 2)[:, 1:2] * cdf[:, -1:]
            tok = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(logits.shape[-1] - 1)
            # a boundary landing on a zero-probability token moves to the previous kept one
            tok = torch.where(probs.gather(1, tok[:, None]).squeeze(1) > 0, tok, logp.argmax(-1))
        return tok, logp.gather(1, tok[:, None]).squeeze(1)


class TargetRunner:
    """Owns the target model, its paged cache and the forwards the engine needs."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int):
        self.model = model
        self.device = model.lm_head.weight.device
        self.block_size = block_size
        self.cache: KVCache = model.make_cache(num_blocks + 1, block_size)  # + the trash block

    @torch.no_grad()
    def forward(self, tokens: list[int], layout: Layout, mode: str, logits_rows=None, tree_mask=None):
        meta, positions = build_meta(layout, mode, self.block_size, self.device, tree_mask)
        ids = torch.tensor(tokens, dtype=torch.long).to(self.device)
        rows = None if logits_rows is None else torch.tensor(logits_rows, dtype=torch.long).to(self.device)
        return self.model.forward_paged(ids, positions, self.cache, meta, logits_indices=rows)

    def copy_blocks(self, copies: list[tuple[int, int]], caches: list[KVCache]) -> None:
        """Apply copy-on-fork block copies to every cache that shares the block tables."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for c in caches:
            c.k[:, dst] = c.k[:, src]
            c.v[:, dst] = c.v[:, src]
