"""Which kernels a draft step runs for its top-k, its level bookkeeping and its rerank: the Triton ones on
CUDA (each checked against its torch reference in tests/test_kernel_*.py), the torch references elsewhere."""

from __future__ import annotations

from torch import Tensor

from tlt_rt.codegen.kernels.build_tree import build_tree_triton
from tlt_rt.codegen.kernels.draft_level import draft_level, draft_level_from_chunks, draft_level_reference
from tlt_rt.codegen.kernels.topk_lse import (
    Chunks,
    head_topk_chunks,
    merge_chunks,
    topk_chunks,
    topk_logprobs,
    topk_logprobs_reference,
)
from tlt_rt.ir.tree import Candidates, DraftTree, build_tree


def _id_map(drafter, device):
    """A reduced draft vocabulary's draft -> target ids on `device` (a buffer of the drafter: already there),
    None for the full vocabulary."""
    return None if drafter.d2t is None else drafter.d2t.to(device)


def top_children(drafter, logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k most likely children of each row of drafter logits over the draft vocabulary [R, Vd]: log-probs
    [R, k] f32 and target token ids [R, k] (on CUDA one Triton top-k + log-sum-exp in two launches, which
    also map a reduced draft vocabulary's ids to the target's; no [R, V] log-softmax is written, and a
    reduced draft vocabulary is never scattered to the full one)."""
    d2t = _id_map(drafter, logits.device)
    if logits.is_cuda:
        return topk_logprobs(logits, k, id_map=d2t)
    return topk_logprobs_reference(logits, k, id_map=d2t)


def head_fused(drafter, device) -> bool:
    """Whether draft rows leave the LM head to the top-k (`drafter.fused_head_topk`, CUDA only): the drafter's
    forward then returns no logits, and `row_children` / `next_level` take its output rows instead."""
    return device.type == "cuda" and getattr(drafter, "fused_head_topk", False)


def _chunks(drafter, logits: Tensor | None, rows: Tensor, k: int) -> Chunks:
    if logits is not None:
        return topk_chunks(logits, k)
    w = drafter.head_weight()
    return head_topk_chunks(rows.to(w.dtype), w, k)


def row_children(drafter, logits: Tensor | None, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`top_children` of the logits, or where they are None (`head_fused`) of the head applied to `rows`
    inside the top-k's first launch."""
    if logits is not None:
        return top_children(drafter, logits, k)
    return merge_chunks(_chunks(drafter, None, rows, k), _id_map(drafter, rows.device))


def next_level(drafter, logits: Tensor | None, hidden: Tensor, front_score, mask, k: int, offset: int):
    """A level's children (each frontier row's k best, target ids [B*K, K]) and `draft_level`'s results for
    them; logits None: the head is applied inside the top-k (`head_fused`). With `drafter.fused_level_merge`
    on CUDA the top-k's merge runs inside the level's own launch (`draft_level_from_chunks`): one launch less
    a level, the same results."""
    if hidden.is_cuda and getattr(drafter, "fused_level_merge", False):
        chunks, d2t = _chunks(drafter, logits, hidden, k), _id_map(drafter, hidden.device)
        *level, children = draft_level_from_chunks(front_score, chunks, d2t, hidden, mask, offset)
        return children, level
    child_lp, children = row_children(drafter, logits, hidden, k)
    advance = draft_level if hidden.is_cuda else draft_level_reference
    return children, advance(front_score, child_lp, children, hidden, mask, offset)


def fused_build_tree(cands: Candidates, root_tokens: Tensor, prefix_lens: Tensor, verify_tokens: int) -> DraftTree:
    """`build_tree` in one Triton launch on CUDA (`codegen.kernels.build_tree`, one program per sequence, where
    torch runs ~56 small sorts, gathers and scatters inside the captured step); `build_tree` itself elsewhere.
    The same tree, field for field (tested)."""
    build = build_tree_triton if cands.tokens.is_cuda else build_tree
    return build(cands, root_tokens, prefix_lens, verify_tokens)
