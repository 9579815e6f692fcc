"""The row-parallel matmul with its tensor-parallel sum inside (`kernels.tp_sum`), off the GPU: under the interpreter
two ranks are played one after the other over plain tensors standing in for their symmetric buffers, the second
rank's flag raised beforehand where the first would wait for it. Checked: the sum of both partials in rank order,
bitwise the same on both ranks; the flags and counters left as a barrier must leave them; the two slots; bad input.
On two GPUs the same kernel runs inside the TP engine (tests/test_tp_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tlt_rt.codegen.kernels import tp_sum  # noqa: E402
from tlt_rt.codegen.kernels.tp_sum import FLAG_WORDS, SLOTS, SumBuffers, row_parallel_sum, sum_supported  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's two ranks in one process")

WIDE = {"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 1}  # few programs: the interpreter is slow


class Ranks:
    """Two ranks' buffers (plain fp32 tensors) and each rank's `SumBuffers` view of them."""

    def __init__(self, slot_elems: int, world: int = 2):
        self.bufs = [torch.zeros(SumBuffers.buffer_elems(slot_elems)) for _ in range(world)]
        ptrs = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64)
        self.views = [
            SumBuffers(ptrs, torch.zeros(SLOTS, dtype=torch.int32), slot_elems, r, world) for r in range(world)
        ]
        self.flag_base = SLOTS * slot_elems

    def flags(self, rank: int) -> list[int]:
        """The flags in `rank`'s buffer, one per sending rank."""
        return self.bufs[rank][self.flag_base :].view(torch.int32)[: len(self.bufs)].tolist()

    def raise_flag(self, at: int, sender: int) -> None:
        self.bufs[at][self.flag_base :].view(torch.int32)[sender] = 1

    def slot(self, rank: int, slot: int, rows: int, n: int) -> torch.Tensor:
        start = slot * self.views[rank].slot_elems
        return self.bufs[rank][start : start + rows * n].view(rows, n)


def partial(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().t()


def play_two_ranks(ranks: Ranks, xs, ws, slot: int, meta=WIDE):
    """Rank 0's call (rank 1 has arrived: its partial is in its slot, computed by the same kernel over rank 1's
    buffer alone, and its flag is up in rank 0's buffer), then rank 1's; both results."""
    one = ranks.views[1]
    alone = SumBuffers(one.ptrs[1:].clone(), torch.zeros(SLOTS, dtype=torch.int32), one.slot_elems, 0, 1)
    row_parallel_sum(xs[1], ws[1], alone, slot, meta=meta)
    ranks.raise_flag(at=0, sender=1)
    y0 = row_parallel_sum(xs[0], ws[0], ranks.views[0], slot, meta=meta)
    assert ranks.flags(0) == [0, 0], "rank 0 takes rank 1's flag down"
    assert ranks.flags(1) == [1, 0], "rank 0 raises its flag in rank 1's buffer"
    y1 = row_parallel_sum(xs[1], ws[1], ranks.views[1], slot, meta=meta)
    assert ranks.flags(1) == [0, 0], "rank 1 takes rank 0's flag down"
    assert ranks.flags(0) == [0, 1], "rank 1's flag: what rank 0 waited for"
    ranks.bufs[0][ranks.flag_base :].view(torch.int32)[1] = 0  # consumed by rank 0's wait in a real run
    assert all(int(c) == 0 for v in ranks.views for c in v.counts), "the last program zeroes its counter"
    return y0, y1


SHAPES = [(1, 40, 48, torch.float32), (3, 24, 200, torch.float32), (1, 33, 130, torch.bfloat16),
          (8, 16, 64, torch.float16)]  # fmt: skip


# flat: one row's products in the slab's layout (tp_sum.ROW_FLAT), which only one-row launches take
@pytest.mark.parametrize(
    "rows, n, k, dtype, flat", [(*s, False) for s in SHAPES] + [(*s, True) for s in SHAPES if s[0] == 1]
)
def test_two_ranks_sum_their_partials_in_rank_order(rows, n, k, dtype, flat, monkeypatch):
    monkeypatch.setattr(tp_sum, "ROW_FLAT", flat)
    g = torch.Generator().manual_seed(rows * 1000 + n)
    xs = [torch.randn(rows, k, generator=g).to(dtype) for _ in range(2)]
    ws = [torch.randn(n, k, generator=g).to(dtype) for _ in range(2)]
    ranks = Ranks(slot_elems=8 * 64)
    y0, y1 = play_two_ranks(ranks, xs, ws, slot=0)
    p0, p1 = partial(xs[0], ws[0]), partial(xs[1], ws[1])
    assert y0.dtype == dtype and y0.shape == (rows, n)
    assert torch.equal(y0, y1), "every rank must hold the same bits"
    torch.testing.assert_close(ranks.slot(0, 0, rows, n), p0, rtol=1e-5, atol=1e-4)  # each rank's fp32 partial
    torch.testing.assert_close(ranks.slot(1, 0, rows, n), p1, rtol=1e-5, atol=1e-4)
    # the sum of exactly those fp32 partials, in rank order, rounded once to the output's dtype (bitwise in fp32;
    # the interpreter rounds to 16-bit types its own way, so there within one step of the type)
    total = ranks.slot(0, 0, rows, n) + ranks.slot(1, 0, rows, n)
    if dtype == torch.float32:
        assert torch.equal(y0, total)
    else:
        step = torch.finfo(dtype).eps * total.abs().clamp_min(1.0)
        assert bool(((y0.float() - total).abs() <= step).all())
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(y0.float(), p0 + p1, rtol=tol, atol=tol * max(1.0, k**0.5))


def test_slots_alternate_and_the_other_stays_untouched():
    g = torch.Generator().manual_seed(3)
    ranks = Ranks(slot_elems=64)
    xs = [torch.randn(1, 32, generator=g) for _ in range(2)]
    w_attn = [torch.randn(24, 32, generator=g) for _ in range(2)]
    w_mlp = [torch.randn(24, 32, generator=g) for _ in range(2)]
    y_attn, _ = play_two_ranks(ranks, xs, w_attn, slot=0)
    first = ranks.slot(1, 0, 1, 24).clone()
    y_mlp, _ = play_two_ranks(ranks, xs, w_mlp, slot=1)
    assert torch.equal(ranks.slot(1, 0, 1, 24), first), "the second sum must not touch the first's slot"
    torch.testing.assert_close(y_mlp, partial(xs[0], w_mlp[0]) + partial(xs[1], w_mlp[1]), rtol=1e-5, atol=1e-4)
    again, _ = play_two_ranks(ranks, xs, w_attn, slot=0)  # the barrier left everything as it found it
    assert torch.equal(again, y_attn)


def test_one_program_and_a_row_wider_than_the_last_programs_chunk(monkeypatch):
    monkeypatch.setattr(tp_sum, "TAIL_ELEMS", 16)  # the last program sums a row 16 columns at a time
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 40, generator=g) for _ in range(2)]
    ws = [torch.randn(50, 40, generator=g) for _ in range(2)]
    for meta in (WIDE, {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 1}):  # 4 programs, then one
        ranks = Ranks(slot_elems=128)
        y0, y1 = play_two_ranks(ranks, xs, ws, slot=1, meta=meta)
        assert torch.equal(y0, y1)
        torch.testing.assert_close(y0, partial(xs[0], ws[0]) + partial(xs[1], ws[1]), rtol=1e-5, atol=1e-4)


def test_one_rank_is_its_own_product():
    g = torch.Generator().manual_seed(9)
    ranks = Ranks(slot_elems=64, world=1)
    x, w = torch.randn(1, 48, generator=g), torch.randn(20, 48, generator=g)
    y = row_parallel_sum(x, w, ranks.views[0], 0, meta=WIDE)
    torch.testing.assert_close(y, partial(x, w), rtol=1e-5, atol=1e-5)


def test_what_it_refuses():
    ranks = Ranks(slot_elems=32)
    x, w = torch.randn(1, 16), torch.randn(20, 16)
    assert sum_supported(x, w, ranks.views[0])
    assert not sum_supported(torch.randn(9, 16), w, ranks.views[0])  # more rows than the kernel takes
    assert not sum_supported(torch.randn(2, 16), w, ranks.views[0])  # 2 x 20 outgrows a slot of 32
    assert not sum_supported(x, w.double(), ranks.views[0])
    assert not sum_supported(x, torch.randn(16, 20).t(), ranks.views[0])  # strided along K
    with pytest.raises(ValueError, match="row_parallel_sum needs"):
        row_parallel_sum(torch.randn(2, 16), w, ranks.views[0], 0)
    with pytest.raises(ValueError, match="slot must be"):
        row_parallel_sum(x, w, ranks.views[0], 2)
    with pytest.raises(ValueError, match="int64 addresses"):
        SumBuffers(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), 8, 0, 2)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        SumBuffers(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), 8, 2, 2)
    with pytest.raises(ValueError, match="int32 counters"):
        SumBuffers(torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), 8, 0, 2)
    assert FLAG_WORDS >= 8


def test_fused_sums_take_one_row_and_pass_the_rest_on():
    """`FusedSums` runs the kernel for one-row products and declines more rows (cuBLAS's tensor cores win there),
    leaving them to the one-shot sum it wraps; plain sums always go to that."""
    from tlt_rt.codegen.kernels.tp_sum import FusedSums

    class Inner:
        def __init__(self):
            self.calls = []

        def __call__(self, x):
            self.calls.append("sum")
            return True

        def linear(self, x, w):
            self.calls.append("linear")
            return None

    inner, ranks = Inner(), Ranks(slot_elems=64, world=1)
    fused = FusedSums(inner, ranks.views[0], meta=WIDE)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(1, 16, generator=g), torch.randn(24, 16, generator=g)
    torch.testing.assert_close(fused.row_parallel(x, w, 0), partial(x, w), rtol=1e-5, atol=1e-5)
    assert fused.row_parallel(torch.randn(2, 16), w, 1) is None  # two rows: declined
    assert fused(x) and fused.linear(x, w) is None and inner.calls == ["sum", "linear"]
