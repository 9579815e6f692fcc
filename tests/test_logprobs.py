"""chunked_token_logprobs against the dense path (full logits + token_logprobs), values and gradients.

float32 is held to a tight tolerance; bfloat16 is judged against a float32 run of the same inputs: its
error may be at most twice the dense bfloat16 path's. Shapes and filters are drawn by hypothesis
(N not a multiple of the chunk, chunks larger than N, odd V).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from tlt_rt.train.rl.grpo import token_logprobs
from tlt_rt.train.rl.logprobs import chunked_token_logprobs, kept_ids

FILTERS = [(-1, 1.0), (20, 1.0), (-1, 0.9), (50, 0.8)]  # (top_k, top_p); the first is no filter
TEMPERATURES = [1.0, 0.7, 0.0]


def _dense(hidden, weight, targets, temperature, keep):
    return token_logprobs(hidden @ weight.T, targets, temperature, keep)


def _grads(out, hidden, weight, g):
    return torch.autograd.grad(out, (hidden, weight), g)


@st.composite
def cases(draw):
    n = draw(st.integers(1, 70))
    return dict(
        n=n,
        h=draw(st.integers(1, 24)),
        v=draw(st.sampled_from([1031, 257, 97, 2])),
        chunk=draw(st.integers(1, 96)),
        temperature=draw(st.sampled_from(TEMPERATURES)),
        filt=draw(st.sampled_from(FILTERS)),
        seed=draw(st.integers(0, 2**16)),
    )


def _inputs(c: dict, dtype: torch.dtype, device: str = "cpu"):
    """hidden [N, H], weight [V, H] (leaves of `dtype`), targets drawn from the kept set, upstream grad
    [N] with zero rows, and the kept set of the `dtype` logits."""
    gen = torch.Generator().manual_seed(c["seed"])
    hidden = torch.randn(c["n"], c["h"], generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(c["v"], c["h"], generator=gen) * 2 / c["h"] ** 0.5).to(device, dtype).requires_grad_()
    top_k, top_p = c["filt"]
    keep = kept_ids(hidden @ weight.T, c["temperature"], top_k, top_p)
    if keep is None:
        targets = torch.randint(0, c["v"], (c["n"],), generator=gen)
    else:  # the sampler only emits kept tokens
        targets = torch.multinomial(keep.float().cpu(), 1, generator=gen).squeeze(1)
    g = torch.randn(c["n"], generator=gen)
    g[torch.rand(c["n"], generator=gen) < 0.3] = 0.0  # padding / prompt rows
    return hidden, weight, targets.to(device), g.to(device), keep


def _chunked(hidden, weight, targets, c):
    top_k, top_p = c["filt"]
    return chunked_token_logprobs(hidden, weight, targets, c["temperature"], top_k, top_p, chunk_tokens=c["chunk"])


@given(cases())
def test_float32_matches_dense(c):
    hidden, weight, targets, g, keep = _inputs(c, torch.float32)
    ref = _dense(hidden, weight, targets, c["temperature"], keep)
    out = _chunked(hidden, weight, targets, c)
    assert out.dtype == torch.float32 and out.shape == (c["n"],)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(_grads(out, hidden, weight, g), _grads(ref, hidden, weight, g), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@given(cases())
def test_bfloat16_within_twice_dense_error(c):
    hidden, weight, targets, g, keep = _inputs(c, torch.bfloat16)
    # the float32 run of the same (bf16-representable) inputs and the same kept set
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref32 = _dense(h32, w32, targets, c["temperature"], keep)
    ref16 = _dense(hidden, weight, targets, c["temperature"], keep)
    out = _chunked(hidden, weight, targets, c)
    assert out.dtype == torch.float32
    truth = [ref32, *_grads(ref32, h32, w32, g)]
    dense = [ref16, *_grads(ref16, hidden, weight, g)]
    got = [out, *_grads(out, hidden, weight, g)]
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for name, t, d, x in zip(("logprobs", "grad_hidden", "grad_weight"), truth, dense, got, strict=True):
        scale = t.abs().max().item()
        assert _max_err(x, t) <= 2 * _max_err(d, t) + 1e-2 * scale + 1e-6, name


@pytest.mark.gpu
@pytest.mark.parametrize("filt", FILTERS)
def test_cuda_bfloat16_within_twice_dense_error(filt):
    """The CUDA path: bf16 cuBLAS, the head's gradient summed in place into float32."""
    c = dict(n=700, h=256, v=5003, chunk=128, temperature=0.7, filt=filt, seed=1)
    hidden, weight, targets, g, keep = _inputs(c, torch.bfloat16, "cuda")
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref32 = _dense(h32, w32, targets, c["temperature"], keep)
    ref16 = _dense(hidden, weight, targets, c["temperature"], keep)
    out = _chunked(hidden, weight, targets, c)
    truth = [ref32, *_grads(ref32, h32, w32, g)]
    dense = [ref16, *_grads(ref16, hidden, weight, g)]
    got = [out, *_grads(out, hidden, weight, g)]
    for name, t, d, x in zip(("logprobs", "grad_hidden", "grad_weight"), truth, dense, got, strict=True):
        assert _max_err(x, t) <= 2 * _max_err(d, t) + 1e-6, name


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("filt", FILTERS)
def test_tied_weight_gradients_accumulate(temperature, filt):
    """The head is also the embedding: its gradient is the sum of both uses, as in the dense path."""
    n, h, v = 53, 12, 1031
    top_k, top_p = filt
    emb = (torch.randn(v, h) / h**0.5).requires_grad_()
    mix = torch.randn(h, h).requires_grad_()
    ids = torch.randint(0, v, (n,))
    g = torch.randn(n)
    g[::4] = 0.0

    def hidden():  # a stand-in for the decoder: embedding, a mixing matrix, an RMS norm
        x = F.embedding(ids, emb) @ mix
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    hid = hidden()
    keep = kept_ids(hid @ emb.T, temperature, top_k, top_p)
    targets = torch.randint(0, v, (n,)) if keep is None else torch.multinomial(keep.float(), 1).squeeze(1)
    ref = _dense(hid, emb, targets, temperature, keep)
    want = torch.autograd.grad(ref, (emb, mix), g)
    out = chunked_token_logprobs(hidden(), emb, targets, temperature, top_k, top_p, chunk_tokens=16)
    got = torch.autograd.grad(out, (emb, mix), g)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_leading_dims_no_grad_and_frozen_head():
    b, t, h, v = 3, 11, 8, 257
    hidden = torch.randn(b, t, h, requires_grad=True)
    weight = torch.randn(v, h)  # frozen: no gradient asked for
    targets = torch.randint(0, v, (b, t))
    ref = token_logprobs(hidden @ weight.T, targets, 0.7)
    out = chunked_token_logprobs(hidden, weight, targets, 0.7, chunk_tokens=5)
    assert out.shape == (b, t)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    (gh,) = torch.autograd.grad(out.sum(), hidden)
    (want,) = torch.autograd.grad(ref.sum(), hidden)
    torch.testing.assert_close(gh, want, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # the recompute-old-logprobs path
        torch.testing.assert_close(chunked_token_logprobs(hidden, weight, targets, 0.7, chunk_tokens=5), ref)


def test_chunks_without_gradient_are_skipped_exactly():
    n, h, v, chunk = 40, 8, 97, 8
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    g = torch.randn(n)
    g[:20] = 0.0  # chunks 0 and 1 carry no gradient, chunk 2 only half of its rows
    out = chunked_token_logprobs(hidden, weight, targets, 0.7, top_k=10, chunk_tokens=chunk)
    logits = hidden @ weight.T
    ref = token_logprobs(logits, targets, 0.7, kept_ids(logits, 0.7, 10, 1.0))
    gh, gw = _grads(out, hidden, weight, g)
    assert torch.equal(gh[:20], torch.zeros(20, h))
    for a, b in zip((gh, gw), _grads(ref, hidden, weight, g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_autocast_does_not_change_the_dtype_of_either_pass():
    """Under CPU bf16 autocast the matmuls still run in hidden's dtype (float32 here), forward and backward."""
    hidden = torch.randn(30, 8, requires_grad=True)
    weight = torch.randn(97, 8, requires_grad=True)
    targets = torch.randint(0, 97, (30,))
    g = torch.randn(30)
    plain = chunked_token_logprobs(hidden, weight, targets, 0.7, top_p=0.9, chunk_tokens=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = chunked_token_logprobs(hidden, weight, targets, 0.7, top_p=0.9, chunk_tokens=7)
    assert torch.equal(cast, plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads = _grads(cast, hidden, weight, g)
    for a, b in zip(grads, _grads(plain, hidden, weight, g), strict=True):
        assert torch.equal(a, b)


def test_target_outside_kept_set_is_minus_inf_with_dense_gradient():
    n, h, v = 6, 8, 97
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    logits = hidden @ weight.T
    keep = kept_ids(logits, 1.0, 5, 1.0)
    targets = (~keep).float().argmax(-1)  # a filtered-out token in every row
    out = chunked_token_logprobs(hidden, weight, targets, 1.0, top_k=5, chunk_tokens=4)
    assert torch.isneginf(out).all()
    ref = token_logprobs(logits, targets, 1.0, keep)
    g = torch.randn(n)
    for a, b in zip(_grads(out, hidden, weight, g), _grads(ref, hidden, weight, g), strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("filt", [(-1, 1.0), (20, 0.9)])
def test_nothing_of_tokens_by_vocab_is_saved_for_backward(filt):
    n, h, v, chunk = 64, 8, 1031, 16
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    top_k, top_p = filt

    def saved_shapes(fn) -> list[tuple[int, ...]]:
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn().sum().backward()
        return shapes

    # the hook sees the dense path's [N, V] logits, so its silence below means something
    logits = hidden @ weight.T
    dense = saved_shapes(lambda: token_logprobs(hidden @ weight.T, targets, 0.7, kept_ids(logits, 0.7, *filt)))
    assert (n, v) in dense
    chunked = saved_shapes(lambda: chunked_token_logprobs(hidden, weight, targets, 0.7, top_k, top_p, chunk))
    assert chunked, "the hook saw nothing: save_for_backward did not go through it"
    assert max(torch.Size(s).numel() for s in chunked) <= max(n * h, v * h)
    assert all(v not in s or s == (v, h) for s in chunked), chunked


def test_rejects_bad_arguments():
    hidden, weight, targets = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="disagree"):
        chunked_token_logprobs(hidden, torch.randn(10, 7), targets)
    with pytest.raises(ValueError, match="leading shape"):
        chunked_token_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        chunked_token_logprobs(hidden, weight, targets, top_p=0.0)
