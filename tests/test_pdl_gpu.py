"""Programmatic dependent launch on the GPU: a captured chain of dependent kernels launched with PDL (each placed
while the one before runs, prefetching its weight) gives bit for bit what the chain gives without it, replay after
replay; the engine with `rollout.decode_chain` and `rollout.pdl` keeps the eager torch engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import PROMPTS, count_calls
from tests.test_engine_gpu import _pair
from tlt_rt.rollout import Engine, SamplingParams

pytestmark = pytest.mark.gpu


def _chain(x, r, layers, pdl: bool):
    """A decoder-like chain of one-row kernels, each reading the one before's output: per layer the add + norm +
    projection (q/k/v-like, with bias), the skinny matmul back to the width, the add + norm + gate/up with SwiGLU,
    the skinny down matmul."""
    from tlt_rt.codegen.kernels.norm_linear import norm_linear
    from tlt_rt.codegen.kernels.skinny_gemm import skinny_linear_triton

    kw = {"pdl": pdl, "prefetch": pdl}
    for nw, w_in, b_in, w_back, nw2, w_gu, w_down in layers:
        x, h = norm_linear(x, r, nw, 1e-6, w_in, b_in, **kw)
        r = skinny_linear_triton(h, w_back, **kw)
        x, a = norm_linear(x, r, nw2, 1e-6, w_gu, swiglu=True, **kw)
        r = skinny_linear_triton(a, w_down, **kw)
    return x + r


def test_a_graphed_pdl_chain_is_bit_identical_to_the_plain_one():
    from tlt_rt.codegen.kernels.pdl import pdl_supported

    if not pdl_supported("cuda"):
        pytest.skip("PDL needs compute capability 9.0 or later")
    torch.manual_seed(0)
    dev, bf, width, inner, proj = "cuda", torch.bfloat16, 1536, 4096, 2048

    def w(*shape):
        return (torch.randn(*shape, device=dev) * shape[-1] ** -0.5).to(bf)

    layers = [
        (1 + w(width) / 4, w(proj, width), w(proj), w(width, proj), 1 + w(width) / 4, w(2 * inner, width),
         w(width, inner))
        for _ in range(6)
    ]  # fmt: skip
    x, r = w(1, width), w(1, width)
    with torch.no_grad():
        outs = {}
        for pdl in (False, True):
            _chain(x, r, layers, pdl)  # compiled before capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs[pdl] = _chain(x, r, layers, pdl)
            for _ in range(20):
                x.copy_(w(1, width))  # a new input each replay: a read before the wait would see a stale one
                g.replay()
                expect = _chain(x, r, layers, pdl=False)
                torch.cuda.synchronize()
                assert torch.equal(outs[pdl], expect), f"pdl={pdl}: a replay differs from the eager chain"


# 40,000: the tiny model's q/k/v and gate/up (65,536 elements) go to cuBLAS with the glue's norm, o / down (32,768)
# and the head stay in the chain (rollout.decode_chain_max_weight)
@pytest.mark.parametrize("max_weight", [0, 40_000])
@pytest.mark.parametrize("speculative", ["off", "on"])
def test_engine_with_pdl_keeps_the_eager_tokens(speculative, max_weight, monkeypatch):
    """rollout.decode_chain and pdl on: one prompt, one sample (one-row steps, where the chain runs), greedy; the
    tokens are the eager torch engine's, and the step's kernels ran with PDL asked for; with a weight limit, the
    larger weights' products and norms outside the chain."""
    from tlt_rt.codegen.kernels import decode_rope_attention, norm_linear, skinny_gemm

    targets = (
        (norm_linear, "norm_linear", "norm"),
        (skinny_gemm, "skinny_linear_triton", "skinny"),
        (decode_rope_attention, "decode_rope_attention", "rope"),
    )
    asked = count_calls(monkeypatch, targets, lambda kwargs: int(bool(kwargs.get("pdl"))))  # launches asking for PDL
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=40, stop_token_ids=[])
    prompts = PROMPTS[1:2]
    target, drafter = _pair()
    eager = Engine(target, drafter=drafter, block_size=16, enforce_eager=True, attn_backend="torch",
                   speculative=speculative, strategies=("3_3_8", "4_2_6"))  # fmt: skip
    target, drafter = _pair()
    chained = Engine(target, drafter=drafter, block_size=16, speculative=speculative, strategies=("3_3_8", "4_2_6"),
                     decode_chain=True, pdl=True, decode_chain_max_weight=max_weight)  # fmt: skip
    assert chained.glue.pdl and chained.target.attn_backend.pdl and chained.glue.max_weight == max_weight
    a, b = eager.generate(prompts, params), chained.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert asked["skinny"] > 0, asked
    if speculative == "off":
        assert (asked["norm"] > 0) == (max_weight == 0) and asked["rope"] > 0, asked


@pytest.mark.parametrize("kernel", ["tiles", "split"])
@pytest.mark.parametrize("speculative", ["off", "on"])
def test_engine_with_a_chain_of_many_rows_keeps_the_eager_tokens(speculative, kernel, monkeypatch):
    """rollout.decode_chain_rows 64: steps of 12 rows (and the verify rows of speculative steps) of a bf16 model also
    run as the chain, their products on tensor cores (skinny_gemm.DOT_KERNEL: its own tiles, or `kernels.rows_gemm`
    with K split over programs); greedy tokens are those of the chain of one row (whose steps of more rows take
    cuBLAS: the two differ only in the order of fp32 sums)."""
    from tlt_rt.codegen.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "DOT_KERNEL", kernel)
    rows_seen = []
    real = skinny_gemm.skinny_linear_triton

    def counted(x, *args, **kwargs):
        rows_seen.append(x.numel() // x.shape[-1])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(skinny_gemm, "skinny_linear_triton", counted)
    params = SamplingParams(n=4, temperature=0.0, max_new_tokens=24, stop_token_ids=[])
    prompts = PROMPTS[:3]  # 12 rows a step
    outs = []
    for rows in (1, 64):
        target, drafter = (m.to(torch.bfloat16) for m in _pair())
        engine = Engine(target, drafter=drafter, block_size=16, speculative=speculative, strategies=("3_3_8", "4_2_6"),
                        decode_chain=True, pdl=True, decode_chain_rows=rows)  # fmt: skip
        rows_seen.clear()
        outs.append([o.token_ids for o in engine.generate(prompts, params)])
    assert outs[0] == outs[1]
    assert max(rows_seen, default=0) >= 9, rows_seen  # tensor-core rows went through the kernel
