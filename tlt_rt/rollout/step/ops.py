"""The small helpers one speculative step shares: its KV scratch, its compiled glue, its draft kernels.

What a speculative step needs of the KV cache (`scratch_tokens`): L is a sequence's cached target tokens;
its pending root x_L sits at position L. The drafter grows its tree in scratch positions past L
(step/drafting.py), the target verifies the T tree nodes at cache positions [L, L+T) with rotary positions
L+depth, and the accepted path is then moved to [L+1, L+1+a] (the COMMIT node); the bonus token becomes the
next root. The step itself is rollout/step/graph.py.

torch.compile for the small device glue inside a captured step (`maybe_compiled`): a captured step replays
every kernel its eager run launched, so a handful of index computations written as a dozen torch ops cost a
dozen launches (each ~1 µs of gap plus ~1.5 µs of kernel on an H100) at every step. Compiled, Inductor
fuses each such function into one or two kernels. Functions compile once, on first use (the graph pool's
warm-up runs, outside any capture), with dynamic shapes so that one compiled graph serves every batch
bucket. On CPU, or outside captured steps, the plain function runs.

Which kernels a draft step runs for its top-k, its level bookkeeping and its rerank (`top_children`,
`next_level`, `fused_build_tree`): the Triton ones on CUDA (each checked against its torch reference in
tests/test_kernel_*.py), the torch references elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tlt_rt.codegen.kernels.build_tree import build_tree_triton
from tlt_rt.codegen.kernels.draft_level import draft_level, draft_level_reference
from tlt_rt.codegen.kernels.topk_lse import topk_logprobs, topk_logprobs_reference
from tlt_rt.ir.strategy import Strategy
from tlt_rt.ir.tree import Candidates, DraftTree, build_tree


def scratch_tokens(strategy: Strategy) -> int:
    """Cache positions past L a step needs: the verify tree or the drafter's level scratch, whichever is longer."""
    return max(strategy.verify_tokens, (strategy.depth - 1) * strategy.topk)


_compiled: dict[str, object] = {}


def maybe_compiled(fn, compiled: bool, device: torch.device):
    """`fn` itself, or (on CUDA, when `compiled`) its torch.compile'd version."""
    if not compiled or device.type != "cuda":
        return fn
    name = f"{fn.__module__}.{fn.__qualname__}"
    if name not in _compiled:
        # dynamo's default recompile limit (8 a function) stays: past it the remaining variants run eagerly
        # (still inside the captured step); raising it made capture compile for minutes cold
        _compiled[name] = torch.compile(fn, dynamic=True)
    return _compiled[name]


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
