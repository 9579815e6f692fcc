"""The one-launch residual add + RMSNorm + projection against the glue's two-kernel reference (interpreter on CPU,
compiled on CUDA), and a decode step through it on the GPU."""

from __future__ import annotations

import importlib
import os

import torch

# See tests/test_kernel_attention.py: the interpreter must be on before the kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import tlt_rt.codegen.kernels.norm_linear as _norm_linear
    import tlt_rt.codegen.kernels.skinny_gemm as _skinny

    if isinstance(_norm_linear._norm_linear_kernel, triton.runtime.JITFunction):  # imported earlier, compiled
        importlib.reload(_skinny)  # its jit helpers first: the kernel calls them
        importlib.reload(_norm_linear)

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tlt_rt.codegen.kernels.norm_linear import norm_linear, norm_linear_supported  # noqa: E402
from tlt_rt.codegen.kernels.skinny_gemm import MAX_ROWS  # noqa: E402
from tlt_rt.models.glue import Glue  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# few, large programs under the interpreter (~1 ms each)
META = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 1}
EPS = 1e-6


def _inputs(m, n, k, residual, bias, seed, dtype=torch.float32, swiglu=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    r = torch.randn(m, k, generator=g) if residual else None
    nw = 1 + 0.3 * torch.randn(k, generator=g)
    rows = 2 * n if swiglu else n
    w = torch.randn(rows, k, generator=g) / k**0.5
    b = torch.randn(rows, generator=g) if bias else None
    return [None if t is None else t.to(DEVICE, dtype) for t in (x, r, nw, w, b)]


@settings(deadline=None, max_examples=12)
@given(
    m=st.integers(1, MAX_ROWS),
    n=st.integers(1, 130),
    k=st.integers(1, 200),
    residual=st.booleans(),
    bias=st.booleans(),
    swiglu=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_the_two_kernel_reference(m, n, k, residual, bias, swiglu, seed):
    x, r, nw, w, b = _inputs(m, n, k, residual, bias, seed, swiglu=swiglu)
    ref = Glue()
    want_s, want_y = (ref.add_norm_linear_swiglu if swiglu else ref.add_norm_linear)(x, r, nw, EPS, w, b)
    s, y = norm_linear(x, r, nw, EPS, w, b, swiglu=swiglu, meta=META)
    assert y.shape == (m, n) and s.shape == x.shape
    torch.testing.assert_close(s, want_s, atol=0, rtol=0)  # the residual stream is the add itself
    torch.testing.assert_close(y, want_y, atol=1e-4 * k**0.5, rtol=1e-4)
    if not residual:
        assert s is x  # nothing to write: layer 0 passes its embedding on


# rows within one BLOCK_K tile, wider ones whole in pieces (150 = 128 + 16 + 4 + 2; 203: a fifth digit, the last
# piece masked) or, with "whole" 0, in two passes over BLOCK_K tiles
@pytest.mark.parametrize("k", [50, 64, 150, 203])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("whole", [0, 512, -1])  # -1: rows within a wider tile in their pieces (meta "pieces")
def test_one_tile_and_two_pass_rows_match_the_reference(k, swiglu, whole):
    x, r, nw, w, b = _inputs(1, 70, k, True, not swiglu, 3, swiglu=swiglu)
    ref = Glue()
    want_s, want_y = (ref.add_norm_linear_swiglu if swiglu else ref.add_norm_linear)(x, r, nw, EPS, w, b)
    meta = {**META, "block_k": 256, "pieces": 1} if whole < 0 else {**META, "whole": whole}
    s, y = norm_linear(x, r, nw, EPS, w, b, swiglu=swiglu, meta=meta)
    torch.testing.assert_close(s, want_s, atol=0, rtol=0)
    torch.testing.assert_close(y, want_y, atol=1e-4 * k**0.5, rtol=1e-4)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("k", [64, 150])  # one tile; two passes
def test_one_row_flat_or_broadcast_products_match_the_reference(flat, k, monkeypatch):
    """`skinny_gemm.ROW_FLAT` on or off: one row through the norm kernel matches the two-kernel reference."""
    import tlt_rt.codegen.kernels.skinny_gemm as sk

    monkeypatch.setattr(sk, "ROW_FLAT", flat)
    for swiglu in (False, True):
        x, r, nw, w, b = _inputs(1, 40, k, True, True, 5, swiglu=swiglu)
        ref = Glue()
        want_s, want_y = (ref.add_norm_linear_swiglu if swiglu else ref.add_norm_linear)(x, r, nw, EPS, w, b)
        s, y = norm_linear(x, r, nw, EPS, w, b, swiglu=swiglu, meta={**META, "whole": 0})
        torch.testing.assert_close(s, want_s, atol=0, rtol=0)
        torch.testing.assert_close(y, want_y, atol=1e-4 * k**0.5, rtol=1e-4)


@pytest.mark.parametrize("m", [9, 33])  # tensor-core products (blocks of 16 and 64 rows)
@pytest.mark.parametrize("swiglu", [False, True])
def test_tensor_core_rows_match_the_reference(m, swiglu):
    g = torch.Generator().manual_seed(m)
    k, n = 150, 2 * 24
    x, r = (torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    nw = torch.randn(k, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / 8).to(DEVICE, torch.bfloat16)
    ref = Glue()
    want_s, want_y = (ref.add_norm_linear_swiglu if swiglu else ref.add_norm_linear)(x, r, nw, EPS, w, None)
    meta = {"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 1, "whole": 0}
    s, y = norm_linear(x, r, nw, EPS, w, None, swiglu=swiglu, meta=meta)
    assert y.shape == want_y.shape and y.dtype == torch.bfloat16
    torch.testing.assert_close(s.float(), want_s.float(), atol=0.02 * want_s.abs().max().item(), rtol=1e-2)
    torch.testing.assert_close(y.float(), want_y.float(), atol=0.05 * want_y.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("swiglu", [False, True])
def test_bf16_rounds_where_the_reference_rounds(swiglu):
    """In bf16 the residual stream is bit-equal on the GPU (the add rounds once, as torch's does; the interpreter
    rounds bf16 its own way, within one step) and the projection within a few bf16 steps of the reference (the
    sum over K runs in another order)."""
    x, r, nw, w, b = _inputs(3, 96, 160, True, True, 7, dtype=torch.bfloat16, swiglu=swiglu)
    ref = Glue()
    want_s, want_y = (ref.add_norm_linear_swiglu if swiglu else ref.add_norm_linear)(x, r, nw, EPS, w, b)
    s, y = norm_linear(x, r, nw, EPS, w, b, swiglu=swiglu, meta=META)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.bfloat16
    step = 0 if DEVICE == "cuda" else 2**-7  # one bf16 step, relative
    torch.testing.assert_close(s, want_s, atol=0, rtol=step)
    torch.testing.assert_close(y.float(), want_y.float(), atol=5e-2, rtol=5e-2)


def test_rejects_what_it_does_not_take():
    x, r, nw, w, b = _inputs(MAX_ROWS + 1, 8, 16, True, False, 1)
    assert not norm_linear_supported(x, r, nw, w)
    with pytest.raises(ValueError, match="norm_linear needs rows"):
        norm_linear(x, r, nw, EPS, w)
    x, r, nw, w, b = _inputs(2, 8, 16, True, False, 1)
    assert norm_linear_supported(x, r, nw, w)
    assert not norm_linear_supported(x, r, nw.double(), w)  # a norm weight of another dtype
    assert not norm_linear_supported(x, r[:1], nw, w)  # a residual of another shape
    with pytest.raises(ValueError, match="even row count"):
        norm_linear(x, r, nw, EPS, w[:7], swiglu=True, meta=META)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA device")
@pytest.mark.parametrize("batch", [1, 4, 12])
def test_a_decode_step_through_the_fused_glue(batch):
    """A bf16 Qwen-like model's decode step (CUDA graph-free forward_paged) with KernelGlue(fused_norm=True): the
    kernel takes every q/k/v and gate/up projection of a step of at most norm_rows rows and none above, and the
    logits stay within bf16 noise of the two-kernel glue's."""
    from tlt_rt.codegen import model_kernels
    from tlt_rt.codegen.backend import select_backend
    from tlt_rt.codegen.kernels import norm_linear as kernel
    from tlt_rt.models.arch import ArchConfig
    from tlt_rt.models.attention import AttnMetadata
    from tlt_rt.models.llama import CausalLM

    torch.manual_seed(0)
    arch = ArchConfig(model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=640, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, qkv_bias=True,
                      max_position_embeddings=256)  # fmt: skip
    model = CausalLM(arch).cuda().to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.attn_backend = select_backend(torch.device("cuda"))
    model.fuse_projections()
    calls = []
    real = kernel.norm_linear

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    block, ctx = 16, 40
    tables = torch.arange(batch * 4, device="cuda", dtype=torch.int32).view(batch, 4)
    pos = torch.full((batch,), ctx, device="cuda")
    slots = (tables[:, ctx // block] * block + ctx % block).long()
    meta = AttnMetadata("decode", torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                        torch.full((batch,), ctx + 1, dtype=torch.int32, device="cuda"), tables, slots, 1)  # fmt: skip
    ids = torch.randint(0, arch.vocab_size, (batch,), device="cuda")
    out = {}
    for fused in (False, True):
        cache = model.make_cache(batch * 4 + 1, block)
        torch.manual_seed(1)
        cache.k.normal_()
        cache.v.normal_()
        model.compile_glue(model_kernels.KernelGlue(fused_norm=fused, norm_rows=8))
        kernel.norm_linear = counted
        try:
            with torch.no_grad():
                out[fused] = model.forward_paged(ids, pos, cache, meta).logits.float()
        finally:
            kernel.norm_linear = real
    if batch <= 8:
        assert calls == [batch] * (2 * arch.num_hidden_layers), calls
    else:
        assert calls == []
    torch.testing.assert_close(out[True], out[False], atol=5e-2, rtol=5e-2)
