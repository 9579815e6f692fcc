"""BlockManager: error cases, fork/copy-on-write, and a stateful model check of every invariant."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tlt_rt.rollout.block_manager import BlockManager, OutOfBlocks, Tables, blocks_for


def test_rejects_bad_sizes():
    for nb, bs in ((0, 16), (4, 0), (-1, 16), (4, True), (4.0, 16)):
        with pytest.raises(ValueError, match="BlockManager"):
            BlockManager(nb, bs)


def test_allocate_errors_and_out_of_blocks():
    m = BlockManager(4, 4)
    assert m.allocate(1, 9) == [0, 1, 2]
    with pytest.raises(ValueError, match="already has blocks"):
        m.allocate(1, 1)
    assert not m.can_allocate(5)
    with pytest.raises(OutOfBlocks, match="needs 2 free KV blocks, only 1") as err:
        m.allocate(2, 5)
    assert (err.value.needed, err.value.free) == (2, 1)
    assert 2 not in m and m.num_free == 1
    with pytest.raises(ValueError, match="non-negative"):
        m.allocate(3, -1)
    with pytest.raises(KeyError, match="no blocks"):
        m.free(7)
    with pytest.raises(KeyError):
        m.ensure(7, 1)
    assert m.allocate(3, 0) == [] and m.block_table(3) == []


def test_ensure_grows_never_shrinks_and_fails_cleanly():
    m = BlockManager(3, 2)
    m.allocate(1, 1)
    assert m.ensure(1, 4) and m.block_table(1) == [0, 1]
    assert m.ensure(1, 1) and m.block_table(1) == [0, 1]
    assert not m.ensure(1, 7)
    assert m.block_table(1) == [0, 1] and m.num_free == 1


def test_fork_shares_full_blocks_and_copies_the_rest():
    m = BlockManager(8, 4)
    m.allocate(0, 10)  # blocks 0,1,2 (block 2 half full)
    copies = m.fork(0, 1, 10)
    t0, t1 = m.block_table(0), m.block_table(1)
    assert t1[:2] == t0[:2] and t1[2] != t0[2]
    assert copies == [(t0[2], t1[2])]
    assert [m.ref_count(b) for b in t0] == [2, 2, 1]
    # forking one position short of a block boundary's end still copies the block holding that position
    m.allocate(5, 5)  # two blocks, position 4 alone in the second
    t5 = m.block_table(5)
    assert m.fork(5, 6, 4) == [(t5[1], m.block_table(6)[1])]
    assert m.block_table(6)[0] == t5[0]
    with pytest.raises(ValueError, match="cannot share"):
        m.fork(0, 2, 13)
    with pytest.raises(ValueError, match="already has blocks"):
        m.fork(0, 1, 4)


def test_fork_out_of_blocks_changes_nothing():
    m = BlockManager(4, 4)
    m.allocate(0, 14)  # 4 blocks, none free; a fork at 8 needs 2 copies
    with pytest.raises(OutOfBlocks):
        m.fork(0, 1, 8)
    assert 1 not in m and all(m.ref_count(b) == 1 for b in m.block_table(0))
    assert m.fork(0, 1, 16) == [] and all(m.ref_count(b) == 2 for b in m.block_table(0))


def test_free_returns_blocks_only_at_refcount_zero():
    m = BlockManager(4, 4)
    m.allocate(0, 8)
    m.fork(0, 1, 8)
    m.free(0)
    assert m.num_free == 2 and m.num_used == 2 and m.usage() == 0.5
    m.free(1)
    assert m.num_free == 4 and m.usage() == 0.0


def test_truncate_frees_tail_and_copies_on_write_into_shared_block():
    m = BlockManager(6, 4)
    m.allocate(0, 12)
    m.fork(0, 1, 12)  # all three blocks shared
    shared = m.block_table(0)
    assert m.truncate(1, 12) == [] and m.truncate(1, 40) == []
    assert m.truncate(1, 8) == [] and m.block_table(1) == shared[:2]  # boundary: no copy
    copies = m.truncate(1, 6)  # next write goes to position 6, inside shared block 1
    t1 = m.block_table(1)
    assert copies == [(shared[1], t1[1])] and t1[0] == shared[0] and t1[1] not in shared
    assert m.ref_count(shared[1]) == 1 and m.ref_count(shared[2]) == 1
    # a private partial block is truncated in place
    assert m.truncate(1, 5) == [] and m.block_table(1) == t1


def test_truncate_copy_on_write_out_of_blocks_changes_nothing():
    m = BlockManager(2, 4)
    m.allocate(0, 8)
    m.fork(0, 1, 8)
    with pytest.raises(OutOfBlocks, match="copy-on-write"):
        m.truncate(1, 6)
    assert m.block_table(1) == m.block_table(0) and m.num_free == 0
    # when the dropped tail frees blocks, one of them serves the copy
    m = BlockManager(3, 4)
    m.allocate(0, 4)
    m.fork(0, 1, 4)  # block 0 shared, full
    assert m.ensure(1, 12) and m.num_free == 0
    ((src, dst),) = m.truncate(1, 2)
    assert src == 0 and m.block_table(1) == [dst] and m.num_free == 1 and m.ref_count(0) == 1


def test_ensure_many_stops_at_the_first_refusal():
    m = BlockManager(5, 4)
    m.allocate(1, 4), m.allocate(2, 4), m.allocate(3, 4)
    assert m.ensure_many([1, 2, 3], [4, 8, 8]) == 3 and m.num_free == 0  # 1 already holds 4 positions
    assert m.ensure_many([1, 2, 3], [4, 9, 8]) == 1 and len(m.block_table(2)) == 2  # 2 refused, 3 not tried
    with pytest.raises(KeyError):
        m.ensure_many([7], [1])


def test_packed_follows_every_change():
    m = BlockManager(16, 2)
    m.allocate(1, 3), m.allocate(2, 1)
    first = m.packed([1, 2])
    assert first.lens == [2, 1] and first.array.tolist() == [[0, 1], [2, 0]]
    m.ensure(2, 7)  # wider than the packed array
    m.fork(1, 3, 2)
    assert m.packed([1, 2]).array.tolist() == [[0, 1, 0, 0], [2, 3, 4, 5]]
    m.free(1), m.truncate(2, 2)
    assert m.packed([3, 2]).array.tolist() == [[0, 6], [2, 0]] and m.packed([3, 2]).lens == [2, 1]


def test_table_tensor_pads_with_zero():
    m = BlockManager(8, 2)
    m.allocate(0, 5)
    m.allocate(1, 1)
    t = m.table_tensor([0, 1])
    assert t.dtype == torch.int32 and t.tolist() == [m.block_table(0), m.block_table(1) + [0, 0]]
    assert m.table_tensor([1], width=4).shape == (1, 4)
    with pytest.raises(ValueError, match="width"):
        m.table_tensor([0], width=2)


class BlockMachine(RuleBasedStateMachine):
    """Drives the manager like an engine would, keeping a simulated cache to check no KV is ever clobbered.

    Every write stores a fresh integer in a simulated slot; copies returned by fork/truncate are applied.
    A sequence must always read back exactly what was written for it (or forked into it).
    """

    @initialize(num_blocks=st.integers(1, 14), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks, block_size):
        self.m = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.cache = [[None] * block_size for _ in range(num_blocks)]
        self.length: dict[int, int] = {}  # positions each table must hold
        self.floor: dict[int, int] = {}  # positions below are final (may be shared)
        self.expect: dict[int, list[int]] = {}  # what each position of the sequence must read
        self.preempted: dict[int, int] = {}
        self.next_id = 0
        self.stamp = 0

    # ------------------------------------------------------------------------------------ helpers
    def _write(self, sid: int, start: int, end: int) -> None:
        table = self.m.block_table(sid)
        exp = self.expect[sid]
        del exp[start:]
        for p in range(start, end):
            self.stamp += 1
            self.cache[table[p // self.bs]][p % self.bs] = self.stamp
            exp.append(self.stamp)

    def _apply(self, copies) -> None:
        for src, dst in copies:
            self.cache[dst] = list(self.cache[src])

    def _snapshot(self):
        return list(self.m._free), list(self.m._refs), {k: list(v) for k, v in self.m._tables.items()}

    def _pick(self, i: int) -> int:
        live = sorted(self.length)
        return live[i % len(live)]

    # -------------------------------------------------------------------------------------- rules
    @rule(n=st.integers(0, 20))
    def admit(self, n):
        sid, self.next_id = self.next_id, self.next_id + 1
        self._admit(sid, n)

    def _admit(self, sid: int, n: int) -> bool:
        before = self._snapshot()
        fits = self.m.can_allocate(n)
        try:
            table = self.m.allocate(sid, n)
        except OutOfBlocks:
            assert not fits and self._snapshot() == before
            event("allocate: out of blocks")
            return False
        assert fits and len(table) == blocks_for(n, self.bs)
        self.length[sid], self.floor[sid], self.expect[sid] = n, 0, []
        self._write(sid, 0, n)
        return True

    @precondition(lambda self: self.length)
    @rule(i=st.integers(0, 99), extra=st.integers(0, 9))
    def grow(self, i, extra):
        sid = self._pick(i)
        n = self.length[sid] + extra
        before = self._snapshot()
        grown = self.m.ensure(sid, n) if i % 2 else self.m.ensure_many([sid], [n]) == 1
        if not grown:
            assert self._snapshot() == before
            event("ensure: refused")
            return
        self._write(sid, self.length[sid], n)
        self.length[sid] = n

    @precondition(lambda self: self.length)
    @rule(i=st.integers(0, 99), back=st.integers(0, 20))
    def fork(self, i, back):
        parent = self._pick(i)
        n = max(0, self.length[parent] - back)
        child, self.next_id = self.next_id, self.next_id + 1
        before = self._snapshot()
        try:
            copies = self.m.fork(parent, child, n)
        except OutOfBlocks:
            assert self._snapshot() == before
            event("fork: out of blocks")
            return
        self._apply(copies)
        self.length[child] = self.length[parent]
        self.expect[child] = list(self.expect[parent])
        self.floor[child] = n
        self.floor[parent] = max(self.floor[parent], n)
        # the child rewrites what lies past the shared prefix; the parent must not see it
        self._write(child, n, self.length[child])

    @precondition(lambda self: self.length)
    @rule(i=st.integers(0, 99), back=st.integers(0, 20))
    def truncate(self, i, back):
        sid = self._pick(i)
        self._truncate(sid, max(0, self.length[sid] - back))

    def _shared_holders(self) -> list[int]:
        return [s for s in sorted(self.length) if any(self.m.ref_count(b) > 1 for b in self.m.block_table(s))]

    @precondition(lambda self: self.bs > 1 and self._shared_holders())
    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def truncate_into_shared(self, i, j):
        holders = self._shared_holders()
        sid = holders[i % len(holders)]
        shared = [k for k, b in enumerate(self.m.block_table(sid)) if self.m.ref_count(b) > 1]
        k = shared[j % len(shared)]
        self._truncate(sid, k * self.bs + 1 + j % (self.bs - 1))  # strictly inside shared block k

    def _truncate(self, sid: int, n: int) -> None:
        before = self._snapshot()
        try:
            copies = self.m.truncate(sid, n)
        except OutOfBlocks:
            assert self._snapshot() == before
            event("truncate: out of blocks")
            return
        if copies:
            event("truncate: copy-on-write")
        self._apply(copies)
        self.length[sid] = n
        self.floor[sid] = min(self.floor[sid], n)
        del self.expect[sid][n:]

    @precondition(lambda self: self.length)
    @rule(i=st.integers(0, 99))
    def preempt(self, i):
        sid = self._pick(i)
        self.preempted[sid] = self.length[sid]
        self._drop(sid)

    @precondition(lambda self: self.preempted)
    @rule(i=st.integers(0, 99), extra=st.integers(1, 4))
    def readmit(self, i, extra):
        sid = sorted(self.preempted)[i % len(self.preempted)]
        if self._admit(sid, self.preempted[sid] + extra):  # recompute, one token longer or more
            del self.preempted[sid]

    @precondition(lambda self: self.length)
    @rule(i=st.integers(0, 99))
    def finish(self, i):
        self._drop(self._pick(i))

    def _drop(self, sid: int) -> None:
        self.m.free(sid)
        for d in (self.length, self.floor, self.expect):
            del d[sid]

    # --------------------------------------------------------------------------------- invariants
    @invariant()
    def accounting(self):
        free = list(self.m._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        used = {b for sid in self.length for b in self.m.block_table(sid)}
        assert not used & set(free), "a held block is on the free list"
        assert len(free) + len(used) == self.m.num_blocks, "blocks leaked"
        assert self.m.num_free == len(free) and self.m.num_used == len(used)
        for b in range(self.m.num_blocks):
            holders = sum(b in self.m.block_table(s) for s in self.length)
            assert self.m.ref_count(b) == holders

    @invariant()
    def tables_sized_and_sharing_safe(self):
        for sid, n in self.length.items():
            table = self.m.block_table(sid)
            assert len(table) == blocks_for(n, self.bs)
            assert len(set(table)) == len(table)
            for i, b in enumerate(table):
                if self.m.ref_count(b) > 1:
                    assert (i + 1) * self.bs <= self.floor[sid], f"seq {sid} can write into shared block {b}"

    @invariant()
    def packed_tables_are_the_tables(self):
        """`packed` (kept between calls, rows copied again only when changed) equals the tables, asked for the
        live sequences in order (the steady batch) and, every other time, reversed (a new batch)."""
        self.calls = getattr(self, "calls", 0) + 1
        ids = sorted(self.length)
        if self.calls % 2:
            ids = ids[::-1]
        got = self.m.packed(ids)
        want = Tables.of([self.m.block_table(s) for s in ids])
        assert got.lens == want.lens and np.array_equal(got.array, want.array)
        assert [got[i] for i in range(len(ids))] == [self.m.block_table(s) for s in ids]

    @invariant()
    def contents_intact(self):
        for sid, exp in self.expect.items():
            table = self.m.block_table(sid)
            got = [self.cache[table[p // self.bs]][p % self.bs] for p in range(len(exp))]
            assert got == exp, f"sequence {sid} lost KV"


TestBlockMachine = BlockMachine.TestCase
# copy-on-write truncation needs a fork, then a truncate into its shared prefix: more runs than the default
TestBlockMachine.settings = settings(settings.default, max_examples=150, stateful_step_count=30)
