"""Paged KV-cache blocks: which cache blocks each sequence's positions live in.

A sequence's block table lists block ids; cache position `p` sits in block `table[p // block_size]` (see
`models/attention.py`). Blocks are reference counted so that the `n` samples of one prompt share the
prompt's KV, which is prefilled once and then forked.

Sharing rule: only blocks that no holder will write again are shared. `fork` shares just the blocks that
are full within the frozen prefix and gives the child private copies of the rest, so appends after a fork
never land in a shared block. The one operation that could move a write position back into a shared block
is `truncate`; it copies on write: the block that would become partially filled is replaced by a private
copy, and the copy is returned for the engine to apply to its caches, exactly like `fork`'s copies.

Every operation either succeeds or leaves the manager unchanged (it checks the free count first), so a
caller can catch `OutOfBlocks` (or a False from `ensure`) and preempt something without cleaning up.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from tlt_rt.models.llama import CausalLM

Copy = tuple[int, int]  # (src_block, dst_block): the engine copies block src into block dst in every cache


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for the request; nothing was changed."""

    def __init__(self, needed: int, free: int, what: str):
        super().__init__(f"{what}: needs {needed} free KV blocks, only {free} free")
        self.needed = needed
        self.free = free


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


@dataclass
class Tables:
    """A batch's block tables: `array` [B, W] int64 padded with block 0 to the longest table (W), `lens` each
    table's length; `tables[i]` is table i as a list."""

    array: np.ndarray
    lens: list[int]

    @classmethod
    def of(cls, tables: list[list[int]]) -> Tables:
        lens = [len(t) for t in tables]
        array = np.zeros((len(tables), max(lens, default=0)), dtype=np.int64)
        for i, t in enumerate(tables):
            array[i, : len(t)] = t
        return cls(array, lens)

    def __len__(self) -> int:
        return len(self.lens)

    def tensor(self, width: int | None = None, device="cpu") -> torch.Tensor:
        """[B, width] int32 (width: at least the longest table and 1), padded with block 0."""
        width = max(self.array.shape[1], 1, width or 0)
        out = np.zeros((len(self.lens), width), dtype=np.int32)
        out[:, : self.array.shape[1]] = self.array
        return torch.from_numpy(out).to(device)

    def __getitem__(self, i: int) -> list[int]:
        return self.array[i, : self.lens[i]].tolist()


class BlockManager:
    """Reference-counted block tables over a fixed pool of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockManager.{name} must be a positive int, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._dirty: set[int] = set()  # sequences whose table changed since the last `packed` call
        self._pack: tuple | None = None  # (seq ids, [B, >= W] int64, lens, row of each id) of that call

    # ------------------------------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Distinct blocks held by at least one sequence."""
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of the pool in use, in [0, 1]."""
        return self.num_used / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def seq_ids(self) -> list[int]:
        return list(self._tables)

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._table(seq_id))

    def packed(self, seq_ids: list[int]) -> Tables:
        """The tables of `seq_ids` as `Tables`. Kept between calls: asked for the same sequences again, only
        the tables changed since are copied (a decode step of a steady batch copies a table every
        block_size tokens). The array is a view of the manager's own: read it before the next call."""
        ids = tuple(seq_ids)
        if self._pack is None or self._pack[0] != ids:
            fresh = Tables.of([self._table(s) for s in ids])
            self._pack = (ids, fresh.array, fresh.lens, {s: i for i, s in enumerate(ids)})
        else:
            _, array, lens, rows = self._pack
            for seq_id in self._dirty:
                i = rows.get(seq_id)
                if i is None:
                    continue
                t = self._table(seq_id)
                if len(t) > array.shape[1]:  # room for a few more blocks, so widening stays rare
                    array = np.pad(array, ((0, 0), (0, len(t) - array.shape[1] + 8)))
                array[i, : len(t)] = t
                array[i, len(t) :] = 0
                lens[i] = len(t)
            self._pack = (ids, array, lens, rows)
        self._dirty.clear()
        _, array, lens, _ = self._pack
        return Tables(array[:, : max(lens, default=0)], list(lens))

    def can_allocate(self, num_tokens: int) -> bool:
        return blocks_for(self._check_tokens(num_tokens), self.block_size) <= len(self._free)

    # ---------------------------------------------------------------------------------------- changes
    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Give a new sequence private blocks for `num_tokens` positions; returns its table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has blocks; free it first")
        need = blocks_for(self._check_tokens(num_tokens), self.block_size)
        self._require(need, f"allocate({seq_id}, {num_tokens})")
        self._tables[seq_id] = [self._take() for _ in range(need)]
        self._dirty.add(seq_id)
        return list(self._tables[seq_id])

    def ensure(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the table to hold `num_tokens` positions; False (and no change) when blocks are short.

        Never shrinks: a table already large enough is left alone (use `truncate` to give blocks back).
        """
        table = self._table(seq_id)
        need = blocks_for(self._check_tokens(num_tokens), self.block_size) - len(table)
        if need > len(self._free):
            return False
        if need > 0:
            table.extend(self._take() for _ in range(need))
            self._dirty.add(seq_id)
        return True

    def blocks_short(self, seq_ids: list[int], num_tokens: list[int]) -> int:
        """How many blocks `ensure_many(seq_ids, num_tokens)` would take from the free list."""
        bs, tables = self.block_size, self._tables
        return sum(max(0, -(-n // bs) - len(tables[s])) for s, n in zip(seq_ids, num_tokens, strict=True))

    def ensure_many(self, seq_ids: list[int], num_tokens: list[int]) -> int:
        """`ensure` for each (sequence, positions) in turn, stopping at the first one blocks are short for;
        returns how many succeeded. A table already large enough costs one comparison (a decode step's
        common case)."""
        bs, tables = self.block_size, self._tables
        for i, (seq_id, n) in enumerate(zip(seq_ids, num_tokens, strict=True)):
            table = tables.get(seq_id)
            if (table is None or n < 0 or -(-n // bs) > len(table)) and not self.ensure(seq_id, n):
                return i
        return len(seq_ids)

    def truncate(self, seq_id: int, num_tokens: int) -> list[Copy]:
        """Keep only the blocks `num_tokens` positions need; returns copy-on-write copies (usually none).

        The caller will write from position `num_tokens` on. If that lands inside a shared block (possible
        only when truncating into a forked prefix), the block is swapped for a private copy so the other
        holders keep their KV. OutOfBlocks (no change) if that copy finds no free block.
        """
        table = self._table(seq_id)
        keep = blocks_for(self._check_tokens(num_tokens), self.block_size)
        if keep > len(table):
            return []  # nothing past num_tokens, and position num_tokens lies beyond the table
        tail = table[keep:]
        cow = num_tokens % self.block_size != 0 and self._refs[table[keep - 1]] > 1
        if not tail and not cow:
            return []
        if cow:
            # the dropped tail may free a block for the copy itself
            released = sum(1 for b in tail if self._refs[b] == 1)
            self._require(1 - released, f"truncate({seq_id}, {num_tokens}) copy-on-write")
        del table[keep:]
        self._dirty.add(seq_id)
        for b in tail:
            self._release(b)
        if not cow:
            return []
        src = table[keep - 1]
        dst = self._take()
        self._release(src)
        table[keep - 1] = dst
        return [(src, dst)]

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> list[Copy]:
        """Start `child_id` from the parent's first `num_tokens` positions; returns the copies to apply.

        The child shares (refcount + 1) every block that is full within those `num_tokens` positions:
        neither sequence writes there again. Every further block of the parent's table, the partially
        filled one and any the parent holds past it, goes to the child as a fresh block plus a copy, since
        both sequences may still write there; the child's table is as long as the parent's. Forking at
        one position before the parent's end thus gives each child a private block for that position,
        which it can rewrite (the engine does so for the drafter's row of the last prompt token).
        """
        parent = self._table(parent_id)
        if child_id in self._tables:
            raise ValueError(f"fork: sequence {child_id} already has blocks; free it first")
        capacity = len(parent) * self.block_size
        if self._check_tokens(num_tokens) > capacity:
            raise ValueError(f"fork: parent {parent_id} holds {capacity} positions, cannot share {num_tokens}")
        shared = num_tokens // self.block_size
        self._require(len(parent) - shared, f"fork({parent_id}, {child_id}, {num_tokens})")
        child = parent[:shared]
        for b in child:
            self._refs[b] += 1
        copies = []
        for src in parent[shared:]:
            dst = self._take()
            child.append(dst)
            copies.append((src, dst))
        self._tables[child_id] = child
        self._dirty.add(child_id)
        return copies

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references; blocks nobody else holds return to the free list."""
        for b in self._tables.pop(self._check_known(seq_id)):
            self._release(b)
        self._dirty.add(seq_id)

    # ------------------------------------------------------------------------------------------ tensors
    def table_tensor(self, seq_ids: list[int], width: int | None = None, device="cpu") -> torch.Tensor:
        """Block tables as an int32 tensor [B, width], padded with block 0.

        Padding with 0 rather than -1 keeps every entry a valid block index, so a kernel that reads a padded
        entry (a CUDA-graph bucket padded up, or positions past a sequence's length) stays in bounds;
        attention masks those positions by `seq_lens` and writes go only to slots computed from real
        entries, so block 0's contents never matter there. `width` defaults to the longest table.
        """
        t = Tables.of([self._table(s) for s in seq_ids])
        longest = t.array.shape[1]
        width = max(longest, 1) if width is None else width
        if longest > width:
            raise ValueError(f"table_tensor: a table has {longest} blocks, more than width {width}")
        return t.tensor(width, device)

    # ---------------------------------------------------------------------------------------- internals
    def _table(self, seq_id: int) -> list[int]:
        return self._tables[self._check_known(seq_id)]

    def _check_known(self, seq_id: int) -> int:
        if seq_id not in self._tables:
            raise KeyError(f"sequence {seq_id} has no blocks")
        return seq_id

    @staticmethod
    def _check_tokens(num_tokens: int) -> int:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        return num_tokens

    def _require(self, needed: int, what: str) -> None:
        if needed > len(self._free):
            raise OutOfBlocks(needed, len(self._free), what)

    def _take(self) -> int:
        b = self._free.popleft()
        self._refs[b] = 1
        return b

    def _release(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise AssertionError(f"block {block} released more often than it was taken")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)


def blocks_per_sequence(max_context: int, scratch: int, block_size: int) -> int:
    """Width of one sequence's block table: its whole context plus the positions a step writes past its length
    (`scratch`), in blocks, and one more."""
    return -(-(max_context + scratch) // block_size) + 1


def cpu_num_blocks(per_block: int) -> int:
    """The automatic KV cache on a CPU: up to 1024 blocks or 512 MiB, at least 64 blocks."""
    return max(64, min(1024, (512 << 20) // per_block))


def auto_num_blocks(target: CausalLM, block_size: int, most: int | None = None) -> int:
    """KV blocks to allocate when none are configured: half the free GPU memory, or up to 512 MiB on CPU, and
    never more than `most` (what the engine can fill: max_batch sequences of its full context), so a small
    model's engine leaves the rest of the GPU to the learner instead of holding it unused."""
    a = target.arch
    per_block = 2 * a.num_hidden_layers * block_size * a.num_key_value_heads * a.head_dim
    per_block *= target.lm_head.weight.element_size()
    device = target.lm_head.weight.device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        n = max(64, int(free * 0.5) // per_block)
    else:
        n = cpu_num_blocks(per_block)
    return n if most is None else max(64, min(n, most))
