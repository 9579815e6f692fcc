"""The dynamic (EAGLE-2 style) draft tree in plain batched torch, with no host sync.

Drafter side: `Candidates` collects what the drafter proposes, level by level:

    cands = Candidates.start(root_logprobs, k)           # the root's k best children
    for _ in range(depth - 1):
        front = cands.frontier()                         # [B, k] the k best nodes of the last level
        logprobs = drafter(cands.tokens.gather(1, front), ...)   # [B, k, V]
        cands = cands.grow(front, logprobs)              # k children each: k*k new candidates
    tree = build_tree(cands, root_tokens, prefix_lens, verify_tokens)

Target side: `build_tree` reranks all candidates by cumulative log-prob and keeps the best
`verify_tokens - 1` under the root, giving the tensors that verification, acceptance and KV commit read.
Every shape here depends only on python ints (B, depth, topk, verify_tokens), never on tensor values,
so all of it can be captured in one CUDA graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


def level_bounds(depth: int, topk: int) -> list[tuple[int, int]]:
    """[start, end) of each draft level in the flat candidate order: K at level 0, K*K at each later."""
    bounds, start = [], 0
    for level in range(depth):
        size = topk if level == 0 else topk * topk
        bounds.append((start, start + size))
        start += size
    return bounds


def select_frontier(cum_scores: Tensor, k: int) -> Tensor:
    """Indices [B, k] of the k best nodes by cumulative score, best first; ties go to the lower index.

    cum_scores: [B, M] with M >= k.
    """
    if cum_scores.shape[-1] < k:
        raise ValueError(f"select_frontier: k={k} exceeds the {cum_scores.shape[-1]} nodes to choose from")
    # stable sort, not topk: equal scores keep index order, the same rule build_tree uses
    return torch.sort(cum_scores, dim=-1, descending=True, stable=True).indices[:, :k]


def expand(parent_scores: Tensor, logprobs: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Give each of P parents its k most likely children.

    parent_scores: [B, P] cumulative log-probs of the parents; logprobs: [B, P, V] the drafter's
    log-probs at each parent. Returns tokens [B, P*k], cumulative scores [B, P*k] (parent + child) and
    parent_slot [B, P*k] (which of the P parents), parent-major with each parent's children best first.
    """
    batch, num_parents = parent_scores.shape
    child_lp, tokens = torch.topk(logprobs, k, dim=-1, sorted=True)  # [B, P, k]
    scores = parent_scores.unsqueeze(-1) + child_lp.to(parent_scores.dtype)
    slot = torch.arange(num_parents, device=tokens.device).repeat_interleave(k).expand(batch, -1)
    return tokens.reshape(batch, -1), scores.reshape(batch, -1), slot


@dataclass(frozen=True)
class Candidates:
    """Every draft candidate of one step, flattened level by level (see `level_bounds`).

    Level 0 is the root's topk children; level d >= 1 is topk children of each of the topk frontier
    nodes chosen from level d-1, frontier-major, each parent's children in descending log-prob order.
    Tree depth of a level-d candidate is d + 1 (the root is depth 0).
    """

    tokens: Tensor
    """[B, N] int64 candidate tokens, N = topk + (levels-1)*topk^2."""
    scores: Tensor
    """[B, N] float cumulative log-prob from the root (a child's is its parent's plus its own)."""
    parents: Tensor
    """[B, N] int64 flat index of each candidate's parent candidate; -1 for the root's children."""
    topk: int
    """Children per expanded node and frontier nodes per level."""

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or not (self.tokens.shape == self.scores.shape == self.parents.shape):
            raise ValueError(
                "Candidates: tokens, scores and parents must share one [B, N] shape, got "
                f"{tuple(self.tokens.shape)}, {tuple(self.scores.shape)}, {tuple(self.parents.shape)}"
            )
        n, k = self.tokens.shape[1], self.topk
        if k < 1 or n < k or (n - k) % (k * k) != 0:
            raise ValueError(f"Candidates: N={n} is not topk + (levels-1)*topk^2 for topk={k}")

    @property
    def depth(self) -> int:
        """Draft levels so far = the deepest tree depth a candidate can have."""
        return 1 + (self.tokens.shape[1] - self.topk) // (self.topk * self.topk)

    @classmethod
    def start(cls, root_logprobs: Tensor, k: int) -> Candidates:
        """Level 0 from the drafter's log-probs at the root, root_logprobs: [B, V]."""
        zeros = root_logprobs.new_zeros(root_logprobs.shape[0], 1, dtype=torch.float32)
        tokens, scores, _ = expand(zeros, root_logprobs.unsqueeze(1), k)
        return cls(tokens, scores, torch.full_like(tokens, -1), k)

    def frontier(self) -> Tensor:
        """Flat indices [B, topk] of the topk best candidates of the last level, best first."""
        start, _ = level_bounds(self.depth, self.topk)[-1]
        return select_frontier(self.scores[:, start:], self.topk) + start

    def grow(self, frontier: Tensor, logprobs: Tensor) -> Candidates:
        """Add a level: topk children of each frontier node; frontier: [B, topk], logprobs: [B, topk, V]."""
        tokens, scores, slot = expand(self.scores.gather(1, frontier), logprobs, self.topk)
        return Candidates(
            torch.cat([self.tokens, tokens], 1),
            torch.cat([self.scores, scores], 1),
            torch.cat([self.parents, frontier.gather(1, slot)], 1),
            self.topk,
        )

    def ancestry(self, index: Tensor) -> Tensor:
        """Flat indices [B, P, depth] of the path root-child .. index[b, p], -1 padded on the right.

        index: [B, P]. The drafter's tree attention lets node p see exactly these candidates.
        """
        levels = self.depth
        out = torch.full((*index.shape, levels + 1), -1, dtype=torch.long, device=index.device)
        node = index
        # walk up `levels` times; the node's level is its column, so the chain lands left-aligned
        level_of = self._levels()
        for _ in range(levels):
            valid = node >= 0
            col = torch.where(valid, level_of[node.clamp(min=0)], levels)
            out.scatter_(2, col.unsqueeze(-1), node.unsqueeze(-1))
            node = torch.where(valid, self.parents.gather(1, node.clamp(min=0)), -1)
        return out[..., :levels]

    def _levels(self) -> Tensor:
        """Level of each flat candidate index, [N] int64 (tree depth minus one).

        Arithmetic on the device rather than a host-built table: no host-to-device copy, so it can be
        captured in a CUDA graph.
        """
        k = self.topk
        idx = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return torch.where(idx < k, 0, 1 + (idx - k).clamp(min=0) // (k * k))


@dataclass(frozen=True)
class DraftTree:
    """The draft tree sent to verification. T = verify_tokens, D = draft depth, K = topk.

    Node 0 is the root (the last emitted token, not yet in the KV cache); nodes are ordered so that a
    parent always precedes its children, level by level, and siblings come best first.
    """

    tree_tokens: Tensor
    """[B, T] int64 token of each node; tree_tokens[:, 0] is the root."""
    parents: Tensor
    """[B, T] int64 parent node of each node; parents[:, 0] = -1 and parents[:, i] < i."""
    depths: Tensor
    """[B, T] int64 depth of each node, root 0, at most D."""
    positions: Tensor
    """[B, T] int64 sequence position of each node = prefix_lens + depths."""
    tree_mask: Tensor
    """[B, T, T] bool; tree_mask[b, i, j] iff node j is node i or one of its ancestors."""
    paths: Tensor
    """[B, T, D+1] int64 nodes on the path root .. i (paths[b, i, d] is i's ancestor at depth d),
    -1 after column depths[b, i]; a greedy walk reads an accepted path straight off row i."""
    children: Tensor
    """[B, T, K] int64 children of each node, best first, -1 padded (a node has at most K)."""
    num_children: Tensor
    """[B, T] int64 number of children of each node; 0 marks a leaf."""


TREE_FIELDS = [f.name for f in dataclasses.fields(DraftTree)]  # a DraftTree's tensors, in order


def root_only_tree(roots: Tensor, prefix_lens: Tensor) -> DraftTree:
    """The tree of a plain decode step: each sequence's root alone (T = 1, no children), at position
    prefix_lens. roots [B] and prefix_lens [B] int64, on the device the step runs on."""
    b, dev = roots.shape[0], roots.device
    return DraftTree(
        tree_tokens=roots[:, None],
        parents=torch.full((b, 1), -1, device=dev),
        depths=torch.zeros(b, 1, dtype=torch.long, device=dev),
        positions=prefix_lens.long()[:, None],
        tree_mask=torch.ones(b, 1, 1, dtype=torch.bool, device=dev),
        paths=torch.zeros(b, 1, 1, dtype=torch.long, device=dev),
        children=torch.full((b, 1, 1), -1, device=dev),
        num_children=torch.zeros(b, 1, dtype=torch.long, device=dev),
    )


def build_tree(cands: Candidates, root_tokens: Tensor, prefix_lens: Tensor, verify_tokens: int) -> DraftTree:
    """Rerank all draft candidates and keep the best `verify_tokens - 1` under the root.

    cands: every candidate of the step (N = topk + (D-1)*topk^2 per sequence);
    root_tokens: [B] int64 the last emitted token of each sequence; prefix_lens: [B] int64 tokens of each
    sequence already in the KV cache (the root sits at position prefix_lens).

    Selection is a global top-(T-1) by cumulative score. A child's score is clamped to at most its
    parent's (the drafter's sums already are, unless rounded), and ties go to the lower flat index,
    which a parent always has, so the kept set is closed under ancestors. Kept nodes are numbered in
    flat candidate order: level by level, so parents precede children and siblings stay best first.
    No host sync: every shape is fixed by (B, D, topk, verify_tokens).
    """
    batch, num_cands = cands.tokens.shape
    depth, k, device = cands.depth, cands.topk, cands.tokens.device
    if isinstance(verify_tokens, bool) or not isinstance(verify_tokens, int):
        raise ValueError(f"build_tree: verify_tokens must be an int, got {verify_tokens!r}")
    if not 2 <= verify_tokens <= num_cands + 1:
        raise ValueError(
            f"build_tree: verify_tokens must be in [2, {num_cands + 1}] for depth={depth}, topk={k}, "
            f"got {verify_tokens}"
        )
    for name, t in (("root_tokens", root_tokens), ("prefix_lens", prefix_lens)):
        if tuple(t.shape) != (batch,):
            raise ValueError(f"build_tree: {name} must have shape [{batch}], got {tuple(t.shape)}")
    T, M = verify_tokens, verify_tokens - 1

    # make scores monotone along every path: eff[child] = min(score[child], eff[parent])
    eff = cands.scores.float().clone()
    for start, end in level_bounds(depth, k)[1:]:
        parent_eff = eff.gather(1, cands.parents[:, start:end].clamp(min=0))
        eff[:, start:end] = torch.minimum(eff[:, start:end], parent_eff)

    best = torch.sort(eff, dim=1, descending=True, stable=True).indices[:, :M]
    sel = torch.sort(best, dim=1).values  # [B, M] flat candidate index of nodes 1..T-1

    # node number of each kept candidate, -1 for dropped ones: [B, N]
    node_ids = torch.arange(1, T, device=device).expand(batch, M)
    node_of = torch.full((batch, num_cands), -1, dtype=torch.long, device=device).scatter(1, sel, node_ids)
    parent_cand = cands.parents.gather(1, sel)
    parent_node = torch.where(parent_cand < 0, 0, node_of.gather(1, parent_cand.clamp(min=0)))

    minus_one = torch.full((batch, 1), -1, dtype=torch.long, device=device)
    parents = torch.cat([minus_one, parent_node], 1)
    tree_tokens = torch.cat([root_tokens.long().unsqueeze(1), cands.tokens.gather(1, sel)], 1)
    cand_depth = cands._levels() + 1
    depths = torch.cat([torch.zeros_like(minus_one), cand_depth[sel]], 1)
    positions = prefix_lens.long().unsqueeze(1) + depths

    paths, tree_mask = _ancestors(parents, depths, depth)
    children = _children(parents, k)
    return DraftTree(
        tree_tokens=tree_tokens,
        parents=parents,
        depths=depths,
        positions=positions,
        tree_mask=tree_mask,
        paths=paths,
        children=children,
        num_children=(children >= 0).sum(-1),
    )


def _ancestors(parents: Tensor, depths: Tensor, depth: int) -> tuple[Tensor, Tensor]:
    """paths [B, T, D+1] and tree_mask [B, T, T] by walking every node up D times at once."""
    batch, T = parents.shape
    device = parents.device
    # one spare column each, where the walk parks finished chains
    paths = torch.full((batch, T, depth + 2), -1, dtype=torch.long, device=device)
    mask = torch.zeros((batch, T, T + 1), dtype=torch.bool, device=device)
    node = torch.arange(T, device=device).expand(batch, T)
    for step in range(depth + 1):
        valid = node >= 0
        # node is the step-th ancestor of i, so it sits at depth depths[i] - step
        paths.scatter_(2, torch.where(valid, depths - step, depth + 1).unsqueeze(-1), node.unsqueeze(-1))
        mask.scatter_(2, torch.where(valid, node, T).unsqueeze(-1), True)
        node = torch.where(valid, parents.gather(1, node.clamp(min=0)), -1)
    return paths[..., : depth + 1], mask[..., :T]


def _children(parents: Tensor, k: int) -> Tensor:
    """children [B, T, K]: sibling rank = earlier nodes with the same parent, so node order is kept."""
    batch, T = parents.shape
    device = parents.device
    earlier = torch.ones(T, T, dtype=torch.bool, device=device).tril(-1)  # [T, T] j < i
    rank = ((parents.unsqueeze(2) == parents.unsqueeze(1)) & earlier).sum(-1)  # [B, T]
    # the root has no parent: park it in a spare row T
    row = torch.where(parents >= 0, parents, T)
    flat = torch.full((batch, (T + 1) * k), -1, dtype=torch.long, device=device)
    idx = torch.arange(T, device=device).expand(batch, T)
    flat.scatter_(1, row * k + rank.clamp(max=k - 1), idx)
    return flat.view(batch, T + 1, k)[:, :T]
