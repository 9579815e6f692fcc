"""Skinny decode matmul against F.linear (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import importlib
import os

import torch

# See tests/test_kernel_attention.py: the interpreter must be on before the kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import tlt_rt.codegen.kernels.skinny_gemm as _skinny

    if isinstance(_skinny._skinny_kernel, triton.runtime.JITFunction):  # imported earlier, compiled
        importlib.reload(_skinny)

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tlt_rt.codegen.kernels.skinny_gemm import (  # noqa: E402
    MAX_ROWS,
    preferred,
    row_pieces,
    row_tiles,
    skinny_linear,
    skinny_linear_triton,
    supported,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# few, large programs under the interpreter (~1 ms each)
META = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 1}


def _reference(x, w, b, swiglu):
    """F.linear, then silu(gate) * up of its two halves with swiglu (a stacked [gate; up] weight)."""
    y = F.linear(x, w, b)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


@settings(deadline=None, max_examples=12)
@given(
    m=st.integers(1, MAX_ROWS),
    n=st.integers(1, 150),
    k=st.integers(1, 200),
    bias=st.booleans(),
    lead=st.sampled_from([(), (1,)]),
    seed=st.integers(0, 2**16),
)
def test_matches_linear(m, n, k, bias, lead, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, m, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    y = skinny_linear_triton(x, w, b, meta=META)
    assert y.shape == (*lead, m, n)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4 * k**0.5, rtol=1e-4)


@settings(deadline=None, max_examples=6)
@given(
    m=st.integers(1, 3), inter=st.integers(1, 70), k=st.integers(1, 90), bias=st.booleans(), seed=st.integers(0, 999)
)
def test_swiglu_epilogue_matches_matmul_then_activation(m, inter, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = torch.randn(2 * inter, k, generator=g).to(DEVICE)
    b = torch.randn(2 * inter, generator=g).to(DEVICE) if bias else None
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    got = skinny_linear_triton(x, w, b, meta=META, swiglu=True)
    assert got.shape == (m, inter)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-4 * k**0.5, rtol=1e-4)


def test_row_pieces_cover_k_in_at_most_four_powers_of_two():
    assert row_pieces(1536) == [1024, 512] and row_pieces(8960) == [8192, 512, 256] and row_pieces(64) == [64]
    for k in range(1, 3000):
        parts = row_pieces(k)
        assert len(parts) <= 4 and all(p & (p - 1) == 0 for p in parts) and parts == sorted(parts, reverse=True)
        assert sum(parts[:-1]) < k <= sum(parts) < 2 * k  # the last piece reaches past K by less than K


@pytest.mark.parametrize("k", [48, 150, 203, 256])  # one tile; pieces exact (150), the last masked (203)
@pytest.mark.parametrize("whole", [0, 512])  # 0: rows wider than BLOCK_K streamed in tiles
@pytest.mark.parametrize("swiglu", [False, True])
def test_whole_rows_and_streamed_tiles_match_linear(k, whole, swiglu):
    g = torch.Generator().manual_seed(k + whole)
    x = torch.randn(1, k, generator=g).to(DEVICE)
    w = torch.randn(2 * 40, k, generator=g).to(DEVICE)
    meta = {**META, "whole": whole}
    tiles = row_tiles(k, meta, meta["block_n"] * (2 if swiglu else 1))
    assert tiles["ONE_TILE"] == (k <= META["block_k"] or whole > 0)
    got = skinny_linear_triton(x, w, meta=meta, swiglu=swiglu)
    torch.testing.assert_close(got, _reference(x, w, None, swiglu), atol=1e-4 * k**0.5, rtol=1e-4)


def test_rows_within_one_tile_in_pieces_when_asked():
    """meta "pieces": a row within one tile as its power-of-two pieces (no padding), a power of two as one tile."""
    meta = {**META, "block_k": 2048, "pieces": 1}
    assert row_tiles(1536, meta, 8) == {"BLOCK_K": 1024, "K1": 512, "K2": 0, "K3": 0, "ONE_TILE": True}
    assert row_tiles(896, meta, 8) == {"BLOCK_K": 512, "K1": 256, "K2": 128, "K3": 0, "ONE_TILE": True}
    assert row_tiles(1024, meta, 8)["K1"] == 0 and row_tiles(1536, {**meta, "pieces": 0}, 8)["BLOCK_K"] == 2048


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("whole", [0, 512, -1])  # long rows streamed in tiles or loaded whole; -1: short ones in pieces
@pytest.mark.parametrize("swiglu", [False, True])
def test_one_row_products_flat_or_broadcast_match_linear(flat, whole, swiglu, monkeypatch):
    """`skinny_gemm.ROW_FLAT`: one row's products in the slab's own layout or broadcast over three dimensions, in
    one tile and over tiles: both F.linear's result."""
    import tlt_rt.codegen.kernels.skinny_gemm as sk

    monkeypatch.setattr(sk, "ROW_FLAT", flat)
    g = torch.Generator().manual_seed(7)
    for k in (40, 150):
        x = torch.randn(1, k, generator=g).to(DEVICE)
        w = torch.randn(2 * 50, k, generator=g).to(DEVICE)
        b = torch.randn(2 * 50, generator=g).to(DEVICE)
        meta = {**META, "block_k": 256, "pieces": 1} if whole < 0 else {**META, "whole": whole}
        got = skinny_linear_triton(x, w, b, meta=meta, swiglu=swiglu)
        torch.testing.assert_close(got, _reference(x, w, b, swiglu), atol=1e-4 * k**0.5, rtol=1e-4)


@pytest.mark.parametrize("m", [9, 16, 33])  # blocks of 16, 16 and 64 rows: products on tensor cores
@pytest.mark.parametrize("swiglu", [False, True])
def test_tensor_core_rows_match_linear(m, swiglu):
    """From 9 rows of a 16-bit type the products run on tensor cores (`products`; the interpreter's dot in fp32):
    F.linear's result within bf16 rounding, over streamed tiles."""
    g = torch.Generator().manual_seed(m)
    k = 150
    x = torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(2 * 40, k, generator=g) / 8).to(DEVICE, torch.bfloat16)
    b = torch.randn(2 * 40, generator=g).to(DEVICE, torch.bfloat16)
    meta = {"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 1, "whole": 0}
    got = skinny_linear_triton(x, w, b, meta=meta, swiglu=swiglu)
    want = _reference(x.float(), w.float(), b.float(), swiglu)
    assert got.shape == (m, 40 if swiglu else 80) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05 * want.abs().max().item(), rtol=2e-2)


def test_products_by_row_block_and_dtype(monkeypatch):
    import tlt_rt.codegen.kernels.skinny_gemm as sk

    assert sk.skinny_meta(16, 1536, 8960) is sk.DOT_NARROW and sk.skinny_meta(33, 2 * 8960, 1536) is sk.DOT_META

    monkeypatch.setattr(sk.pdl_module, "interpreting", lambda: False)  # as on a GPU
    assert sk.products(1, torch.bfloat16) == (sk.FLAT if sk.ROW_FLAT else sk.BROADCAST)
    assert sk.products(8, torch.bfloat16) == sk.BROADCAST and sk.products(16, torch.bfloat16) == sk.DOT_BF16
    assert sk.products(64, torch.float16) == sk.DOT_FP16 and sk.products(16, torch.float32) == sk.DOT_FP32
    assert sk.one_or_dot(1, torch.float32) and not sk.one_or_dot(8, torch.bfloat16) and sk.one_or_dot(9, torch.bfloat16)
    assert not sk.one_or_dot(9, torch.float32) and not sk.one_or_dot(65, torch.bfloat16)  # fp32: 8 rows at most


def test_row_views_of_a_wider_weight():
    # a fused q/k/v weight's slices: rows of a larger tensor, unit stride along K
    big = torch.randn(96, 40, device=DEVICE)
    w = big[16:80]
    x = torch.randn(3, 40, device=DEVICE)
    torch.testing.assert_close(skinny_linear_triton(x, w, meta=META), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_half_precision_accumulates_in_float32():
    x = torch.randn(2, 256, device=DEVICE).half()
    w = (torch.randn(32, 256, device=DEVICE) / 16).half()
    ref = F.linear(x.float(), w.float())
    got = skinny_linear_triton(x, w, meta=META)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=1e-2)


def test_falls_back_outside_its_domain():
    w = torch.randn(8, 16, device=DEVICE)
    many = torch.randn(MAX_ROWS + 1, 16, device=DEVICE)
    assert not supported(many, w)
    torch.testing.assert_close(skinny_linear(many, w), F.linear(many, w))
    strided = torch.randn(16, 8, device=DEVICE).t()  # [8, 16] with stride (1, 8)
    assert not supported(many[:2], strided)
    torch.testing.assert_close(skinny_linear(many[:2], strided), F.linear(many[:2], strided))
    assert not supported(many[:2].double(), w.double())
    with pytest.raises(ValueError, match="rows"):
        skinny_linear_triton(many, w)
    with pytest.raises(ValueError, match="even"):
        skinny_linear_triton(many[:1], w[:7], swiglu=True)


def test_dispatch_sends_only_what_the_kernel_wins(monkeypatch):
    import tlt_rt.codegen.kernels.skinny_gemm as sk

    w = torch.randn(64, 32, device=DEVICE)
    one, two = torch.randn(1, 32, device=DEVICE), torch.randn(2, 32, device=DEVICE)
    assert supported(one, w) and not preferred(one, w)  # a small weight stays with F.linear
    monkeypatch.setattr(sk, "MIN_WEIGHT", w.numel())
    monkeypatch.setattr(sk, "SKINNY_META", {**sk.SKINNY_META, 1: META})
    assert preferred(one, w) and not preferred(two, w)  # one row only
    calls = []
    real = sk.skinny_linear_triton
    monkeypatch.setattr(sk, "skinny_linear_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.testing.assert_close(skinny_linear(one, w), F.linear(one, w), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(skinny_linear(two, w), F.linear(two, w))
    assert calls == [1]


def test_a_chain_of_more_rows_takes_one_row_and_tensor_core_rows(monkeypatch):
    """`preferred(..., rows=N)` (a decode chain of up to N rows): one row, and 9-N rows of a 16-bit type (tensor
    cores); 2-8 rows and fp32 beyond 8 stay with F.linear."""
    import tlt_rt.codegen.kernels.skinny_gemm as sk

    monkeypatch.setattr(sk, "MIN_WEIGHT", 0)
    w16, w32 = torch.randn(64, 32, device=DEVICE).bfloat16(), torch.randn(64, 32, device=DEVICE)
    rows = (1, 2, 8, 9, 16, 64, 65)
    taken = [m for m in rows if preferred(torch.randn(m, 32, device=DEVICE).bfloat16(), w16, rows=64)]
    assert taken == [1, 9, 16, 64]
    assert not preferred(torch.randn(16, 32, device=DEVICE).bfloat16(), w16)  # one row unless asked
    assert not preferred(torch.randn(16, 32, device=DEVICE), w32, rows=64)
    narrow = torch.randn(64, 8, device=DEVICE).bfloat16()  # rows of 8 elements: no tensor-core tile
    assert not supported(torch.randn(16, 8, device=DEVICE).bfloat16(), narrow)
    assert supported(torch.randn(8, 8, device=DEVICE).bfloat16(), narrow)
