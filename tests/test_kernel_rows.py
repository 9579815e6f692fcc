"""The 9-64-row decode matmul (`kernels.rows_gemm`) against its torch reference (interpreter on CPU, compiled on
CUDA): blocks whole or shared by programs, bias, SwiGLU, irregular shapes; shared blocks sum deterministically,
and the skinny kernel's dispatch sends it tensor-core rows when asked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_rt.codegen.kernels import rows_gemm
from tlt_rt.codegen.kernels.rows_gemm import rows_linear, rows_linear_reference, rows_programs, supported

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 runs on the interpreter only (the compiled kernel takes 16-bit weights); bf16 judged against the fp32 run
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]
# few, large programs under the interpreter (~1 ms each); 7 programs, so that most blocks are shared
META = {"block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2, "programs": 7}


def _inputs(m, n, k, bias, swiglu, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if swiglu else n
    x = torch.randn(m, k, generator=g)
    w = torch.randn(rows, k, generator=g) / k**0.5
    b = torch.randn(rows, generator=g) if bias else None
    return (t.to(DEVICE, dtype) if t is not None else None for t in (x, w, b))


@settings(deadline=None, max_examples=10)
@given(
    m=st.integers(9, 64),
    n=st.integers(1, 90),
    k=st.integers(16, 260),
    bias=st.booleans(),
    swiglu=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_matches_the_reference(m, n, k, bias, swiglu, dtype, seed):
    x, w, b = _inputs(m, n, k, bias, swiglu, dtype, seed)
    got = rows_linear(x, w, b, swiglu=swiglu, meta=META)
    assert got.shape == (m, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, rows_linear_reference(x, w, b, swiglu), atol=1e-4, rtol=1e-4)
    else:  # against the same inputs in fp32: within the 16-bit type's rounding of each stored value
        want = rows_linear_reference(x.float(), w.float(), None if b is None else b.float(), swiglu)
        torch.testing.assert_close(got.float(), want, atol=2e-2 * (1 + want.abs().max().item()), rtol=2e-2)


@pytest.mark.parametrize("programs", [1, 3, 7, 12])
@pytest.mark.parametrize("swiglu", [False, True])
def test_blocks_shared_by_programs_sum_the_same_every_time(swiglu, programs):
    """3 blocks of 32 rows x 13 tiles of K cut into `programs` equal runs: blocks whole in one program, and blocks
    two or three programs share (their partials summed in program order by the last to arrive): the reference's
    result, and the same bits on a second call."""
    m, n, k = 24, 70, 400
    x, w, b = _inputs(m, n, k, True, swiglu, DTYPES[0], programs)
    meta = {**META, "programs": programs}
    first = rows_linear(x, w, b, swiglu=swiglu, meta=meta)
    assert torch.equal(first, rows_linear(x, w, b, swiglu=swiglu, meta=meta))
    want = rows_linear_reference(x.float(), w.float(), b.float(), swiglu)
    torch.testing.assert_close(first.float(), want, atol=2e-2 * (1 + want.abs().max().item()), rtol=2e-2)


def test_programs_are_one_wave_and_never_more_than_the_tiles():
    assert rows_programs(24, 12, 132, 2) == 264  # the 1.5B's o at 2 programs an SM: 288 tiles over 264 programs
    assert rows_programs(140, 12, 132, 1) == 132  # its gate/up: one wave, not 140 programs and 8 more
    assert rows_programs(2, 3, 132, 2) == 6 and rows_programs(24, 12, 132, 2, programs=50) == 50
    assert rows_programs(32, 12, 132, 2, min_tiles=4) == 96  # q/k/v: 384 tiles, 4 at least a program
    assert rows_programs(140, 12, 132, 1, min_tiles=4) == 132 and rows_programs(1, 3, 132, 1, min_tiles=4) == 1


def test_refuses_what_it_does_not_take():
    x, w, _ = _inputs(16, 8, 32, False, False, DTYPES[-1], 0)
    assert supported(x, w) and not supported(x[:8], w) and not supported(torch.cat([x] * 5), w)  # 9-64 rows
    assert not supported(x, w.t().contiguous().t())  # a weight strided along K
    assert not supported(x[:, :8], w[:, :8])  # rows of fewer than 16 elements: no tensor-core tile
    with pytest.raises(ValueError, match="9-64 rows"):
        rows_linear(x[:4], w)
    with pytest.raises(ValueError, match="even row count"):
        rows_linear(x, w[:7], swiglu=True)


def test_the_skinny_dispatch_sends_tensor_core_rows_here_when_asked(monkeypatch):
    """skinny_gemm.DOT_KERNEL "split": its 9-64-row launches (the decode chain's batches and verify rows) run
    this kernel; "tiles" keeps its own."""
    from tlt_rt.codegen.kernels import skinny_gemm

    calls = []
    real = rows_gemm.rows_linear
    monkeypatch.setattr(rows_gemm, "rows_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(rows_gemm, "ROWS_META", {**rows_gemm.ROWS_META, **META})
    x, w, b = _inputs(16, 40, 64, True, False, DTYPES[-1], 3)
    for kernel in ("tiles", "split"):
        monkeypatch.setattr(skinny_gemm, "DOT_KERNEL", kernel)
        skinny_gemm.skinny_linear_triton(x, w, b)
        skinny_gemm.skinny_linear_triton(x[:1], w, b)  # one row: the skinny kernel's own
    assert calls == [16]


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_the_qwen_shapes_compiled_eager_and_replayed(pdl):
    """Compiled, on Qwen2.5-Coder-1.5B's shapes (o and down split over K, gate/up with SwiGLU, a verify's 33 rows of
    q/k/v with its bias): within bf16 rounding of the fp32 reference; replays of a CUDA graph of all four (the
    split's counters left zero by each launch) give the eager launches' bits."""
    shapes = [(32, 1536, 1536, False, False), (32, 1536, 8960, False, False), (32, 8960, 1536, True, False),
              (33, 2048, 1536, False, True)]  # fmt: skip
    inputs = [tuple(_inputs(m, n, k, bias, swiglu, torch.bfloat16, i)) for i, (m, n, k, bias, swiglu) in
              enumerate(shapes)]  # fmt: skip

    def run():
        return [rows_linear(x, w, b, swiglu=s[3], pdl=pdl) for (x, w, b), s in zip(inputs, shapes, strict=True)]

    eager = run()
    for (x, w, b), s, got in zip(inputs, shapes, eager, strict=True):
        want = rows_linear_reference(x.float(), w.float(), None if b is None else b.float(), s[3])
        torch.testing.assert_close(got.float(), want, atol=2e-2 * (1 + want.abs().max().item()), rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, eager, strict=True))
