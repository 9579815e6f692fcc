"""Matmul of a decode step's 9-64 rows (a batch, a speculative step's verify rows): y [M, N] = x [M, K] @ W[N, K]^T
(+ bias), on tensor cores with the weight as the MMA's wide side, its tiles shared evenly by one wave of programs.

With M rows of activations and a weight read once per step, the step streams the weight. Products x . W^T put M
(16-64) on the MMA's row side, below Hopper's 64-row warpgroup tile; here each program computes W-slab . x^T
instead ([BLOCK_N weight rows, BLOCK_M activation rows], the transposed output), so the weight fills the wide side
and its tiles go from global memory through the software pipeline's shared-memory stages straight into the MMA
(16-bit operands loaded as they are stored: no conversion of the slab in registers, which the CUDA-core
`skinny_gemm` path needs). The weight's (BLOCK_N-row block, BLOCK_K tile) pairs, block by block, are cut into
equal runs, one per program, as many programs as the SMs hold at once (stream-K): a Qwen2.5-Coder-1.5B o or
down projection (24 blocks of 64 rows) keeps every SM streaming, and a gate/up projection of 140 blocks leaves no
second wave of 8. A block whose tiles two or more programs share is summed by the last of them to arrive, in
program order, from the fp32 partials the others stored (the same sum whichever arrives last: results are
deterministic), then like a whole block gets the bias, SwiGLU (a stacked [gate; up] weight) and its store. With
PDL the programs wait for the kernel before (`kernels.pdl`) before their first load.

`rows_linear_reference` is the plain-torch function it computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tlt_rt.codegen.kernels import pdl as pdl_module
from tlt_rt.codegen.kernels.epilogue import bias_swiglu
from tlt_rt.codegen.kernels.operands import weight_fits
from tlt_rt.codegen.kernels.paged import num_sms, split_counters
from tlt_rt.codegen.kernels.pdl import enter, interpreting, launch_meta, leave

__all__ = ["MAX_ROWS", "MIN_ROWS", "ROWS_META", "rows_linear", "rows_linear_reference", "rows_programs", "supported"]

MIN_ROWS, MAX_ROWS = 9, 64  # 2-8 rows stay on CUDA cores (skinny_gemm) or cuBLAS; a block of 16 is tl.dot's least
# Launch meta: a program's weight rows (the MMA's M: 64 = one warpgroup's tile), K per pipeline stage, stages in
# flight (fewer where they would not fit SMEM_BYTES), the launch's programs (0: as many as are resident at once,
# from the shared memory each takes) and the fewest tiles a program streams (fewer programs where a small weight would
# give each less: q/k/v and o at batch 32 spent more on shared blocks' sums than on their one or two tiles).
ROWS_META = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "programs": 0, "min_tiles": 1}
SMEM_BYTES = 200 << 10  # of an SM's 227 KB (H100 / H200) for the pipeline's stages; the rest the epilogue's
MAX_PER_SM = 4


@triton.jit
def _mma(w, xt, acc, PRODUCTS: tl.constexpr):
    """acc += w [BLOCK_N, BLOCK_K] . xt [BLOCK_K, BLOCK_M]: 16-bit operands as loaded (PRODUCTS 0), or IEEE fp32
    products (1: fp32 weights, and the interpreter, whose 16-bit dot is unreliable)."""
    if PRODUCTS == 0:
        return tl.dot(w, xt, acc)
    return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _finish(acc, acc_up, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, stride_ym, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    """Store rows rm, columns rn of y from the transposed fp32 sums acc [BLOCK_N, BLOCK_M] (acc_up: the up half's),
    through the decode kernels' shared epilogue (`epilogue.bias_swiglu`)."""
    out = bias_swiglu(tl.trans(acc), tl.trans(acc_up), b_ptr, y_ptr, rn, n_ok, N, HAS_BIAS, SWIGLU)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def _owner(it, programs, total):
    """The program whose range holds iteration `it`: program p takes iterations [p * total // programs,
    (p + 1) * total // programs)."""
    return ((it + 1) * programs - 1) // total


@triton.jit
def _reduce(nb, first, last, part_ptr, b_ptr, y_ptr, rm, m_ok, N, k_tiles, total, stride_ym, HAS_BIAS: tl.constexpr,
            SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Sum the partials of n-block `nb`, shared by programs first..last, in program order (program p's is its slot 0
    where its run begins inside the block, else its slot 1: the run ends inside it) and store the block's rows of y."""
    programs = tl.num_programs(0)
    rows = 2 * BLOCK_N if SWIGLU else BLOCK_N
    r = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for p in range(first, last + 1):
        slot = tl.where(p * total // programs > nb * k_tiles, 0, 1)
        part = part_ptr + ((p * 2 + slot) * rows + r).to(tl.int64)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        acc += tl.load(part, cache_modifier=".cg")
        if SWIGLU:
            acc_up += tl.load(part + BLOCK_N * BLOCK_M, cache_modifier=".cg")
    rn = nb * BLOCK_N + r
    _finish(acc, acc_up, b_ptr, y_ptr, rm, rn, m_ok, rn < N, N, stride_ym, HAS_BIAS, SWIGLU)


@triton.jit
def _count_in(nb, count_ptr, part_ptr, b_ptr, y_ptr, rm, m_ok, N, k_tiles, total, stride_ym, HAS_BIAS: tl.constexpr,
              SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Count this program's stored partial of block `nb` in (nothing where nb < 0); the last of the block's
    programs to arrive sums their partials and stores the block."""
    if nb >= 0:
        tl.debug_barrier()  # every thread's partial stored before the (release) count
        arrived = tl.atomic_add(count_ptr + nb, 1, sem="acq_rel", scope="gpu")
        programs = tl.num_programs(0)
        first = _owner(nb * k_tiles, programs, total)
        last = _owner((nb + 1) * k_tiles - 1, programs, total)
        if arrived == last - first:
            tl.store(count_ptr + nb, 0)
            _reduce(nb, first, last, part_ptr, b_ptr, y_ptr, rm, m_ok, N, k_tiles, total, stride_ym, HAS_BIAS, SWIGLU,
                    BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit(do_not_specialize=["k_tiles", "total"])
def _rows_kernel(
    # pointers
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] ([2N, K]: stacked [gate; up] with SWIGLU)
    b_ptr,  # [N] ([2N]) with HAS_BIAS
    y_ptr,  # [M, N]
    part_ptr,  # [programs, 2, BLOCK_N (2 BLOCK_N with SWIGLU), BLOCK_M] fp32: each program's first and last partial
    count_ptr,  # [>= N / BLOCK_N] int32 arrival counters, zero between launches (both unread where no block is shared)
    # sizes
    M,
    N,
    K,
    k_tiles,  # BLOCK_K tiles of K
    total,  # n-blocks x k_tiles: the launch's iterations, shared evenly by its programs
    # strides
    stride_xm,
    stride_wn,
    stride_ym,
    # meta
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRODUCTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Iteration it = (n-block nb, K tile kt) = divmod(it, k_tiles); each program takes an equal run of iterations
    (whole blocks stored as they end, a block shared with a neighbour stored as a partial and summed by the last
    of its programs to arrive), so every SM streams the same share of the weight whatever its shape."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    start = pid * total // programs
    end = (pid + 1) * total // programs
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    r = tl.arange(0, BLOCK_N)
    m_ok = rm < M
    rows = 2 * BLOCK_N if SWIGLU else BLOCK_N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # SWIGLU: rows N + rn of W (the up half)
    shared_first = -1  # the block of this program's first partial (its run began inside it; -1: none)
    shared_last = -1  # the block of its last partial (its run ends inside it)
    enter(PDL)
    # no atomics or barriers in this loop (they would keep the compiler from pipelining its loads): partials are
    # counted in after it
    for it in tl.range(start, end, num_stages=NUM_STAGES):
        nb = it // k_tiles
        kt = it - nb * k_tiles
        rn = nb * BLOCK_N + r
        # rows past N read row N - 1 (no mask along N in the loop); their sums are never stored
        w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
        kk = kt * BLOCK_K + rk
        k_ok = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
        acc = _mma(w, tl.trans(x), acc, PRODUCTS)
        if SWIGLU:
            w_up = tl.load(w_rows + N * stride_wn + kk[None, :], mask=k_ok[None, :], other=0.0)
            acc_up = _mma(w_up, tl.trans(x), acc_up, PRODUCTS)
        if (kt == k_tiles - 1) | (it == end - 1):  # the end of this program's run in block nb
            block_lo = nb * k_tiles
            if (block_lo >= start) & (kt == k_tiles - 1):  # the whole block: store it
                _finish(acc, acc_up, b_ptr, y_ptr, rm, rn, m_ok, rn < N, N, stride_ym, HAS_BIAS, SWIGLU)
            else:
                slot = tl.where(start > block_lo, 0, 1)  # 0: the run began inside this block, 1: it ends inside it
                part = part_ptr + ((pid * 2 + slot) * rows + r).to(tl.int64)[:, None] * BLOCK_M + rm[None, :]
                tl.store(part, acc)
                if SWIGLU:
                    tl.store(part + BLOCK_N * BLOCK_M, acc_up)
                if slot == 0:
                    shared_first = nb
                else:
                    shared_last = nb
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    leave(PDL)
    _count_in(shared_first, count_ptr, part_ptr, b_ptr, y_ptr, rm, m_ok, N, k_tiles, total, stride_ym, HAS_BIAS,
              SWIGLU, BLOCK_M, BLOCK_N)  # fmt: skip
    _count_in(shared_last, count_ptr, part_ptr, b_ptr, y_ptr, rm, m_ok, N, k_tiles, total, stride_ym, HAS_BIAS,
              SWIGLU, BLOCK_M, BLOCK_N)  # fmt: skip


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True where the kernel applies: MIN_ROWS-MAX_ROWS rows of a 16-bit type (fp32 under the interpreter), at
    least 16 elements a row, a row-contiguous weight of the same dtype, a Triton device."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    dtypes = (torch.float16, torch.bfloat16, torch.float32) if interpreting() else (torch.float16, torch.bfloat16)
    return (
        (x.is_cuda or interpreting())
        and x.dtype in dtypes
        and MIN_ROWS <= rows <= MAX_ROWS
        and x.shape[-1] >= 16
        and weight_fits(x, weight, bias)
    )


def stage_bytes(block_m: int, block_n: int, block_k: int, swiglu: bool, itemsize: int = 2) -> int:
    """Shared memory of one pipeline stage: the weight tile (both halves' with SwiGLU) and the rows' tile."""
    return (block_n * block_k * (2 if swiglu else 1) + block_m * block_k) * itemsize


def rows_programs(n_blocks: int, k_tiles: int, sms: int, per_sm: int, programs: int = 0, min_tiles: int = 1) -> int:
    """Programs of a launch over `n_blocks` x `k_tiles` iterations: `programs` where given, else `per_sm` on each
    of `sms` SMs (every program resident at once: one wave); never so many that a program gets fewer than
    `min_tiles` iterations, nor fewer than one."""
    return max(1, min(n_blocks * k_tiles // max(1, min_tiles), programs or sms * per_sm))


def rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    pdl: bool | int = False,
    meta: dict | None = None,
) -> torch.Tensor:
    """x [..., K] (MIN_ROWS-MAX_ROWS rows) @ weight [N, K]^T (+ bias) -> [..., N]; with swiglu the weight is a
    stacked [gate; up] ([2I, K]) and the result silu(x @ gate^T) * (x @ up^T), [..., I]. pdl: launched with
    programmatic dependent launch (`kernels.pdl`) where the device has it. meta: ROWS_META's keys."""
    if not supported(x, weight, bias):
        raise ValueError(
            f"rows_linear needs {MIN_ROWS}-{MAX_ROWS} rows of a 16-bit type, rows of >= 16 elements and a weight [N, "
            f"K] of the same dtype with unit stride along K; got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype} stride {weight.stride()}"
        )
    cfg = {**ROWS_META, **(meta or {})}
    n, k = weight.shape
    if swiglu:
        if n % 2:
            raise ValueError(f"swiglu needs a stacked [gate; up] weight with an even row count, got {n}")
        n //= 2
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    block_n, block_k = cfg["block_n"], min(cfg["block_k"], max(16, triton.next_power_of_2(k)))
    stage = stage_bytes(block_m, block_n, block_k, swiglu, x.element_size())
    stages = max(1, min(cfg["num_stages"], SMEM_BYTES // stage))  # as many as fit (the verify's 64 rows take more)
    n_blocks, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    per_sm = max(1, min(MAX_PER_SM, SMEM_BYTES // (stage * stages)))
    programs = rows_programs(n_blocks, k_tiles, num_sms(x.device), per_sm, cfg["programs"], cfg["min_tiles"])
    if n_blocks * k_tiles < 2 * programs:  # runs of one tile or so: nothing to pipeline (Triton 3.6's pipeliner
        stages = 1  # failed to compile a one-tile launch, H200, a tiny model's step in tests/test_pdl_gpu.py)
    shared = k_tiles > 1 and n_blocks % programs != 0  # some run begins or ends inside a block
    counters = split_counters(x.device, n_blocks) if shared else None
    if shared and counters is None:  # while capturing, no counters yet: whole blocks a program
        programs, shared = n_blocks, False
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partials = y  # read only where a block is shared
    if shared:
        partials = torch.empty((programs, 2, 2 * block_n if swiglu else block_n, block_m), dtype=torch.float32,
                               device=x.device)  # fmt: skip
    _rows_kernel[(programs,)](
        x2, weight, bias if bias is not None else weight, y, partials, counters if shared else y,
        m, n, k, k_tiles, n_blocks * k_tiles,
        x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SWIGLU=swiglu,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
        # not this module's `interpreting`, which the compile check lifts to launch on CPU tensors
        PRODUCTS=0 if x.dtype != torch.float32 and not pdl_module.interpreting() else 1,
        num_warps=cfg["num_warps"],
        **launch_meta(x2.device, pdl),
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)


def rows_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False
) -> torch.Tensor:
    """What `rows_linear` computes, in plain torch (fp32 sums, the SwiGLU halves rounded to x's dtype first)."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if not swiglu:
        return y.to(x.dtype)
    gate, up = y.to(x.dtype).float().chunk(2, dim=-1)
    return (F.silu(gate).to(x.dtype).float() * up).to(x.dtype)
