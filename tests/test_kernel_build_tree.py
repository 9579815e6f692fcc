"""The rerank into the verify tree (one Triton launch) against `ir.tree.build_tree` (interpreter on CPU)."""

from __future__ import annotations

import dataclasses
import importlib
import os

import torch

# See tests/test_kernel_attention.py: the interpreter must be on before the kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import tlt_rt.codegen.kernels.build_tree as _tree

    if isinstance(_tree._build_tree_kernel, triton.runtime.JITFunction):  # imported earlier, compiled
        importlib.reload(_tree)

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tlt_rt.codegen.kernels.build_tree import build_tree_reference, build_tree_triton  # noqa: E402
from tlt_rt.ir import Candidates, Strategy  # noqa: E402
from tlt_rt.ir.tree import TREE_FIELDS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def draft(batch: int, depth: int, k: int, vocab: int, gen: torch.Generator, scores: str) -> Candidates:
    """Candidates grown as the drafter grows them, on random log-probs. scores: "drafted" (distinct),
    "ties" (coarse log-probs: many equal sums), "-inf" (some log-probs -inf, ties among them), or "free"
    (then every score redrawn with ties and -inf, so a child can outscore its parent and the clamp matters)."""

    def logprobs(*shape):
        if scores == "drafted":
            return torch.randn(shape, generator=gen).log_softmax(-1)
        lp = -torch.randint(0, 3, shape, generator=gen).float()
        if scores != "ties":
            lp[torch.rand(shape, generator=gen) < 0.3] = -float("inf")
        return lp

    cands = Candidates.start(logprobs(batch, vocab), k)
    for _ in range(depth - 1):
        cands = cands.grow(cands.frontier(), logprobs(batch, k, vocab))
    if scores == "free":
        free = -torch.randint(0, 4, cands.scores.shape, generator=gen).float()
        free[torch.rand(free.shape, generator=gen) < 0.2] = -float("inf")
        cands = dataclasses.replace(cands, scores=free)
    return Candidates(*(t.to(DEVICE) for t in (cands.tokens, cands.scores, cands.parents)), k)


def check(cands: Candidates, root: torch.Tensor, prefix: torch.Tensor, T: int) -> None:
    got = build_tree_triton(cands, root, prefix, T)
    want = build_tree_reference(cands, root, prefix, T)
    for name in TREE_FIELDS:
        x, y = getattr(got, name), getattr(want, name)
        assert x.shape == y.shape and x.dtype == y.dtype, (name, x.shape, x.dtype, y.shape, y.dtype)
        assert torch.equal(x, y), name


@settings(deadline=None, max_examples=20)
@given(
    batch=st.integers(1, 3),
    depth=st.integers(1, 6),
    k=st.integers(1, 4),
    scores=st.sampled_from(["drafted", "ties", "-inf", "free"]),
    int32=st.booleans(),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_build_tree(batch, depth, k, scores, int32, data, seed):
    gen = torch.Generator().manual_seed(seed)
    cands = draft(batch, depth, k, k + 3, gen, scores)
    T = data.draw(st.integers(2, cands.tokens.shape[1] + 1), label="verify_tokens")
    ints = torch.int32 if int32 else torch.int64  # build_tree widens both to int64
    # the drafter passes the last column of its token block: a strided [B] view
    root = torch.randint(0, 50_000, (batch, 3), generator=gen).to(DEVICE, ints)[:, -1]
    prefix = torch.randint(0, 4096, (batch,), generator=gen).to(DEVICE, ints)
    check(cands, root, prefix, T)


@pytest.mark.parametrize("strategy", ["8_4_32", "6_2_12"])
@pytest.mark.parametrize("scores", ["drafted", "ties", "-inf", "free"])
def test_real_strategies(strategy, scores):
    s = Strategy.parse(strategy)
    gen = torch.Generator().manual_seed(len(strategy) + len(scores))
    cands = draft(2, s.depth, s.topk, 64, gen, scores)
    root = torch.tensor([11, 49_000], device=DEVICE)
    prefix = torch.tensor([0, 517], device=DEVICE)
    check(cands, root, prefix, s.verify_tokens)


def test_rejects_out_of_range_verify_tokens():
    cands = draft(1, 2, 2, 5, torch.Generator().manual_seed(0), "drafted")
    zeros = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(AssertionError, match="verify_tokens"):
        build_tree_triton(cands, zeros, zeros, 8)
