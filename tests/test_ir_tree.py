"""The draft tree: drafter helpers and build_tree against a brute-force python reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_rt.ir import Candidates, DraftTree, build_tree, expand, level_bounds, select_frontier
from tlt_rt.ir.tree import TREE_FIELDS

# ---- brute-force references (python loops, one sequence at a time) ---------------------------------------


def ref_tree(tokens, scores, parents, depth_of, k, max_depth, root, prefix, T):
    """Grow the tree one node at a time: always add the best candidate whose parent is already in it
    (ties to the lower index), then number the kept candidates in flat order."""
    kept: set[int] = set()
    for _ in range(T - 1):
        avail = [c for c in range(len(tokens)) if c not in kept and (parents[c] < 0 or parents[c] in kept)]
        kept.add(min(avail, key=lambda c: (-scores[c], c)))
    order = sorted(kept)
    node = {c: i + 1 for i, c in enumerate(order)}
    par = [-1] + [0 if parents[c] < 0 else node[parents[c]] for c in order]
    depths = [0] + [depth_of[c] for c in order]
    ancestors = []
    for i in range(T):
        chain, j = [], i
        while j >= 0:
            chain.append(j)
            j = par[j]
        ancestors.append(chain[::-1])
    mask = [[j in ancestors[i] for j in range(T)] for i in range(T)]
    paths = [a + [-1] * (max_depth + 1 - len(a)) for a in ancestors]
    kids = [[j for j in range(T) if par[j] == i] for i in range(T)]
    return {
        "tree_tokens": [root] + [tokens[c] for c in order],
        "parents": par,
        "depths": depths,
        "positions": [prefix + d for d in depths],
        "tree_mask": mask,
        "paths": paths,
        "children": [c + [-1] * (k - len(c)) for c in kids],
        "num_children": [len(c) for c in kids],
    }


def candidate_depths(k, max_depth):
    return [level + 1 for level, (s, e) in enumerate(level_bounds(max_depth, k)) for _ in range(s, e)]


# ---- generators ---------------------------------------------------------------------------------------


@st.composite
def drafts(draw):
    """Run the drafter loop on random log-probs; coarse values make many exact score ties."""
    batch, depth, k = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    vocab = draw(st.integers(k, 12))
    ties = draw(st.booleans())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def logprobs(*shape):
        if ties:
            return -torch.randint(0, 3, shape, generator=gen).float()
        return torch.randn(shape, generator=gen).log_softmax(-1)

    cands = Candidates.start(logprobs(batch, vocab), k)
    for _ in range(depth - 1):
        cands = cands.grow(cands.frontier(), logprobs(batch, k, vocab))
    T = draw(st.integers(2, cands.tokens.shape[1] + 1))
    root = torch.randint(0, vocab, (batch,), generator=gen)
    prefix = torch.randint(0, 100, (batch,), generator=gen)
    return cands, root, prefix, T


def check_structure(tree: DraftTree, prefix, max_depth):
    """Properties any tree must have, whatever the scores."""
    B, T = tree.tree_tokens.shape
    par = tree.parents
    assert (par[:, 0] == -1).all()
    idx = torch.arange(T)
    assert ((par[:, 1:] >= 0) & (par[:, 1:] < idx[1:])).all()  # parents precede children
    assert torch.equal(tree.depths[:, 1:], tree.depths.gather(1, par[:, 1:]) + 1)
    assert torch.equal(tree.positions, prefix[:, None] + tree.depths)
    # mask == reflexive transitive closure of the parent relation
    closure = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            j = i
            while j >= 0:
                closure[b, i, j] = True
                j = int(par[b, j])
    assert torch.equal(tree.tree_mask, closure)
    assert (tree.depths <= max_depth).all()


# ---- drafter helpers ----------------------------------------------------------------------------------


def test_select_frontier_is_stable():
    scores = torch.tensor([[-1.0, -0.5, -1.0, -0.5, -3.0]])
    assert select_frontier(scores, 3).tolist() == [[1, 3, 0]]
    with pytest.raises(ValueError, match="k=6 exceeds"):
        select_frontier(scores, 6)


def test_expand():
    parent = torch.tensor([[-1.0, -2.0]])
    lp = torch.tensor([[[-0.1, -3.0, -0.5], [-2.0, -0.2, -0.3]]])
    tokens, scores, slot = expand(parent, lp, 2)
    assert tokens.tolist() == [[0, 2, 1, 2]]
    assert torch.allclose(scores, torch.tensor([[-1.1, -1.5, -2.2, -2.3]]))
    assert slot.tolist() == [[0, 0, 1, 1]]


@given(drafts())
def test_candidates_follow_eagle2(draft):
    """Level d's parents are the topk best of level d-1, each with topk children, best first."""
    cands, *_ = draft
    k = cands.topk
    bounds = level_bounds(cands.depth, k)
    assert (cands.parents[:, : bounds[0][1]] == -1).all()
    for (ps, pe), (s, e) in zip(bounds, bounds[1:], strict=False):
        for b in range(cands.tokens.shape[0]):
            prev = cands.scores[b, ps:pe].tolist()
            expected = sorted(range(pe - ps), key=lambda i: (-prev[i], i))[:k]
            par = cands.parents[b, s:e].view(k, k)
            assert par[:, 0].tolist() == [ps + i for i in expected]
            assert (par == par[:, :1]).all()
            own = cands.scores[b, s:e] - cands.scores[b, cands.parents[b, s:e]]
            assert (own <= 0).all() and (own.view(k, k).diff(dim=1) <= 0).all()


@given(drafts())
def test_ancestry(draft):
    cands, *_ = draft
    front = cands.frontier()
    got = cands.ancestry(front)
    assert got.shape == (*front.shape, cands.depth)
    for b in range(front.shape[0]):
        for p in range(front.shape[1]):
            chain, c = [], int(front[b, p])
            while c >= 0:
                chain.append(c)
                c = int(cands.parents[b, c])
            chain = chain[::-1]
            assert got[b, p].tolist() == chain + [-1] * (cands.depth - len(chain))


# ---- build_tree ---------------------------------------------------------------------------------------


@given(drafts())
def test_build_tree_matches_reference(draft):
    cands, root, prefix, T = draft
    tree = build_tree(cands, root, prefix, T)
    depth_of = candidate_depths(cands.topk, cands.depth)
    for b in range(root.shape[0]):
        ref = ref_tree(
            cands.tokens[b].tolist(),
            cands.scores[b].tolist(),
            cands.parents[b].tolist(),
            depth_of,
            cands.topk,
            cands.depth,
            int(root[b]),
            int(prefix[b]),
            T,
        )
        for name, want in ref.items():
            assert getattr(tree, name)[b].tolist() == want, name
    check_structure(tree, prefix, cands.depth)


@given(drafts(), st.integers(0, 2**31 - 1))
def test_unsorted_scores_still_give_a_tree(draft, seed):
    """Scores that rise along a path (e.g. rounded by the drafter) must not orphan a node."""
    cands, root, prefix, T = draft
    gen = torch.Generator().manual_seed(seed)
    noisy = Candidates(cands.tokens, torch.randn(cands.scores.shape, generator=gen), cands.parents, cands.topk)
    check_structure(build_tree(noisy, root, prefix, T), prefix, cands.depth)


def test_full_tree_keeps_every_candidate():
    cands = Candidates.start(torch.randn(2, 10).log_softmax(-1), 3)
    cands = cands.grow(cands.frontier(), torch.randn(2, 3, 10).log_softmax(-1))
    tree = build_tree(cands, torch.tensor([1, 2]), torch.tensor([0, 5]), 13)
    assert torch.equal(tree.tree_tokens[:, 1:], cands.tokens)
    assert tree.num_children[:, 0].tolist() == [3, 3] and tree.num_children.sum(1).tolist() == [12, 12]


def test_build_tree_errors():
    cands = Candidates.start(torch.randn(2, 10), 2)
    zeros = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"verify_tokens must be in \[2, 3\]"):
        build_tree(cands, zeros, zeros, 4)
    with pytest.raises(ValueError, match="verify_tokens"):
        build_tree(cands, zeros, zeros, 1)
    with pytest.raises(ValueError, match=r"prefix_lens must have shape \[2\]"):
        build_tree(cands, zeros, torch.zeros(3, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="N=5 is not topk"):
        Candidates(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5), torch.zeros(1, 5, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="share one"):
        Candidates(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 3), torch.zeros(1, 2, dtype=torch.long), 2)


# ---- no host sync -------------------------------------------------------------------------------------


def _draft_and_build(root_lp, step_lps, root, prefix, k: int, T: int):
    cands = Candidates.start(root_lp, k)
    for d in range(step_lps.shape[1]):
        cands = cands.grow(cands.frontier(), step_lps[:, d])
    tree = build_tree(cands, root, prefix, T)
    return (*(getattr(tree, f) for f in tree.__dataclass_fields__), cands.ancestry(cands.frontier()))


def _inputs(device="cpu", B=3, D=4, K=3, V=17):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, V, generator=gen).log_softmax(-1).to(device),
        torch.randn(B, D - 1, K, V, generator=gen).log_softmax(-1).to(device),
        torch.randint(0, V, (B,), generator=gen).to(device),
        torch.randint(0, 50, (B,), generator=gen).to(device),
    )


def test_runs_on_meta_tensors():
    """Meta tensors have no values: any read of one on the host (.item(), .tolist(), branching on a
    tensor, data-dependent shapes such as .nonzero()) fails here."""
    out = _draft_and_build(*_inputs("meta"), k=3, T=20)
    assert all(t.device.type == "meta" for t in out)
    assert out[4].shape == (3, 20, 20) and out[5].shape == (3, 20, 5) and out[6].shape == (3, 20, 3)


def test_traces_as_one_graph():
    """torch.compile(fullgraph=True) refuses graph breaks, which every host sync causes."""
    compiled = torch.compile(_draft_and_build, backend="eager", fullgraph=True)
    args = _inputs()
    for got, want in zip(compiled(*args, k=3, T=20), _draft_and_build(*args, k=3, T=20), strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_no_sync_and_graph_capture_on_cuda():
    args = _inputs("cuda")
    want = _draft_and_build(*args, k=3, T=20)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _draft_and_build(*args, k=3, T=20)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)

    # capture once, then replay on new inputs copied into the same buffers
    static = [a.clone() for a in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _draft_and_build(*static, k=3, T=20)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _draft_and_build(*static, k=3, T=20)
    fresh = [a.roll(1, 0) for a in args]
    for buf, new in zip(static, fresh, strict=True):
        buf.copy_(new)
    graph.replay()
    for g, w in zip(outs, _draft_and_build(*fresh, k=3, T=20), strict=True):
        assert torch.equal(g, w)


# ---- the fused rerank of the captured draft step ------------------------------------------------------


def _fields(tree: DraftTree) -> list[torch.Tensor]:
    return [getattr(tree, name) for name in TREE_FIELDS]


@pytest.mark.gpu
@settings(deadline=None, max_examples=12)
@given(drafts())
def test_fused_rerank_matches_on_cuda(draft):
    """The captured step's rerank (one Triton launch) builds build_tree's tree, field for field."""
    from tlt_rt.codegen.table import kernel

    cands, root, prefix, T = draft
    cands = Candidates(cands.tokens.cuda(), cands.scores.cuda(), cands.parents.cuda(), cands.topk)
    want = build_tree(cands, root.cuda(), prefix.cuda(), T)
    got = kernel("build_tree", "cuda")(cands, root.cuda(), prefix.cuda(), T)
    for g, w in zip(_fields(got), _fields(want), strict=True):
        assert torch.equal(g, w)
