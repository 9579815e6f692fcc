"""build_meta: the attention inputs of a packed batch of contiguous runs, against a token-by-token reference."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from tlt_rt.rollout.step.target import Layout, build_meta


def reference(layout: Layout, block_size: int):
    """Every new token one at a time: (cu_seqlens, seq_lens, padded tables, slots, positions) as lists."""
    cu, slots, positions = [0], [], []
    for table, start, q in zip(layout.tables, layout.starts, layout.q_lens, strict=True):
        cu.append(cu[-1] + q)
        for p in range(start, start + q):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    width = max(len(t) for t in layout.tables)
    tables = [t + [0] * (width - len(t)) for t in layout.tables]
    seq_lens = [s + q for s, q in zip(layout.starts, layout.q_lens, strict=True)]
    return cu, seq_lens, tables, slots, positions


@st.composite
def layouts(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    n = draw(st.integers(1, 9))
    tables, starts, q_lens, next_block = [], [], [], 0
    for _ in range(n):
        start, q = draw(st.integers(0, 70)), draw(st.integers(1, 40))
        blocks = -(-(start + q) // block_size) + draw(st.integers(0, 2))  # tables may hold spare blocks
        tables.append(list(range(next_block, next_block + blocks))[::-1])  # not in order: slots must follow it
        next_block += blocks
        starts.append(start)
        q_lens.append(q)
    return Layout(tables, starts, q_lens), block_size


@given(layouts())
def test_build_meta_equals_the_token_by_token_reference(case):
    layout, block_size = case
    meta, positions = build_meta(layout, "prefill", block_size, "cpu")
    cu, seq_lens, tables, slots, pos = reference(layout, block_size)
    assert meta.cu_seqlens_q.dtype == torch.int32 and meta.cu_seqlens_q.tolist() == cu
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == seq_lens
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.tolist() == tables
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == slots
    assert positions.dtype == torch.int64 and positions.tolist() == pos
    assert meta.max_q_len == max(layout.q_lens)
    assert meta.host == (cu, seq_lens)
    meta.validate(len(slots))


def test_copy_blocks_reads_every_source_before_writing():
    # one batched copy of a fork step: block 1 is the source of one copy and the destination of the next (a
    # parent's last block freed and taken by a later fork), so it must be read before it is written
    from tlt_rt.models.llama import KVCache
    from tlt_rt.rollout.step.target import TargetRunner

    runner = TargetRunner.__new__(TargetRunner)  # copy_blocks needs only the device
    runner.device = torch.device("cpu")
    cache = KVCache(2, 5, 2, 1, 3, torch.float32, "cpu")
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    k0, v0 = cache.k.clone(), cache.v.clone()
    runner.copy_blocks([(1, 3), (0, 1), (2, 4)], [cache])
    for t, t0 in ((cache.k, k0), (cache.v, v0)):
        assert torch.equal(t[:, 3], t0[:, 1]) and torch.equal(t[:, 1], t0[:, 0]) and torch.equal(t[:, 4], t0[:, 2])
        assert torch.equal(t[:, [0, 2]], t0[:, [0, 2]])
