"""A row-parallel matmul of a few rows with its tensor-parallel sum inside: y = sum over ranks of x_r @ W_r^T, one
kernel a rank.

Under tensor parallelism every o and down projection ends in a sum over the ranks. At decode it is a few KB, and a
separate all-reduce (NCCL, or the one-shot sum over symmetric memory) costs a launch and a barrier of its own for
each: 56 a step on a 28-layer model, ~7 us each on two H200s. Here the sum rides on the matmul's own launch:

1. every program computes its [rows, BLOCK_N] tile of this rank's partial product (the skinny matrix-vector loop of
   `kernels.skinny_gemm`) and stores it, in fp32, into this rank's slot of a buffer every rank can read (symmetric
   memory over NVLink);
2. it counts itself in (an atomic on a local counter); the program that arrives last knows the whole partial is in
   the slot, so it alone meets the other ranks' last programs: it raises a flag in every other rank's buffer and
   waits for theirs in its own (each flag set 0 -> 1 by its sender and taken back 1 -> 0 by its receiver, so a
   barrier leaves every flag as it found it and a captured graph replays it as is);
3. it reads every rank's slot in rank order, sums in fp32 and writes y in its dtype, then zeroes the counter.
Every rank adds the same fp32 partials in the same order, so y is bitwise the same on every rank. Only one program
a rank waits on another GPU, so the kernel never depends on which of its programs are resident at once.

Two slots alternate (the caller passes 0 for attention's sum, 1 for the MLP's): a rank overwrites a slot only two
sums later, and between the two it has met every other rank in the sum between, which those enter only after
finishing the kernel that read the slot. Off the GPU the interpreter runs the same kernel over plain tensors standing
in for the other ranks' buffers (tests/test_tp_sum.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from tlt_rt.codegen.kernels.operands import weight_fits
from tlt_rt.codegen.kernels.pdl import interpreting, launch_meta
from tlt_rt.codegen.kernels.skinny_gemm import (
    BROADCAST,
    FLAT,
    MAX_ROWS,
    SUPPORTED_DTYPES,
    _row_products,
    row_tiles,
    skinny_meta,
)
from tlt_rt.models.tensor_parallel import set_fast_allreduce, symmetric_empty, use_allreduce

__all__ = ["FLAG_WORDS", "SLOTS", "FusedSums", "SumBuffers", "row_parallel_sum", "sum_supported", "use_fused_sums"]

SLOTS = 2
FLAG_WORDS = 64  # int32 flags after the slots: one per sending rank (64 ranks at most)
# The one-row launch and the last program's chunk, from a sweep on 2x H200 (Qwen2.5-7B shape, TP=2, bf16, graphs,
# `tp_throughput.py --allreduce fused:bn=..,w=..,s=..,tail=..`): a step of 3.46 ms with these, against 3.97 ms with
# skinny_gemm's one-row-a-program tiles and the whole row summed at once (their registers cut the matmul's
# occupancy), 3.54 with 4-row tiles and the whole row, 3.68 with 8-row tiles and 512 columns.
ONE_ROW_META = {"block_n": 4, "block_k": 2048, "num_warps": 4, "num_stages": 3}
TAIL_ELEMS = 1024  # elements of a row the last program sums at once
# One row's products in the slab's own layout, as `skinny_gemm.ROW_FLAT` (which made the one-GPU step 1.09-1.17x
# faster): 11-12 barriers against 21-22 in the 7B TP=2 o / down kernels' PTX. Off: under TP=2 (Qwen2.5-7B shape,
# batch 1, 2x H200, aea3a0f, tp_throughput.py --allreduce fused:f=0 fused:f=1, one after the other in one process)
# 302.5 tok/s against 310.1 without.
ROW_FLAT = False


@triton.jit
def _peer(ptrs, rank):
    """Rank `rank`'s buffer (an fp32 pointer) from the table of every rank's buffer address."""
    return tl.load(ptrs + rank).to(tl.pointer_type(tl.float32))


@triton.jit
def _meet(ptrs, flag_base, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Raise this rank's flag in every other rank's buffer (waiting while the last one is still up), then take down
    every other rank's flag in this one's as it comes: a barrier between the ranks' last programs that releases
    this rank's slot to them and acquires theirs (system scope: the flags cross NVLink)."""
    for src in tl.static_range(WORLD):
        if src != RANK:
            flag = _peer(ptrs, src).to(tl.pointer_type(tl.int32)) + flag_base + RANK
            while tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0:
                pass
    mine = _peer(ptrs, RANK).to(tl.pointer_type(tl.int32)) + flag_base
    for src in tl.static_range(WORLD):
        if src != RANK:
            while tl.atomic_cas(mine + src, 1, 0, sem="acquire", scope="sys") != 1:
                pass


@triton.jit
def _row_parallel_sum_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    ptrs,
    count_ptr,
    slot_base,
    flag_base,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TAIL_N: tl.constexpr,
    ONE_TILE: tl.constexpr,
    K1: tl.constexpr,
    K2: tl.constexpr,
    K3: tl.constexpr,
    PRODUCTS: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    acc, _ = _row_products(x_ptr, w_ptr, rm, rn, m_ok, n_ok, N, K, stride_xm, stride_wn, False, BLOCK_M, BLOCK_N,
                           BLOCK_K, PDL, False, 1, 1, ONE_TILE, K1, K2, K3, PRODUCTS)  # fmt: skip
    # 1. this program's tile of the partial into this rank's slot
    slot = _peer(ptrs, RANK) + slot_base
    tl.store(slot + rm[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
    tl.debug_barrier()  # every thread's stores before the count (the release below covers them)
    # 2. count in; the last program meets the other ranks
    if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        if WORLD > 1:
            _meet(ptrs, flag_base, RANK, WORLD)
        tl.debug_barrier()
        # 3. the sum of every rank's slot, in rank order, into y
        for m in range(0, M):
            for c0 in range(0, N, TAIL_N):
                cols = c0 + tl.arange(0, TAIL_N)
                c_ok = cols < N
                total = tl.zeros((TAIL_N,), dtype=tl.float32)
                for src in tl.static_range(WORLD):
                    part = _peer(ptrs, src) + slot_base + m * N
                    total += tl.load(part + cols, mask=c_ok, other=0.0, cache_modifier=".cv")
                tl.store(y_ptr + m * stride_ym + cols, total.to(y_ptr.dtype.element_ty), mask=c_ok)
        tl.store(count_ptr, 0)


class SumBuffers:
    """What the kernel sums through, on one rank: every rank's buffer address (`ptrs`, int64 on the device), this
    rank's counters (one per slot) and the layout of a buffer: SLOTS slots of `slot_elems` fp32 elements each, then
    FLAG_WORDS int32 flags. `rank` / `world`: this rank's place in the group.

    `SumBuffers.symmetric(group, device, n)` allocates it over symmetric memory (collective); tests build one over
    plain tensors (`SumBuffers(ptrs, counters, slot_elems, rank, world)`), whose buffers stand in for the ranks'."""

    def __init__(self, ptrs: torch.Tensor, counts: torch.Tensor, slot_elems: int, rank: int, world: int, keep=None):
        if ptrs.dtype != torch.int64 or ptrs.numel() != world:
            raise ValueError(f"ptrs must hold {world} int64 addresses, got {ptrs.numel()} {ptrs.dtype}")
        if not 0 <= rank < world <= FLAG_WORDS:
            raise ValueError(f"rank {rank} of {world}: needs 0 <= rank < world <= {FLAG_WORDS}")
        if counts.dtype != torch.int32 or counts.numel() < SLOTS:
            raise ValueError(f"counts must be {SLOTS} int32 counters, got {counts.numel()} {counts.dtype}")
        self.ptrs, self.counts, self.slot_elems = ptrs, counts, slot_elems
        self.rank, self.world = rank, world
        self.keep = keep  # what owns the memory behind ptrs (the symmetric tensor and its handle)

    @staticmethod
    def buffer_elems(slot_elems: int) -> int:
        """fp32 elements of one rank's buffer: the slots and the flags."""
        return SLOTS * slot_elems + FLAG_WORDS

    @classmethod
    def symmetric(cls, group, device: torch.device, slot_elems: int) -> SumBuffers:
        """One buffer a rank over symmetric memory (zeroed, so every flag is down), collective over `group`."""
        buf, handle = symmetric_empty(group, cls.buffer_elems(slot_elems), torch.float32, device)
        buf.zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # no rank raises a flag before every buffer is zeroed
        ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        counts = torch.zeros(SLOTS, dtype=torch.int32, device=device)
        return cls(ptrs, counts, slot_elems, handle.rank, handle.world_size, keep=(buf, handle))

    def fits(self, rows: int, n: int) -> bool:
        return rows * n <= self.slot_elems


def sum_supported(x: torch.Tensor, weight: torch.Tensor, buffers: SumBuffers) -> bool:
    """True where `row_parallel_sum` applies: x [M, K] with M <= MAX_ROWS rows, weight [N, K] row-contiguous of x's
    dtype on x's device, M x N within a slot, a Triton device."""
    return (
        (x.is_cuda or interpreting())
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype in SUPPORTED_DTYPES
        and weight_fits(x, weight)
        and buffers.fits(x.shape[0], weight.shape[0])
    )


def row_parallel_sum(
    x: torch.Tensor,
    weight: torch.Tensor,
    buffers: SumBuffers,
    slot: int,
    pdl: bool = False,
    meta: dict | None = None,
    tail: int | None = None,
) -> torch.Tensor:
    """sum over the ranks of x @ weight^T ([M, N], x's dtype): every rank of the group calls it with its own x and
    weight of the same shapes, in the same order of calls, alternating `slot` (0, 1) from one call to the next.
    meta: keys of the matrix-vector loop's launch (skinny_gemm's) over the default (ONE_ROW_META for one row, else
    `skinny_meta`'s); tail: columns the last program sums at once (None: TAIL_ELEMS)."""
    if not sum_supported(x, weight, buffers):
        raise ValueError(
            f"row_parallel_sum needs x [M <= {MAX_ROWS}, K] of {SUPPORTED_DTYPES}, a weight [N, K] of its dtype with "
            f"unit stride along K, M x N <= {buffers.slot_elems}; got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype} stride {weight.stride()}"
        )
    if slot not in range(SLOTS):
        raise ValueError(f"slot must be in range({SLOTS}), got {slot}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    cfg = {**(ONE_ROW_META if m == 1 else skinny_meta(m, n, k)), **(meta or {})}
    tiles = row_tiles(k, cfg, cfg["block_n"])
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["block_n"]),)
    _row_parallel_sum_kernel[grid](
        x,
        weight,
        y,
        buffers.ptrs,
        buffers.counts[slot:],
        slot * buffers.slot_elems,
        SLOTS * buffers.slot_elems,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        RANK=buffers.rank,
        WORLD=buffers.world,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=cfg["block_n"],
        TAIL_N=min(tail or TAIL_ELEMS, triton.next_power_of_2(n)),
        **tiles,
        PRODUCTS=FLAT if ROW_FLAT and m == 1 else BROADCAST,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **launch_meta(x.device, pdl, kind="tp"),
    )
    return y


class FusedSums:
    """A tensor-parallel shard's fast sum (`models.tensor_parallel.set_fast_allreduce`) whose `row_parallel` runs a
    row-parallel layer's matmul and sum as `row_parallel_sum` where it applies, for at most `rows` rows (1: at 8 rows
    the kernel's CUDA-core products lose to cuBLAS, 6.70 against 3.89 ms a TP=2 step in fp32 on the 7B shape);
    everything else (and the layers it declines) goes to `inner`, the one-shot sum over symmetric memory. pdl: the
    kernel launched with PDL."""

    def __init__(
        self, inner, buffers: SumBuffers, pdl: bool = False, meta: dict | None = None, tail=None, rows: int = 1
    ) -> None:
        self.inner, self.buffers, self.pdl, self.meta, self.tail = inner, buffers, pdl, meta, tail
        self.rows = rows

    def __call__(self, x: torch.Tensor) -> bool:
        return self.inner(x)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        return self.inner.linear(x, weight)

    def row_parallel(self, x: torch.Tensor, weight: torch.Tensor, slot: int) -> torch.Tensor | None:
        if x.dim() != 2 or x.shape[0] > self.rows or not sum_supported(x, weight, self.buffers):
            return None
        return row_parallel_sum(x, weight, self.buffers, slot, pdl=self.pdl, meta=self.meta, tail=self.tail)


def use_fused_sums(model, pdl: bool = False, meta: dict | None = None, tail: int | None = None):
    """The sums of the tensor-parallel shard `model` through `FusedSums`: its o and down projections of one row
    (a decode step at batch 1) each one kernel with the sum inside, the rest through the one-shot sum
    (`use_allreduce(model, "oneshot")`). meta, tail: as `row_parallel_sum`'s.
    Collective (every rank of the group calls it); capture steps after it. Returns the model."""
    use_allreduce(model, "oneshot")
    inner = model.tp.fast
    buffers = getattr(model, "_row_sums", None)
    if buffers is None:
        buffers = SumBuffers.symmetric(model.tp.group, inner.buffer.device, MAX_ROWS * model.tp.full_arch.hidden_size)
        model._row_sums = buffers  # one set of buffers per model, kept across switches
    return set_fast_allreduce(model, FusedSums(inner, buffers, pdl, meta, tail))
