"""One draft level's bookkeeping (one Triton launch) against its torch reference (interpreter on CPU)."""

from __future__ import annotations

import importlib
import os

import torch

# See tests/test_kernel_attention.py: the interpreter must be on before the kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import tlt_rt.codegen.kernels.draft_level as _level
    import tlt_rt.codegen.kernels.topk_lse as _topk

    if isinstance(_level._draft_level_kernel, triton.runtime.JITFunction):  # imported earlier, compiled
        importlib.reload(_topk)  # first: the level kernel calls its helper
        importlib.reload(_level)

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tlt_rt.codegen.kernels.draft_level import (  # noqa: E402
    draft_level,
    draft_level_from_chunks,
    draft_level_reference,
)
from tlt_rt.codegen.kernels.topk_lse import topk_chunks, topk_logprobs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@settings(deadline=None, max_examples=12)
@given(
    b=st.integers(1, 4),
    k=st.integers(1, 5),
    levels=st.integers(1, 3),
    h=st.sampled_from([8, 40, 1100]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(b, k, levels, h, dtype, ties, seed):
    g = torch.Generator().manual_seed(seed)
    front = torch.randn(b, k, generator=g)
    lp = -torch.rand(b * k, k, generator=g) * 5
    if ties:  # equal scores must go to the lower index, as a stable sort does
        front = front.round()
        lp = lp.round()
    tok = torch.randint(0, 50_000, (b * k, k), generator=g)
    hidden = torch.randn(b * k, h, generator=g).to(dtype)
    mask = torch.rand(b, k, levels * k, generator=g) < 0.5
    args = [t.to(DEVICE) for t in (front, lp, tok, hidden, mask)]
    got = draft_level(*args, offset=7)
    want = draft_level_reference(*args, offset=7)
    for name, x, y in zip(("score", "flat", "tok", "best", "feats", "mask"), got, want, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(x, y), name


def _check_from_chunks(b, k, vocab, mapped, ties, seed, device, block_v=256):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(b * k, vocab, generator=g)
    if ties:  # equal logits within and across chunks: the lower id first, as the merge does
        logits = logits.round()
    front = -torch.rand(b, k, generator=g) * 3
    hidden = torch.randn(b * k, 24, generator=g)
    mask = torch.rand(b, k, 2 * k, generator=g) < 0.5
    id_map = torch.randperm(60_000, generator=g)[:vocab] if mapped else None
    logits, front, hidden, mask = (t.to(device) for t in (logits, front, hidden, mask))
    id_map = None if id_map is None else id_map.to(device)
    lp, tok = topk_logprobs(logits, k, block_v=block_v, id_map=id_map)
    want = draft_level(front, lp, tok, hidden, mask, offset=5)
    got = draft_level_from_chunks(front, topk_chunks(logits, k, block_v=block_v), id_map, hidden, mask, offset=5)
    names = ("score", "flat", "tok", "best", "feats", "mask", "children")
    for name, x, y in zip(names, got, (*want, tok), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(x, y), name


@settings(deadline=None, max_examples=6)
@given(
    b=st.integers(1, 3),
    k=st.integers(1, 4),
    vocab=st.sampled_from([300, 1100]),
    mapped=st.booleans(),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_level_from_chunks_is_the_merge_then_the_level(b, k, vocab, mapped, ties, seed):
    """The top-k merge inside the level's launch gives what the merge's own launch and then `draft_level`
    give: the same children (mapped to target ids or not), scores, frontier, features and masks."""
    _check_from_chunks(b, k, vocab, mapped, ties, seed, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("b, k", [(1, 2), (1, 4), (32, 4), (8, 8)])
def test_level_from_chunks_compiled(b, k):
    """The same, compiled on CUDA, at the engine's shapes (an 8,192-id head in 4,096-id chunks)."""
    for seed, ties in ((b * 10 + k, False), (b * 10 + k + 1, True)):
        _check_from_chunks(b, k, 8192, True, ties, seed, "cuda", block_v=4096)
