"""Top-k log-probabilities of logits rows (two Triton launches) against torch (interpreter on CPU)."""

from __future__ import annotations

import importlib
import os

import torch

# See tests/test_kernel_attention.py: the interpreter must be on before the kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import tlt_rt.codegen.kernels.topk_lse as _topk

    if isinstance(_topk._topk_chunk_kernel, triton.runtime.JITFunction):  # imported earlier, compiled
        importlib.reload(_topk)

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tlt_rt.codegen.kernels.topk_lse import topk_logprobs, topk_logprobs_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@settings(deadline=None, max_examples=12)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([7, 300, 1823]),
    k=st.integers(1, 6),
    block=st.sampled_from([256, 1024]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_torch(rows, vocab, k, block, dtype, masked, seed):
    k = min(k, vocab)
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(DEVICE, dtype)
    if masked:  # a reduced draft vocabulary scattered to the full one: -inf outside it
        keep = torch.rand(rows, vocab, generator=g).to(DEVICE) < 0.3
        keep[:, :k] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    lp, ids = topk_logprobs(logits, k, block_v=block)
    ref_lp, _ = topk_logprobs_reference(logits, k)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)  # the same k values, sorted
    # the ids point at those values; distinct; equal values in id order
    lse = torch.logsumexp(logits.float(), -1, keepdim=True)
    torch.testing.assert_close(logits.float().gather(1, ids) - lse, lp, atol=1e-5, rtol=1e-5)
    assert all(len(set(r)) == k for r in ids.tolist())
    tie = lp[:, 1:] == lp[:, :-1]
    assert bool((ids[:, 1:] > ids[:, :-1])[tie].all())


def test_bad_arguments_are_named():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(AssertionError, match="k must be in"):
        topk_logprobs(x, 0)
    with pytest.raises(AssertionError, match="unit stride"):
        topk_logprobs(x.t(), 2)
    with pytest.raises(AssertionError, match=r"\[R, V\]"):
        topk_logprobs(x[0], 2)


@settings(deadline=None, max_examples=6)
@given(rows=st.integers(1, 4), k=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_id_map_gives_the_mapped_ids_of_the_same_choice(rows, k, seed):
    """A reduced head's draft -> target map applied in the merge: the ids an unmapped call picks, mapped."""
    g = torch.Generator().manual_seed(seed)
    vocab = 300
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(DEVICE)
    logits[:, 5] = logits[:, 9]  # a tie: the lower draft id first, whatever the target ids
    id_map = torch.randperm(5000, generator=g)[:vocab].to(DEVICE)
    lp, ids = topk_logprobs(logits, k, block_v=256)
    mlp, mids = topk_logprobs(logits, k, block_v=256, id_map=id_map)
    assert torch.equal(mlp, lp)
    assert torch.equal(mids, id_map[ids])
    ref_lp, ref_ids = topk_logprobs_reference(logits, k, id_map=id_map)
    torch.testing.assert_close(mlp, ref_lp, atol=1e-5, rtol=1e-5)
    assert torch.equal(mids, ref_ids)
    with pytest.raises(AssertionError, match="id_map must be int64"):
        topk_logprobs(logits, k, id_map=id_map[:-1])
