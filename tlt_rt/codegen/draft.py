"""The drafter's part of a step on the device: the catch-up block, the draft levels, the rerank.

Positions (L = a sequence's cached target tokens; its pending root x_L sits at position L):
- drafter row p pairs the target hidden h_p with token x_{p+1} and predicts h_{p+1}; row L-1 is the root's,
  whose output drafts level 1.
- catch-up (the CATCHUP node): every step runs the fixed block of R rows [L-R, L) under a causal mask over the
  cached prefix. R is at least the deepest configured strategy's depth + 1 (the engine's `DrafterRunner`
  chooses it), whatever strategy this step drafts with: after a step that accepted a tokens the rows the
  drafter has not seen are [L-a-1, L), never more than that step's depth + 1. Rows it has seen are
  recomputed from the same target hidden states, which rewrites their K/V with the same values. Rows before
  position 0 (L < R) are padding: they write to the trash slot and see nothing.
- a node at tree depth d is drafter row L+d-1; level d (the LEVEL nodes, d >= 2) writes its K rows to drafter
  cache positions [L+(d-2)K, L+(d-1)K) and sees, inside that window, only its own ancestors.
Drafter rows for accepted tokens are recomputed from the target's own hidden states at the next step rather
than committed from the draft, so the drafter always conditions on true features.

Everything here reads device tensors only, never syncs with the host and has shapes fixed by (B, strategy):
the lowered step runs it inside one captured graph (codegen/lower.py). `catch_up_block`, `grow_candidates`
and `draft_tree` compose the same functions for callers that run a whole draft at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from tlt_rt.codegen.table import kernel, maybe_compiled
from tlt_rt.ir.strategy import Strategy
from tlt_rt.ir.tree import Candidates, DraftTree, build_tree
from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.llama import KVCache


@dataclass
class DraftInputs:
    """One draft's device inputs, B sequences, R >= depth + 1 catch-up rows."""

    tokens: Tensor  # [B, R] int64: token x_{p+1} of block row p = L-R+j; tokens[:, -1] is the root x_L
    hidden: Tensor  # [B, R, H] target hidden h_p of block row p (before the final norm), zeros for padding
    valid: Tensor  # [B] int64 real rows of the block, min(L, R); 0 marks a padding sequence
    prefix_lens: Tensor  # [B] int64 L
    tables: Tensor  # [B, W] int32 block tables (the target's)


@dataclass
class Frontier:
    """The K nodes of one draft level that the next level expands."""

    tokens: Tensor  # [B, K] int64 target ids
    scores: Tensor  # [B, K] f32 cumulative log-probs
    index: Tensor  # [B, K] int64 each node's flat index among the step's candidates
    feats: Tensor  # [B, K, Hd] the drafter outputs their children are drafted from
    mask: Tensor  # [B, K, dK] bool tree mask over the level window


FRONTIER_FIELDS = tuple(f.name for f in fields(Frontier))  # a frontier's tensors, in order


def top_children(drafter, logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k most likely children of each row of drafter logits over the draft vocabulary [R, Vd]: log-probs
    [R, k] f32 and target token ids [R, k] (on CUDA one Triton top-k + log-sum-exp in two launches, which
    also map a reduced draft vocabulary's ids to the target's; no [R, V] log-softmax is written, and a
    reduced draft vocabulary is never scattered to the full one)."""
    # a reduced draft vocabulary's draft -> target ids (a buffer of the drafter: already on its device)
    d2t = None if drafter.d2t is None else drafter.d2t.to(logits.device)
    return kernel("topk_logprobs", logits.device)(logits, k, id_map=d2t)


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
    meta_fn = maybe_compiled(_block_meta, compiled, ins.tokens.device)
    mask, slots, positions, cu, lens, roots, feats = meta_fn(
        ins.tokens, ins.hidden, ins.valid, ins.prefix_lens, ins.tables, drafter.features, block_size,
        cache.trash_slot,
    )  # fmt: skip
    meta = AttnMetadata("verify", cu, lens, ins.tables, slots, r, mask, slots_resolved=True)
    out = drafter.forward_paged(ins.tokens.reshape(-1), feats, positions, cache, meta, roots, full_vocab=False)
    return out.logits, out.hidden[roots]


def first_frontier(drafter, root_logits: Tensor, root_hidden: Tensor, k: int) -> Frontier:
    """Level 1: the root's k best children, sorted (so the frontier is the level itself)."""
    lp, toks = top_children(drafter, root_logits, k)
    b, dev = toks.shape[0], toks.device
    mask = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)  # level 1 sees only itself
    index = torch.arange(k, device=dev).expand(b, k)
    return Frontier(toks, lp, index, root_hidden[:, None].expand(b, k, -1), mask)


def level_meta(prefix_lens, tables, valid, k: int, levels: int, block_size: int, trash_slot: int):
    """Every level's attention inputs at once, [D-1, ...] so that level d reads contiguous views: positions
    [D-1, B, K] (rotary L+d-2), seq_lens [D-1, B] (L+(d-1)K), slots [D-1, B, K] (cache positions
    [L+(d-2)K, L+(d-1)K), padding sequences to the trash slot), and cu [B*K+1]."""
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


def level_inputs(cache: KVCache, prefix_lens, tables, valid, k: int, levels: int, block_size: int, compiled: bool):
    """`level_meta` for a draft's `levels` later levels, padding writes to `cache`'s trash slot (`compiled`: through
    torch.compile, as the captured step builds them)."""
    meta_fn = maybe_compiled(level_meta, compiled, prefix_lens.device)
    return meta_fn(prefix_lens, tables, valid, k, levels, block_size, cache.trash_slot)


def expand_level(drafter, cache: KVCache, front: Frontier, tables: Tensor, meta: tuple, i: int, k: int):
    """Level i + 2 from frontier i + 1 (`meta`: `level_meta`'s tensors): the frontier's K rows through the
    drafter; their children (each row's K best: target ids [B, K*K] and cumulative scores, frontier-major, so
    child j hangs from frontier node j // K, whose flat candidate index `front.index` gives) and the next
    frontier (its K best, ties to the lower index). Its tree mask is its parents' rows widened by its own slot,
    its input features the parents' drafter outputs: both gathers by the parent's place in the frontier (one
    launch on CUDA, `codegen.kernels.draft_level`). Returns ((tokens, scores, front.index), next frontier)."""
    positions, seq_lens, slots, cu = meta
    b = front.tokens.shape[0]
    attn = AttnMetadata("verify", cu, seq_lens[i], tables, slots[i].view(-1), k, front.mask, slots_resolved=True)
    out = drafter.forward_paged(front.tokens.reshape(-1), front.feats.reshape(b * k, -1), positions[i].view(-1),
                                cache, attn, full_vocab=False)  # fmt: skip
    child_lp, children = top_children(drafter, out.logits, k)
    advance = kernel("draft_level", out.logits.device)
    score, index, tokens, front_score, feats, mask = advance(
        front.scores, child_lp, children, out.hidden, front.mask, k + i * k * k
    )
    return (children.view(b, k * k), score, front.index), Frontier(tokens, front_score, index, feats, mask)


def candidates(tokens: list[Tensor], scores: list[Tensor], fronts: list[Tensor], k: int) -> Candidates:
    """Every level's candidates as one `Candidates`: level 1's K (their parent the root, -1), then each later
    level's K*K, whose parents are the K nodes of the frontier it expanded (`fronts`, [B, K] flat indices each)."""
    if not fronts:
        return Candidates(tokens[0], scores[0], torch.full_like(tokens[0], -1), k)
    b, levels = tokens[0].shape[0], len(fronts)
    parents = torch.stack(fronts, 1)[..., None].expand(b, levels, k, k).reshape(b, levels * k * k)
    parents = torch.cat([torch.full_like(tokens[0], -1), parents], 1)
    return Candidates(torch.cat(tokens, 1), torch.cat(scores, 1), parents, k)


def rerank(cands: Candidates, roots: Tensor, prefix_lens: Tensor, verify_tokens: int, compiled: bool) -> DraftTree:
    """`build_tree`: in one Triton launch on CUDA when `compiled` (one program per sequence, where torch runs
    ~56 small sorts, gathers and scatters inside the captured step); the same tree, field for field (tested)."""
    build = kernel("build_tree", roots.device) if compiled else build_tree
    return build(cands, roots, prefix_lens, verify_tokens)


def grow_candidates(
    drafter, cache: KVCache, strategy: Strategy, block_size: int, ins: DraftInputs, root_logits, root_hidden,
    compiled: bool = False,
) -> Candidates:  # fmt: skip
    """Every candidate of a draft from the root rows' logits over the draft vocabulary [B, Vd] and output
    hidden [B, H]: level 1, then each later level (EAGLE-2 expansion)."""
    k, levels = strategy.topk, strategy.depth - 1
    front = first_frontier(drafter, root_logits, root_hidden, k)
    tokens, scores, fronts = [front.tokens], [front.scores], []
    if levels:
        meta = level_inputs(cache, ins.prefix_lens, ins.tables, ins.valid, k, levels, block_size, compiled)
        for i in range(levels):
            (t, s, f), front = expand_level(drafter, cache, front, ins.tables, meta, i, k)
            tokens.append(t), scores.append(s), fronts.append(f)
    return candidates(tokens, scores, fronts, k)


def draft_candidates(
    drafter, cache: KVCache, strategy: Strategy, block_size: int, ins: DraftInputs, compiled: bool = False
) -> Candidates:
    """Catch up, then grow the candidate tree level by level; every candidate."""
    root_logits, root_hidden = catch_up_block(drafter, cache, ins, block_size, compiled)
    return grow_candidates(drafter, cache, strategy, block_size, ins, root_logits, root_hidden, compiled)


def draft_tree(
    drafter, cache: KVCache, strategy: Strategy, block_size: int, ins: DraftInputs, compiled: bool = False
) -> DraftTree:
    """The whole drafter step: catch-up block, levels, rerank into the verify tree."""
    cands = draft_candidates(drafter, cache, strategy, block_size, ins, compiled)
    return rerank(cands, ins.tokens[:, -1], ins.prefix_lens, strategy.verify_tokens, compiled)
