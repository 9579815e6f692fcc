"""How one engine step runs on the device: batch layout, attention metadata, forwards and sampling.

The scheduler (engine.py) decides what runs; this module turns its choice into tensors. Sampling uses the
same filtered distribution and inverse-CDF rule as tree acceptance (`codegen/kernels/accept.py`), with
uniforms from each sequence's own counter-based stream, so plain and speculative steps draw identically
distributed tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tlt_rt.codegen.kernels.sampling import filtered_probs
from tlt_rt.ir.strategy import bucket_for
from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.llama import CausalLM, KVCache, ModelOutput
from tlt_rt.rollout.params import SamplingParams
from tlt_rt.rollout.rng import host_uniforms


@dataclass
class Layout:
    """Host-side description of a packed batch: per sequence its block table, q range and cache length."""

    tables: list[list[int]]
    q_lens: list[int]
    seq_lens: list[int]
    positions: list[list[int]]  # rotary position of each new token
    cache_pos: list[list[int]]  # cache position of each new token (-1: do not write)


def table_tensor(tables: list[list[int]], device) -> torch.Tensor:
    """[B, max blocks] int32 block tables, padded with block 0 (attention masks padded positions out)."""
    width = max(1, max(len(t) for t in tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).to(device)


def build_meta(layout: Layout, mode: str, block_size: int, device, tree_mask: torch.Tensor | None = None):
    """AttnMetadata and flat positions for a layout (one host->device copy per tensor)."""
    cu_host = [0, *itertools.accumulate(layout.q_lens)]
    cu = torch.tensor(cu_host, dtype=torch.int32)
    slots = []
    for t, cps in zip(layout.tables, layout.cache_pos, strict=True):
        slots += [t[p // block_size] * block_size + p % block_size if p >= 0 else -1 for p in cps]
    positions = torch.tensor([p for ps in layout.positions for p in ps], dtype=torch.long)
    meta = AttnMetadata(
        mode=mode,
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(layout.seq_lens, dtype=torch.int32).to(device),
        block_tables=table_tensor(layout.tables, device),
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
        max_q_len=max(layout.q_lens),
        tree_mask=tree_mask,
        host=(cu_host, list(layout.seq_lens)),
    )
    return meta, positions.to(device)


def tree_meta(
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    tree_mask: torch.Tensor,
    block_size: int,
    write: torch.Tensor | None = None,
) -> AttnMetadata:
    """Verify-mode metadata built on the device: every sequence's q_len new tokens sit at the last q_len of
    its seq_lens cache positions. tables [B, W] int32, seq_lens [B]; no host round trip.

    A token at a negative cache position (seq_lens < q_len), or where `write` [B, q_len] bool is False,
    writes its K/V to the trash slot."""
    b, dev = tables.shape[0], tables.device
    pos = seq_lens.long()[:, None] - q_len + torch.arange(q_len, device=dev)  # [B, q_len]
    slots = tables.long().gather(1, pos.clamp(min=0) // block_size) * block_size + pos % block_size
    keep = pos >= 0 if write is None else (pos >= 0) & write
    slots = torch.where(keep, slots, -1)
    cu = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32, device=dev)
    return AttnMetadata("verify", cu, seq_lens.int(), tables, slots.flatten(), q_len, tree_mask)


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

    def sample(self, logits: torch.Tensor, seeds: list[int], counters: list[int]):
        """logits [B, V] -> (tokens [B], logprobs [B]). Inverse CDF over token ids with one uniform, drawn
        from each sequence's (seed, counter) stream on the host."""
        logp = self.log_dist(logits)
        if self.params.greedy:
            tok = logits.argmax(-1)
        else:
            probs = logp.exp()
            cdf = probs.cumsum(-1)
            u = torch.from_numpy(host_uniforms(seeds, counters, 2)[:, 1:2]).to(cdf.device) * cdf[:, -1:]
            tok = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(logits.shape[-1] - 1)
            # a boundary landing on a zero-probability token moves to the previous kept one
            tok = torch.where(probs.gather(1, tok[:, None]).squeeze(1) > 0, tok, logp.argmax(-1))
        return tok, logp.gather(1, tok[:, None]).squeeze(1)


class PagedForward:
    """A paged forward that replays a captured CUDA graph for decode/verify shapes and runs eagerly otherwise.

    fn(ids, positions, cache, meta, logits_rows) -> ModelOutput. Graphs are captured lazily on first use of a
    shape (or all at once through `Engine.capture`) into its `GraphPool`, which the engine shares with the
    draft-step graphs.
    """

    def __init__(self, fn, cache: KVCache, device, buckets: list[int] | None, max_blocks: int):
        self.fn = fn
        self.cache = cache
        self.buckets = buckets or []
        self.width = max_blocks
        self.pool = None
        if self.buckets and torch.device(device).type == "cuda":
            from tlt_rt.codegen.graphs import GraphPool, PagedProgram

            program = PagedProgram(lambda i, p, c, m: fn(i, p, c, m, None), cache, max_blocks, torch.device(device))
            self.pool = GraphPool(torch.device(device))
            self.pool.register(("decode", "verify"), program)

    def key(self, meta: AttnMetadata):
        b = meta.num_seqs
        if self.pool is None or meta.mode == "prefill" or b > self.buckets[-1]:
            return None
        if meta.block_tables.shape[1] > self.width:
            return None
        return (meta.mode, bucket_for(b, self.buckets), meta.max_q_len, meta.window)

    def __call__(self, ids, positions, meta: AttnMetadata, logits_rows=None) -> ModelOutput:
        key = None if logits_rows is not None else self.key(meta)
        if key is None:
            return self.fn(ids, positions, self.cache, meta, logits_rows)
        if not self.pool.has(key):
            self.pool.capture([key])
        logits, hidden = self.pool.replay(key, ids, positions, meta)
        return ModelOutput(logits, hidden)


class TargetRunner:
    """Owns the target model, its paged cache and the forwards the engine needs."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, buckets=None, max_blocks: int = 0):
        self.model = model
        self.device = model.lm_head.weight.device
        self.block_size = block_size
        self.cache: KVCache = model.make_cache(num_blocks + 1, block_size)  # + the trash block
        self.run = PagedForward(
            lambda i, p, c, m, rows: model.forward_paged(i, p, c, m, logits_indices=rows),
            self.cache, self.device, buckets, max_blocks,
        )  # fmt: skip

    @torch.no_grad()
    def forward(self, tokens: list[int], layout: Layout, mode: str, logits_rows=None, tree_mask=None):
        meta, positions = build_meta(layout, mode, self.block_size, self.device, tree_mask)
        ids = torch.tensor(tokens, dtype=torch.long).to(self.device)
        rows = None if logits_rows is None else torch.tensor(logits_rows, dtype=torch.long).to(self.device)
        return self.run(ids, positions, meta, logits_rows=rows)

    def copy_blocks(self, copies: list[tuple[int, int]], caches: list[KVCache]) -> None:
        """Apply copy-on-fork block copies to every cache that shares the block tables."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for c in caches:
            c.k[:, dst] = c.k[:, src]
            c.v[:, dst] = c.v[:, src]
