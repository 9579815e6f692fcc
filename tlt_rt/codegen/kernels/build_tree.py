"""The rerank of a speculative step's draft candidates into the verify tree, in one launch.

B sequences, N = K + (D-1)*K*K candidates each (`ir.tree.Candidates`), T = verify_tokens, M = T - 1:

    eff[i]      = min(score[i], eff[parent[i]])    level by level (score[i] at level 0)
    rank[i]     = #{j: eff[j] > eff[i] or (eff[j] == eff[i] and j < i)}    (a stable descending sort)
    kept[i]     = rank[i] < M                      node_of[i] = #{kept j <= i} if kept[i] else -1
    node m = node_of[i]:  token = tokens[i], parent = node_of[parent[i]] (0 under the root), depth = level(i) + 1
    paths / tree_mask: every node walked up D times; children[p, r] = the node of parent p with r earlier siblings

The reference is `ir.tree.build_tree` itself. torch runs it as ~56 small kernels (sorts, scatters, gathers)
inside the captured step, each a microsecond of launch gap at batch 1. Here one program per sequence holds
a sequence's candidates in one block: ranks are [BLOCK_I, BLOCK_N] comparisons in registers, a prefix sum
numbers the kept ones, and gathers by a data-dependent index (a parent's eff, its node number, a node's
parent) go through a per-sequence scratch row in global memory behind a block barrier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tlt_rt.ir.tree import Candidates, DraftTree
from tlt_rt.ir.tree import build_tree as build_tree_reference

__all__ = ["build_tree_reference", "build_tree_triton"]


@triton.jit
def _build_tree_kernel(
    # pointers
    TOKENS,  # [B, N] int64 candidate tokens
    SCORES,  # [B, N] f32 cumulative log-probs
    CAND_PARENTS,  # [B, N] int64 parent candidate, -1 under the root
    ROOT,  # [B] int root token (strided: the last column of the draft's token block)
    PREFIX,  # [B] int prefix length
    EFF,  # [B, N] f32 scratch: clamped scores
    RANK,  # [B, N] int32 scratch
    NODE_OF,  # [B, N] int32 scratch: node number of each candidate, -1 if dropped
    TREE_TOKENS,  # [B, T] int64 out
    PARENTS,  # [B, T] int64 out
    DEPTHS,  # [B, T] int64 out
    POSITIONS,  # [B, T] int64 out
    TREE_MASK,  # [B, T, T] uint8 out
    PATHS,  # [B, T, D+1] int64 out
    CHILDREN,  # [B, T, K] int64 out
    NUM_CHILDREN,  # [B, T] int64 out
    # sizes
    N,
    T,
    # strides
    stride_root,
    stride_prefix,
    # meta
    D: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    in_n = n < N
    row = b * N

    # ---- monotone clamp along every path: a level reads its parents' final eff, so D-1 passes
    eff = tl.load(SCORES + row + n, mask=in_n, other=0.0).to(tl.float32)
    cand_par = tl.load(CAND_PARENTS + row + n, mask=in_n, other=-1)
    has_par = (cand_par >= 0) & (cand_par < N)
    par_at = tl.where(has_par, cand_par, 0)  # as build_tree's clamp(min=0), and never outside the row
    tl.store(EFF + row + n, eff, mask=in_n)
    for level in tl.static_range(1, D):
        tl.debug_barrier()  # the level before is stored
        start = K + (level - 1) * K * K
        in_level = in_n & (n >= start) & (n < start + K * K)
        parent_eff = tl.load(EFF + row + par_at, mask=in_level, other=0.0)
        eff = tl.where(in_level, tl.minimum(eff, parent_eff), eff)
        tl.store(EFF + row + n, eff, mask=in_level)
    tl.debug_barrier()

    # ---- rank of each candidate among all N, BLOCK_I rows against the whole row at a time
    for i0 in range(0, N, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        eff_i = tl.load(EFF + row + i, mask=i < N, other=0.0)
        ahead = (eff[None, :] > eff_i[:, None]) | ((eff[None, :] == eff_i[:, None]) & (n[None, :] < i[:, None]))
        rank = tl.sum((ahead & in_n[None, :]).to(tl.int32), axis=1)  # [BLOCK_I]
        tl.store(RANK + row + i, rank, mask=i < N)
    tl.debug_barrier()

    # ---- keep the best M, numbered 1.. in flat candidate order
    kept = in_n & (tl.load(RANK + row + n, mask=in_n, other=N) < T - 1)
    node_of = tl.where(kept, tl.cumsum(kept.to(tl.int32), axis=0), -1)
    tl.store(NODE_OF + row + n, node_of, mask=in_n)
    tl.debug_barrier()

    out = b * T
    parent_node = tl.load(NODE_OF + row + par_at, mask=kept & has_par, other=-1)
    parent_node = tl.where(cand_par < 0, 0, parent_node).to(tl.int64)
    depth = tl.where(n < K, 1, 2 + (n - K) // (K * K)).to(tl.int64)
    prefix = tl.load(PREFIX + b * stride_prefix).to(tl.int64)
    at = out + node_of
    tl.store(TREE_TOKENS + at, tl.load(TOKENS + row + n, mask=kept, other=0), mask=kept)
    tl.store(PARENTS + at, parent_node, mask=kept)
    tl.store(DEPTHS + at, depth, mask=kept)
    tl.store(POSITIONS + at, prefix + depth, mask=kept)
    tl.store(TREE_TOKENS + out, tl.load(ROOT + b * stride_root).to(tl.int64))
    tl.store(PARENTS + out, -1)
    tl.store(DEPTHS + out, 0)
    tl.store(POSITIONS + out, prefix)
    tl.debug_barrier()

    # ---- per node: ancestors (D+1 steps up reach the root from any depth) and children
    t = tl.arange(0, BLOCK_T)
    in_t = t < T
    par_t = tl.load(PARENTS + out + t, mask=in_t, other=-1)
    depth_t = tl.load(DEPTHS + out + t, mask=in_t, other=0)
    col = tl.arange(0, BLOCK_D)
    node = tl.where(in_t, t, -1).to(tl.int64)
    anc = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.int1)
    path = tl.full((BLOCK_T, BLOCK_D), -1, tl.int64)
    for step in tl.static_range(D + 1):
        up = node >= 0
        anc = anc | ((t[None, :] == node[:, None]) & up[:, None])
        # node is the step-th ancestor of t, at depth depth_t - step
        path = tl.where((col[None, :] == (depth_t - step)[:, None]) & up[:, None], node[:, None], path)
        node = tl.load(PARENTS + out + node, mask=up, other=-1)
    cells = in_t[:, None] & in_t[None, :]
    tl.store(TREE_MASK + b * T * T + t[:, None] * T + t[None, :], anc.to(tl.uint8), mask=cells)
    tl.store(
        PATHS + out * (D + 1) + t[:, None] * (D + 1) + col[None, :], path, mask=in_t[:, None] & (col < D + 1)[None, :]
    )

    # sibling rank = earlier nodes under the same parent, so children keep node order (best first)
    earlier = (par_t[None, :] == par_t[:, None]) & (t[None, :] < t[:, None]) & in_t[None, :]
    sib = tl.minimum(tl.sum(earlier.to(tl.int32), axis=1), K - 1)  # [BLOCK_T] by node
    under = (par_t[None, :] == t[:, None]) & in_t[None, :]  # [parent, node]
    num = tl.zeros((BLOCK_T,), dtype=tl.int64)
    for r in tl.static_range(K):
        child = tl.max(tl.where(under & (sib[None, :] == r), t[None, :], -1), axis=1).to(tl.int64)
        tl.store(CHILDREN + out * K + t * K + r, child, mask=in_t)
        num += (child >= 0).to(tl.int64)
    tl.store(NUM_CHILDREN + out + t, num, mask=in_t)


def build_tree_triton(cands: Candidates, root_tokens: Tensor, prefix_lens: Tensor, verify_tokens: int) -> DraftTree:
    """`ir.tree.build_tree` in one launch, one program per sequence; the same DraftTree, field for field.

    cands: [B, N] tokens (int64), scores (float), parents (int64); root_tokens, prefix_lens: [B] int.
    No host sync; every shape is fixed by (B, D, topk, verify_tokens)."""
    batch, n = cands.tokens.shape
    d, k, dev = cands.depth, cands.topk, cands.tokens.device
    T = verify_tokens
    assert isinstance(T, int) and 2 <= T <= n + 1, f"verify_tokens must be an int in [2, {n + 1}], got {T!r}"
    assert root_tokens.shape == (batch,) and prefix_lens.shape == (batch,), (
        f"root_tokens / prefix_lens must be [{batch}], got {tuple(root_tokens.shape)} / {tuple(prefix_lens.shape)}"
    )
    assert cands.tokens.dtype == cands.parents.dtype == torch.int64, (
        f"candidate tokens / parents must be int64, got {cands.tokens.dtype} / {cands.parents.dtype}"
    )
    assert cands.scores.is_floating_point(), f"candidate scores must be floating point, got {cands.scores.dtype}"
    assert not root_tokens.is_floating_point() and not prefix_lens.is_floating_point(), (
        f"root_tokens / prefix_lens must be integer, got {root_tokens.dtype} / {prefix_lens.dtype}"
    )
    tokens, parents = cands.tokens.contiguous(), cands.parents.contiguous()
    scores = cands.scores.float().contiguous()  # build_tree ranks float32 scores
    eff = torch.empty(batch, n, dtype=torch.float32, device=dev)
    work = torch.empty(2, batch, n, dtype=torch.int32, device=dev)
    long = dict(dtype=torch.int64, device=dev)
    tree_tokens, tree_parents, depths, positions, num_children = (torch.empty(batch, T, **long) for _ in range(5))
    tree_mask = torch.empty(batch, T, T, dtype=torch.bool, device=dev)
    paths = torch.empty(batch, T, d + 1, **long)
    children = torch.empty(batch, T, k, **long)
    block_n = max(16, triton.next_power_of_2(n))
    _build_tree_kernel[(batch,)](
        tokens, scores, parents, root_tokens, prefix_lens,
        eff, work[0], work[1],
        tree_tokens, tree_parents, depths, positions, tree_mask.view(torch.uint8), paths, children, num_children,
        n, T,
        root_tokens.stride(0), prefix_lens.stride(0),
        D=d, K=k, BLOCK_N=block_n, BLOCK_I=max(1, min(block_n, 4096 // block_n)),
        BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_D=triton.next_power_of_2(d + 1), num_warps=4,
    )  # fmt: skip
    return DraftTree(tree_tokens, tree_parents, depths, positions, tree_mask, paths, children, num_children)
