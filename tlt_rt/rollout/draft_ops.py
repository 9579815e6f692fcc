"""Which kernels a draft step runs for its top-k, its level bookkeeping and its rerank: the Triton ones on
CUDA (each checked against its torch reference in tests/test_kernel_*.py), the torch references elsewhere."""

from __future__ import annotations

from torch import Tensor

from tlt_rt.codegen.kernels.build_tree import build_tree_triton
from tlt_rt.codegen.kernels.draft_level import draft_level, draft_level_reference
from tlt_rt.codegen.kernels.topk_lse import topk_logprobs, topk_logprobs_reference
from tlt_rt.ir.tree import Candidates, DraftTree, build_tree


def top_children(drafter, logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k most likely children of each row of drafter logits over the draft vocabulary [R, Vd]: log-probs
    [R, k] f32 and target token ids [R, k] (on CUDA one Triton top-k + log-sum-exp in two launches, which
    also map a reduced draft vocabulary's ids to the target's; no [R, V] log-softmax is written, and a
    reduced draft vocabulary is never scattered to the full one)."""
    # a reduced draft vocabulary's draft -> target ids (a buffer of the drafter: already on its device)
    d2t = None if drafter.d2t is None else drafter.d2t.to(logits.device)
    if logits.is_cuda:
        return topk_logprobs(logits, k, id_map=d2t)
    return topk_logprobs_reference(logits, k, id_map=d2t)


def next_level(drafter, logits: Tensor, hidden: Tensor, front_score, mask, k: int, offset: int):
    """A level's children (each frontier row's k best, target ids [B*K, K]) and `draft_level`'s results for
    them."""
    child_lp, children = top_children(drafter, logits, k)
    advance = draft_level if logits.is_cuda else draft_level_reference
    return children, advance(front_score, child_lp, children, hidden, mask, offset)


def fused_build_tree(cands: Candidates, root_tokens: Tensor, prefix_lens: Tensor, verify_tokens: int) -> DraftTree:
    """`build_tree` in one Triton launch on CUDA (`codegen.kernels.build_tree`, one program per sequence, where
    torch runs ~56 small sorts, gathers and scatters inside the captured step); `build_tree` itself elsewhere.
    The same tree, field for field (tested)."""
    build = build_tree_triton if cands.tokens.is_cuda else build_tree
    return build(cands, root_tokens, prefix_lens, verify_tokens)
