"""The drafter's side of a speculative step: catch up on the target's hidden states, then grow the tree.

Positions (L = a sequence's cached target tokens; its pending root x_L sits at position L):
- drafter row p pairs the target hidden h_p with token x_{p+1} and predicts h_{p+1}; row L-1 is the
  root's, whose output drafts depth 1.
- catch-up: every step runs the fixed block of R rows [L-R, L) under a causal mask over the cached prefix
  (the tree-attention metadata the levels use, with a lower-triangular mask). R is the deepest configured
  strategy's depth + 1 (`DrafterRunner.block_rows`), whatever strategy this step drafts with: after a step
  that accepted a tokens the rows the drafter has not seen are [L-a-1, L), never more than that step's
  depth + 1, so a switch from a deep strategy to a shallow one never leaves the drafter behind. Rows it has
  seen are recomputed from the same target hidden states, which rewrites their K/V with the same values.
  Rows before position 0 (L < R) are padding: they write to the trash slot and see nothing. In auto mode R
  is one row more, so one plain step in between leaves no sequence beyond the block. A sequence
  further behind (speculation switched on after plain decoding, or a recomputed one) first runs rows
  [draft_cached, L-R) through an eager prefill-style forward (`DrafterRunner.catch_up`).
- a node at tree depth d is drafter row L+d-1; level d writes its topk rows to drafter cache positions
  [L+(d-1)K, L+dK) and sees, inside that window, only its own ancestors (a tree mask of width dK).
Drafter rows for accepted tokens are recomputed from the target's own hidden states at the next step
rather than committed from the draft, so the drafter always conditions on true features.

`draft_tree` (block, depth-1 levels, reranking) reads only device tensors, never syncs with the host and
has shapes fixed by (B, strategy): it is the DRAFT node of the captured step (rollout/step/graph.py).
`DrafterRunner` is the eager side: the drafter's cache, the catch-up beyond the block, the draft inputs; the
hidden windows it reads between steps are kept by `DraftWindows` (rollout/step/draft_windows.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tlt_rt.ir.strategy import Strategy
from tlt_rt.ir.tree import Candidates, DraftTree, build_tree
from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.drafter_catchup import catch_up_rows
from tlt_rt.models.llama import KVCache
from tlt_rt.rollout.sequence import Sequence, flush_hidden
from tlt_rt.rollout.step.draft_windows import DraftWindows, PlainRun
from tlt_rt.rollout.step.ops import fused_build_tree, maybe_compiled, next_level, top_children
from tlt_rt.rollout.step.target import Layout, build_meta, to_device

__all__ = [
    "DraftInputs",
    "DrafterRunner",
    "PlainRun",
    "catch_up_block",
    "draft_candidates",
    "draft_tree",
    "grow_candidates",
    "upload",
]


@dataclass
class DraftInputs:
    """One draft's device inputs, B sequences, R >= depth + 1 catch-up rows."""

    tokens: Tensor  # [B, R] int64: token x_{p+1} of block row p = L-R+j; tokens[:, -1] is the root x_L
    hidden: Tensor  # [B, R, H] target hidden h_p of block row p (before the final norm), zeros for padding
    valid: Tensor  # [B] int64 real rows of the block, min(L, R); 0 marks a padding sequence
    prefix_lens: Tensor  # [B] int64 L
    tables: Tensor  # [B, W] int32 block tables (the target's)


def _block_meta(tokens, hidden, valid, prefix_lens, tables, features, block_size: int, trash: int):
    """The catch-up block's attention inputs and features (one fused kernel or two when compiled): causal
    mask over its real rows [B, R, R], cache slots [B*R] (padding rows to the trash slot), rotary positions
    [B*R], cu [B*R+1], seq_lens [B] int32, the root rows [B], and the rows' drafter features [B*R, H]."""
    b, r = tokens.shape
    j = torch.arange(r, device=tokens.device)
    real = j >= (r - valid)[:, None]  # [B, R]
    mask = torch.ones(r, r, dtype=torch.bool, device=tokens.device).tril() & real[:, None, :] & real[:, :, None]
    pos = prefix_lens.long()[:, None] - r + j  # [B, R] cache position of each row
    slots = tables.long().gather(1, pos.clamp(min=0) // block_size) * block_size + pos % block_size
    slots = torch.where((pos >= 0) & real, slots, trash)
    cu = torch.arange(0, b * r + 1, r, dtype=torch.int32, device=tokens.device)
    roots = torch.arange(b, device=tokens.device) * r + (r - 1)
    feats = features(hidden.reshape(b * r, -1))
    return mask, slots.flatten(), pos.clamp(min=0).flatten(), cu, prefix_lens.int(), roots, feats


def catch_up_block(
    drafter, cache: KVCache, ins: DraftInputs, block_size: int, compiled: bool = False
) -> tuple[Tensor, Tensor]:
    """Drafter rows [L-R, L) of every sequence in one fixed-shape forward; the root row's logits over the
    draft vocabulary [B, Vd] and output hidden [B, H]. `compiled`: the block's inputs through torch.compile,
    as the captured step runs them."""
    r = ins.tokens.shape[1]
    trash = cache.num_blocks * cache.block_size - 1
    meta_fn = maybe_compiled(_block_meta, compiled, ins.tokens.device)
    mask, slots, positions, cu, lens, roots, feats = meta_fn(
        ins.tokens, ins.hidden, ins.valid, ins.prefix_lens, ins.tables, drafter.features, block_size, trash
    )
    meta = AttnMetadata("verify", cu, lens, ins.tables, slots, r, mask, slots_resolved=True)
    out = drafter.forward_paged(ins.tokens.reshape(-1), feats, positions, cache, meta, roots, full_vocab=False)
    return out.logits, out.hidden[roots]


def draft_candidates(
    drafter, cache: KVCache, strategy: Strategy, block_size: int, ins: DraftInputs, compiled: bool = False
) -> Candidates:
    """Catch up, then grow the candidate tree level by level (EAGLE-2 expansion); every candidate."""
    root_logits, root_hidden = catch_up_block(drafter, cache, ins, block_size, compiled)
    return grow_candidates(drafter, cache, strategy, block_size, ins, root_logits, root_hidden, compiled)


def _level_meta(prefix_lens, tables, valid, k: int, levels: int, block_size: int, trash_slot: int):
    """Every level's attention inputs at once, [D-1, ...] so that level d reads contiguous views: positions
    [D-1, B, K] (rotary L+d-1), seq_lens [D-1, B] (L+dK), slots [D-1, B, K] (cache positions [L+(d-1)K, L+dK),
    padding sequences to the trash slot), and cu [B*K+1]."""
    b, dev = prefix_lens.shape[0], prefix_lens.device
    cached = prefix_lens.long()
    d = torch.arange(1, levels + 1, device=dev)
    positions = (cached[None, :] + (d - 1)[:, None])[..., None].expand(levels, b, k).contiguous()
    pos = cached[None, :, None] + ((d - 1) * k)[:, None, None] + torch.arange(k, device=dev)  # [D-1, B, K]
    blocks = tables.long()[None].expand(levels, -1, -1).gather(2, pos // block_size)
    live = (valid > 0)[None, :, None]
    slots = torch.where(live, blocks * block_size + pos % block_size, trash_slot)
    seq_lens = (cached[None, :] + (d * k)[:, None]).int()
    cu = torch.arange(0, b * k + 1, k, dtype=torch.int32, device=dev)
    return positions, seq_lens, slots, cu


def grow_candidates(
    drafter,
    cache: KVCache,
    strategy: Strategy,
    block_size: int,
    ins: DraftInputs,
    root_logits,
    root_hidden,
    compiled: bool = False,
) -> Candidates:
    """The depth-1 drafter levels from the root rows' logits over the draft vocabulary [B, Vd] and output
    hidden [B, H].

    Level d's frontier (the K best candidates of the level before, by cumulative log-prob, ties to the lower
    index) runs as K drafter rows. Its tree mask [B, K, dK] is its parents' rows widened by its own slot,
    and its input features are the drafter outputs of its parents: both are gathers by the parent's place in
    the frontier, so no ancestry walk is needed (one launch a level on CUDA, `codegen.kernels.draft_level`).
    `compiled`: every level's attention inputs through torch.compile, as the captured step builds them."""
    k, levels = strategy.topk, strategy.depth - 1
    b, dev = ins.tokens.shape[0], ins.tokens.device
    lp, toks = top_children(drafter, root_logits, k)  # level 0: the root's K best children, sorted
    if levels == 0:
        return Candidates(toks, lp, torch.full_like(toks, -1), k)
    tokens, scores, fronts = [toks], [lp], []
    level_meta = maybe_compiled(_level_meta, compiled, dev)
    trash = cache.num_blocks * cache.block_size - 1
    positions, seq_lens, slots, cu = level_meta(ins.prefix_lens, ins.tables, ins.valid, k, levels, block_size, trash)
    mask = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)  # level 1 sees only itself
    front_flat = torch.arange(k, device=dev).expand(b, k)  # level 0 is sorted: its frontier is itself
    front_tok, front_score, feats = toks, lp, root_hidden[:, None].expand(b, k, -1)
    for d in range(1, levels + 1):
        meta = AttnMetadata("verify", cu, seq_lens[d - 1], ins.tables, slots[d - 1].view(-1), k, mask,
                            slots_resolved=True)  # fmt: skip
        out = drafter.forward_paged(front_tok.reshape(-1), feats.reshape(b * k, -1), positions[d - 1].view(-1),
                                    cache, meta, full_vocab=False)  # fmt: skip
        fronts.append(front_flat)
        # the level's children [B*K, K] and scores, and the next frontier (its K best, ties to the lower index)
        # with its inputs: the parents' drafter outputs as features, their tree-mask rows widened by its slot
        child_tok, (level_score, front_flat, front_tok, front_score, feats, mask) = next_level(
            drafter, out.logits, out.hidden, front_score, mask, k, k + (d - 1) * k * k
        )
        tokens.append(child_tok.view(b, k * k))
        scores.append(level_score)
    # a level's K*K candidates are frontier-major: candidate j's parent is the level's frontier node j // K
    parents = torch.stack(fronts, 1)[..., None].expand(b, levels, k, k).reshape(b, levels * k * k)
    parents = torch.cat([torch.full_like(toks, -1), parents], 1)
    return Candidates(torch.cat(tokens, 1), torch.cat(scores, 1), parents, k)


def draft_tree(
    drafter, cache: KVCache, strategy: Strategy, block_size: int, ins: DraftInputs, compiled: bool = False
) -> DraftTree:
    """The whole drafter step: catch-up block, depth-1 levels, rerank into the verify tree (`compiled`:
    the rerank through `fused_build_tree`, one launch on CUDA, as the captured step runs it)."""
    cands = draft_candidates(drafter, cache, strategy, block_size, ins, compiled)
    build = fused_build_tree if compiled else build_tree
    return build(cands, ins.tokens[:, -1], ins.prefix_lens, strategy.verify_tokens)


class DrafterRunner(DraftWindows):
    """The drafter's one-layer paged cache (sharing the target's block tables) and its step, over the
    hidden windows of `DraftWindows` (window_rows: see there).
    """

    def __init__(self, drafter, num_blocks: int, block_size: int, window_rows: int = 0):
        super().__init__(window_rows, drafter.fc.weight.device)
        self.drafter = drafter
        self.block_size = block_size
        self.cache: KVCache = drafter.make_cache(num_blocks + 1, block_size)  # + the trash block

    def rows_behind(self, seqs: list[Sequence]) -> int:
        """Drafter rows of `seqs` a speculative step would catch up eagerly before its block (beyond the window)."""
        rows = self.window_rows
        return sum(max(0, s.num_cached - s.draft_cached - rows) for s in seqs)

    def block_rows(self, strategy: Strategy) -> int:
        """Rows of the catch-up block a step of `strategy` runs: window_rows, at least its depth + 1."""
        return max(strategy.depth + 1, self.window_rows)

    @torch.no_grad()
    def catch_up(self, seqs: list[Sequence], tables: list[list[int]], ends: list[int] | None = None):
        """Eagerly run drafter rows [draft_cached, end) of every sequence (end: num_cached unless given);
        returns the last row's logits over the draft vocabulary and its hidden."""
        ends = [s.num_cached for s in seqs] if ends is None else ends
        ids, hidden, layout = [], [], Layout(tables, [], [])
        for s, end in zip(seqs, ends, strict=True):
            c = s.draft_cached
            ids += s.tokens[c + 1 : end + 1]
            hidden.append(s.hidden_rows(c, end))
            layout.starts.append(c)
            layout.q_lens.append(end - c)
            s.draft_cached = end
        meta, positions = build_meta(layout, "prefill", self.block_size, self.device)
        last = meta.cu_seqlens_q[1:].long() - 1  # each sequence's last row
        feats = self.drafter.features((hidden[0] if len(hidden) == 1 else torch.cat(hidden)).to(self.device))
        tokens = to_device(torch.tensor(ids, dtype=torch.long), self.device)
        # every row's K/V; the layer's attention, MLP and head for each sequence's last row only
        out = catch_up_rows(self.drafter, tokens, feats, positions, self.cache, meta, last)
        return out.logits, out.hidden

    def prepare(self, seqs: list[Sequence], tables: list[list[int]], rows: int) -> Tensor:
        """Bring every sequence within `rows` of its cache (eager catch-up for those further behind) and
        return the target hidden windows [B, max(rows, window_rows), H] ending at each num_cached. Marks the
        drafter rows as cached: the caller runs the block. `tables[i]`: sequence i's block table (a list of
        lists or a `block_manager.Tables`)."""
        self.settle_windows()
        behind = [i for i, s in enumerate(seqs) if s.num_cached - s.draft_cached > rows]
        if behind:
            flush_hidden(seqs)
            ends = [seqs[i].num_cached - rows for i in behind]
            self.catch_up([seqs[i] for i in behind], [tables[i] for i in behind], ends)
        width = max(rows, self.window_rows)
        for s in seqs:
            s.draft_cached = s.num_cached
        current = self._current_windows(seqs, width)
        if current is not None:
            return current
        flush_hidden(seqs)  # the logged rows of every sequence at once, before any window reads them
        return torch.stack([self._window(s, width) for s in seqs])

    @torch.no_grad()
    def draft(
        self, seqs: list[Sequence], tables: list[list[int]], table_t: Tensor, strategy: Strategy, device=None
    ) -> Candidates:
        """Every candidate of one eager draft for `seqs` (catching up as needed); table_t: `tables` on the device
        (`device` is the runner's own and only accepted for the caller's convenience)."""
        ins = self.inputs(seqs, tables, table_t, strategy)
        return draft_candidates(self.drafter, self.cache, strategy, self.block_size, ins)

    def inputs(self, seqs: list[Sequence], tables: list[list[int]], table_t: Tensor, strategy: Strategy):
        """DraftInputs for `seqs` (see `prepare`), built with one host-to-device copy."""
        r = self.block_rows(strategy)
        window = self.prepare(seqs, tables, r)
        rows = [[s.num_cached, min(s.num_cached, r), *s.last_tokens(r)] for s in seqs]
        (lens, valid), tokens = upload(rows, 2, self.device)
        return DraftInputs(tokens, window[:, -r:], valid, lens, table_t)


def upload(rows: list[list[int]], scalars: int, device) -> tuple[list[Tensor], Tensor]:
    """Host int rows [B, scalars + C] -> the first `scalars` columns as contiguous [B] int64 device tensors
    and the rest as a contiguous [B, C], with one host-to-device copy."""
    host = torch.tensor(rows, dtype=torch.long)
    b = host.shape[0]
    dev = torch.cat([host[:, :scalars].t().reshape(-1), host[:, scalars:].reshape(-1)]).to(device)
    return [dev[i * b : (i + 1) * b] for i in range(scalars)], dev[scalars * b :].view(b, -1)
