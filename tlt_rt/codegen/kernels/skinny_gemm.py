"""Skinny matmul for decode: y [M, N] = x [M, K] @ W[N, K]^T (+ bias), with M a handful of rows.

At decode the activations are a few rows and the weight is read once per step: the step is as fast as
the weight streams from HBM. Each program owns BLOCK_N output columns, streams its [BLOCK_N, K] slab of
W (rows contiguous along K, as nn.Linear stores them) in BLOCK_K tiles and multiplies every tile by all
M rows of x at once, accumulating in float32; no split-K, so there is no second pass and no atomics. Where the
slab fits a thread's registers (`row_tiles`) it is loaded whole instead, every load issued at once (before the
PDL wait): one padded tile for rows within BLOCK_K, power-of-two pieces for wider ones.
Up to 8 rows the products run on CUDA cores (a tile's arithmetic intensity is M flops per weight element, far
from what tensor cores need at M <= 8), one row's in the layout the slab was loaded in (ROW_FLAT); 9-64 rows of
16-bit weights on tensor cores (`products`). The kernel takes M <= MAX_ROWS (MAX_DOT_ROWS of 16-bit types), but
`skinny_linear` sends it only what it wins: one row against a weight of at least MIN_WEIGHT elements (and,
where a caller asks for more rows, tensor-core rows: a decode chain's batches and verify rows). Measured on an
H100 (bench_linear.py, Qwen2.5-7B shapes, share of the copy bandwidth): one row, gate/up 98% against cuBLAS's
94%, down 88% / 85%, LM head 104% / 96% (L2 helps both), but q/k/v and o (< 20M elements) 67-73% against
71-78%, and at 2-8 rows cuBLAS's tensor-core kernels stay at 72-95% where this one drops under 70%. Everything
else goes to F.linear (more rows, small weights, unsupported dtypes, strided weights, no Triton), so callers
never need to check. In a whole graphed decode step the gain stayed within run-to-run noise, so the engine's
glue uses it only when asked (`model_kernels.KernelGlue(skinny=True)`, `benchmarks/step_costs.py --skinny`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tlt_rt.codegen.kernels import pdl as pdl_module
from tlt_rt.codegen.kernels import rows_gemm
from tlt_rt.codegen.kernels.epilogue import bias_swiglu
from tlt_rt.codegen.kernels.operands import weight_fits
from tlt_rt.codegen.kernels.pdl import enter, interpreting, launch_meta, leave, load_weight, prefetch_rows

__all__ = [
    "MAX_ROWS",
    "MIN_WEIGHT",
    "NARROW_N",
    "ONE_ROW_WIDE",
    "SKINNY_META",
    "preferred",
    "row_pieces",
    "row_tiles",
    "skinny_linear",
    "skinny_linear_triton",
    "skinny_meta",
    "skinny_swiglu",
    "supported",
]

MAX_ROWS = 8  # rows of the CUDA-core products; 16-bit weights take up to MAX_DOT_ROWS on tensor cores
MAX_DOT_ROWS = 64
MIN_WEIGHT = 1 << 25  # elements (64 MB of bf16): smaller weights stay with cuBLAS, see the module doc
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Launch meta-parameters by row class (M rounded up to a power of two); `benchmarks/bench_linear.py --tune`
# sweeps them on a GPU. One row: wide tiles for weights of many rows (gate/up, the head), but a program a row
# where the weight has fewer than NARROW_N rows (q/k/v, o, down of Qwen2.5-Coder-0.5B / 1.5B): there a grid of
# a few hundred 8-row programs cannot keep enough loads in flight (H200, --tune: 1.5B o 3.8 us against 5.0 with
# 8-row programs and cuBLAS's 6.5, down 11.2 against 16.7 and 11.3, q/k/v 4.1 against 5.0 and 5.0).
SKINNY_META = {
    1: {"block_n": 4, "block_k": 2048, "num_warps": 4, "num_stages": 3},
    2: {"block_n": 16, "block_k": 256, "num_warps": 4, "num_stages": 3},
    4: {"block_n": 16, "block_k": 256, "num_warps": 4, "num_stages": 3},
    8: {"block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 3},
}
# 9-64 rows of 16-bit weights, products on tensor cores (`products`): tiles streamed through the software pipeline
# (whole 0); weights of fewer than NARROW_N rows (q/k/v, o, down of the Qwen2.5-Coder shapes) in narrower programs,
# so that more of them share the weight (down: 96 programs of 16 rows, not 48 of 32). First settings: in the step
# 0.42-0.80x of cuBLAS's (H200, 3ace447; too few weight bytes in flight a program), so the chain stays at one row
# (`bench_linear.py --tune --tune-rows 32` and `step_costs.py --compare pdl-rows:dot:bn=..` sweep them).
DOT_META = {"block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 4, "whole": 0}
DOT_NARROW = {"block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 4, "whole": 0}
# Which kernel runs 9-64 rows: "tiles", this module's (the DOT_* launches above), or "split", `kernels.rows_gemm`
# (the weight on the MMA's wide side, K split over programs where the weight has few rows).
DOT_KERNEL = "tiles"


NARROW_N = 8192
# In a PDL step on those shapes (step_costs.py --compare pdl:narrow:..; H200) 2-row programs of 4 warps beat the
# one-row programs of 2 warps tuned in isolation: 1.045x a step on Qwen2.5-Coder-1.5B, 1.016x on 0.5B.
ONE_ROW_NARROW = {"block_n": 2, "block_k": 2048, "num_warps": 4, "num_stages": 2}
# One row against a weight of many rows whose rows fit one tile (gate/up and the head of Qwen2.5-Coder-0.5B / 1.5B):
# 4-row programs of 2 warps, the slab of both halves read whole. With one row's products in the slab's layout
# (ROW_FLAT), in a PDL step (step_costs.py --compare pdl:bn=..,w=..,f=1; H200) 1.018x (1.5B) and 1.024x (0.5B) over
# the 8-row programs of 4 warps tuned before it (which had been 1.02x / 1.08x over 4 rows of 4 warps); 4 rows of 4
# warps, 2 rows, 8 rows of 8 warps: faster on one model, slower on the other.
ONE_ROW_WIDE = {"block_n": 4, "block_k": 2048, "num_warps": 2, "num_stages": 3}


# The products a launch computes (the kernels' PRODUCTS constexpr): broadcast over three dimensions on CUDA cores,
# one row's in the slab's layout (FLAT, where ROW_FLAT), or on tensor cores from 16 rows (DOT_*: operands in the
# weight's 16-bit type, or IEEE fp32 for fp32 weights and under the interpreter, whose 16-bit dot is unreliable).
BROADCAST, FLAT, DOT_BF16, DOT_FP16, DOT_FP32 = 0, 1, 2, 3, 4
DOT_MIN_ROWS = 16  # tl.dot's least M


def products(block_m: int, dtype: torch.dtype) -> int:
    """The PRODUCTS of a launch of `block_m` rows (a power of two) of `dtype` weights."""
    if block_m == 1:
        return FLAT if ROW_FLAT else BROADCAST
    if block_m < DOT_MIN_ROWS:
        return BROADCAST
    if pdl_module.interpreting() or dtype == torch.float32:  # not this module's name, which the compile check lifts
        return DOT_FP32
    return DOT_BF16 if dtype == torch.bfloat16 else DOT_FP16


def one_or_dot(rows: int, dtype: torch.dtype) -> bool:
    """True for one row, or for rows whose products run on tensor cores (from 9 rows of 16-bit weights: a block of
    16): where a decode chain takes a step's matmuls; 2-8 rows stay with cuBLAS (CUDA-core products lose there)."""
    return rows == 1 or (rows <= max_rows(dtype) and products(triton.next_power_of_2(rows), dtype) >= DOT_BF16)


def max_rows(dtype: torch.dtype) -> int:
    """Most rows the kernels take of `dtype` weights: MAX_DOT_ROWS for 16-bit ones (tensor cores), else MAX_ROWS."""
    return MAX_DOT_ROWS if dtype in (torch.float16, torch.bfloat16) else MAX_ROWS


def skinny_meta(rows: int, weight_rows: int, k: int | None = None) -> dict:
    """The launch meta-parameters for `rows` rows of `k` elements (None: wider than one tile) against a weight of
    `weight_rows` rows (a stacked [gate; up] counted whole)."""
    block_m = triton.next_power_of_2(rows)
    if block_m >= DOT_MIN_ROWS:
        return DOT_NARROW if weight_rows < NARROW_N else DOT_META
    if block_m == 1 and weight_rows < NARROW_N:
        return ONE_ROW_NARROW
    if block_m == 1 and k is not None and k <= ONE_ROW_WIDE["block_k"]:
        return ONE_ROW_WIDE
    return SKINNY_META[block_m]


# Most weight elements a thread holds when its program loads rows wider than BLOCK_K whole (meta key "whole"; 0:
# streamed in tiles): 192 takes Qwen2.5-Coder-1.5B's down projection (8,960 over 64 threads), which streamed in
# five tiles cost 0.11 ms more a step (H200, step_costs.py --compare; benchmarks/RESULTS.md).
WHOLE_ELEMS = 192
# One row's products in the slab's own layout (`_slab_products`: no conversion of the slab through shared memory,
# 9 barriers against 43 in the 1.5B's gate/up kernel). In a PDL step (H200, step_costs.py --compare pdl-3d pdl) 1.165x
# on Qwen2.5-Coder-1.5B and 1.093x on 0.5B over products broadcast over three dimensions (False, as for several rows).
ROW_FLAT = True
MAX_PIECES = 4  # a whole row is loaded as at most this many power-of-two pieces (the kernels take four)


def row_pieces(k: int) -> list[int]:
    """K as at most MAX_PIECES power-of-two widths, widest first, covering it: its binary digits (1,536 -> 1,024 +
    512; 8,960 -> 8,192 + 512 + 256), the last piece rounded up where K has more digits (its tail masked)."""
    parts = [1 << b for b in range(k.bit_length() - 1, -1, -1) if k >> b & 1]
    if len(parts) > MAX_PIECES:
        head = parts[: MAX_PIECES - 1]
        parts = [*head, triton.next_power_of_2(k - sum(head))]
    return parts


def row_tiles(k: int, cfg: dict, slab_rows: int) -> dict:
    """A launch's K tiling (BLOCK_K, K1, K2, K3, ONE_TILE) for rows of K elements and a program holding
    `slab_rows` rows of W (BLOCK_N, twice that with SwiGLU's two halves); the rows are read before the PDL wait
    where ONE_TILE. K within one BLOCK_K tile: one tile, padded to a power of two (pieces of it measured slower
    with products over three dimensions: each is a reduction across the program's threads of its own), or with
    cfg["pieces"] in its `row_pieces` (1,536 as 1,024 + 512: no padded registers; with ROW_FLAT 0.98x / 0.84x a step on
    Qwen2.5-Coder-1.5B / 0.5B, H200, 3ace447: off);
    wider rows whole, in the pieces of `row_pieces` all issued at once, where the slab fits cfg["whole"]
    (WHOLE_ELEMS) elements a thread; else streamed in BLOCK_K tiles."""
    block_k = min(cfg["block_k"], triton.next_power_of_2(k))
    if k <= block_k and not (cfg.get("pieces") and k & (k - 1)):
        return {"BLOCK_K": block_k, "K1": 0, "K2": 0, "K3": 0, "ONE_TILE": True}
    pieces = row_pieces(k)
    if k <= block_k:  # within one tile, in pieces (cfg["pieces"]): never more elements than the padded tile
        pieces += [0] * (MAX_PIECES - len(pieces))
        return {"BLOCK_K": pieces[0], "K1": pieces[1], "K2": pieces[2], "K3": pieces[3], "ONE_TILE": True}
    if slab_rows * sum(pieces) <= cfg.get("whole", WHOLE_ELEMS) * 32 * cfg["num_warps"]:
        pieces += [0] * (MAX_PIECES - len(pieces))  # unused piece widths 0
        return {"BLOCK_K": pieces[0], "K1": pieces[1], "K2": pieces[2], "K3": pieces[3], "ONE_TILE": True}
    return {"BLOCK_K": block_k, "K1": 0, "K2": 0, "K3": 0, "ONE_TILE": False}


def launch_kind(weight_rows: int, k: int, tiles: dict) -> str:
    """The launch's class for `pdl.SIGNAL_FIRST`: "long" (rows wider than one tile), else "narrow" / "wide" (a
    weight of fewer / at least NARROW_N rows)."""
    if tiles["K1"] or not tiles["ONE_TILE"] or k > tiles["BLOCK_K"]:
        return "long"
    return "narrow" if weight_rows < NARROW_N else "wide"


@triton.jit
def _tile_products(x, tile, w_mask, N, stride_wn, acc, acc_up, SWIGLU: tl.constexpr, PRODUCTS: tl.constexpr):
    """acc += x . W-tile for rows x [M, BLOCK_K] (float32) and the [BLOCK_N, BLOCK_K] tile of W at `tile`; with
    SWIGLU also acc_up += x . the tile N rows further down (the up half of a stacked [gate; up] weight)."""
    w = tl.load(tile, mask=w_mask, other=0.0).to(tl.float32)
    w_up = w
    if SWIGLU:
        w_up = tl.load(tile + N * stride_wn, mask=w_mask, other=0.0).to(tl.float32)
    return _slab_products(x, w, w_up, acc, acc_up, SWIGLU, PRODUCTS)


@triton.jit
def _prefetch_slab(w_ptr, rn, N, K, stride_wn, SWIGLU: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr):
    """This program's rows of W into L2 (`pdl.prefetch_rows`); with SWIGLU the up half's rows too."""
    rows = tl.minimum(rn, N - 1)
    prefetch_rows(w_ptr, rows, stride_wn, K, LINE, LINES)
    if SWIGLU:
        prefetch_rows(w_ptr + N * stride_wn, rows, stride_wn, K, LINE, LINES)


@triton.jit
def _load_slab(w_ptr, rn, rk, n_ok, k_ok, N, stride_wn, SWIGLU: tl.constexpr):
    """This program's [BLOCK_N, BLOCK_K] rows of W, fp32 (the up half's too with SWIGLU, else a copy of the first):
    weight loads a kernel may issue before its PDL wait."""
    tile = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    mask = n_ok[:, None] & k_ok[None, :]
    w = load_weight(tile, mask).to(tl.float32)
    w_up = w
    if SWIGLU:
        w_up = load_weight(tile + N * stride_wn, mask).to(tl.float32)
    return w, w_up


@triton.jit
def _load_piece(w_ptr, rn, n_ok, N, K, stride_wn, START: tl.constexpr, SIZE: tl.constexpr, SWIGLU: tl.constexpr):
    """Columns START .. START + SIZE of this program's rows of W (`_load_slab`, masked at K); (0.0, 0.0) for an
    absent piece (SIZE 0)."""
    if SIZE > 0:
        rk = START + tl.arange(0, SIZE)
        w, w_up = _load_slab(w_ptr, rn, rk, n_ok, rk < K, N, stride_wn, SWIGLU)
    else:
        w = 0.0
        w_up = 0.0
    return w, w_up


@triton.jit
def _load_pieces(
    w_ptr, rn, n_ok, N, K, stride_wn, BLOCK_K: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    SWIGLU: tl.constexpr,
):  # fmt: skip
    """This program's whole rows of W in `row_tiles`' pieces (BLOCK_K, K1, K2, K3 columns, one after the other):
    (w0, u0, w1, u1, w2, u2, w3, u3), each `_load_piece`'s pair; every load issued at once."""
    w0, u0 = _load_piece(w_ptr, rn, n_ok, N, K, stride_wn, 0, BLOCK_K, SWIGLU)
    w1, u1 = _load_piece(w_ptr, rn, n_ok, N, K, stride_wn, BLOCK_K, K1, SWIGLU)
    w2, u2 = _load_piece(w_ptr, rn, n_ok, N, K, stride_wn, BLOCK_K + K1, K2, SWIGLU)
    w3, u3 = _load_piece(w_ptr, rn, n_ok, N, K, stride_wn, BLOCK_K + K1 + K2, K3, SWIGLU)
    return w0, u0, w1, u1, w2, u2, w3, u3


@triton.jit
def _piece_products(
    x_ptr, rm, m_ok, K, stride_xm, w, w_up, acc, acc_up, START: tl.constexpr, SIZE: tl.constexpr,
    SWIGLU: tl.constexpr, PRODUCTS: tl.constexpr,
):  # fmt: skip
    """acc (acc_up) += rows rm of x, columns START .. START + SIZE, times a loaded piece of W (`_load_piece`)."""
    if SIZE > 0:
        rk = START + tl.arange(0, SIZE)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
        acc, acc_up = _slab_products(x.to(tl.float32), w, w_up, acc, acc_up, SWIGLU, PRODUCTS)
    return acc, acc_up


@triton.jit
def _dot(x, w, PRODUCTS: tl.constexpr):
    """x [M, BLOCK_K] . w [BLOCK_N, BLOCK_K]^T on tensor cores, fp32 out: operands as bf16 (PRODUCTS 2, DOT_BF16)
    or fp16 (3, DOT_FP16), exact as the values came from that type, or fp32 (4, DOT_FP32: IEEE products)."""
    if PRODUCTS == 2:
        return tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    elif PRODUCTS == 3:
        return tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)))
    else:
        return tl.dot(x, tl.trans(w), input_precision="ieee")


@triton.jit
def _slab_products(x, w, w_up, acc, acc_up, SWIGLU: tl.constexpr, PRODUCTS: tl.constexpr):
    """acc += x . w for rows x [M, BLOCK_K] (fp32) and a loaded slab w [BLOCK_N, BLOCK_K]; acc_up with w_up, as
    `products` chose: FLAT (one row) in the slab's own layout, reduced along its rows; DOT_* (16 rows and more) on
    tensor cores; else (BROADCAST) over a [M, BLOCK_N, BLOCK_K] product, whose layout the compiler gives one element
    a thread, so the slab is first converted to it through shared memory (43 barriers in the one-row gate/up kernel
    of Qwen2.5-Coder-1.5B's shape)."""
    if PRODUCTS >= 2:
        acc += _dot(x, w, PRODUCTS)
        if SWIGLU:
            acc_up += _dot(x, w_up, PRODUCTS)
    elif PRODUCTS == 1:
        row = tl.sum(x, axis=0)  # the one row, [BLOCK_K]
        acc += tl.sum(w * row[None, :], axis=1)[None, :]
        if SWIGLU:
            acc_up += tl.sum(w_up * row[None, :], axis=1)[None, :]
    else:
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if SWIGLU:
            acc_up += tl.sum(x[:, None, :] * w_up[None, :, :], axis=2)
    return acc, acc_up


@triton.jit
def _row_products(
    x_ptr, w_ptr, rm, rn, m_ok, n_ok, N, K, stride_xm, stride_wn, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr,
    LINES: tl.constexpr, ONE_TILE: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    PRODUCTS: tl.constexpr,
):  # fmt: skip
    """(acc, acc_up): rows rm of x times rows rn of W (and rows N + rn, the up half, with SWIGLU), fp32, for a program
    of a matrix-vector kernel, with its PDL wait (`enter`) and signal (`leave`) around the loads of x. ONE_TILE: rows
    in pieces of BLOCK_K, K1, K2, K3 columns (`row_tiles`), loaded at once; else streamed in BLOCK_K tiles."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SWIGLU: rows N + rn of W (the up half)
    if ONE_TILE:  # the whole slab of W in registers (`row_tiles`' pieces), loaded before the wait (kernels.pdl)
        w0, u0, w1, u1, w2, u2, w3, u3 = _load_pieces(w_ptr, rn, n_ok, N, K, stride_wn, BLOCK_K, K1, K2, K3, SWIGLU)
        enter(PDL)
        P1: tl.constexpr = BLOCK_K
        P2: tl.constexpr = BLOCK_K + K1
        P3: tl.constexpr = BLOCK_K + K1 + K2
        acc, acc_up = _piece_products(x_ptr, rm, m_ok, K, stride_xm, w0, u0, acc, acc_up, 0, BLOCK_K, SWIGLU, PRODUCTS)
        acc, acc_up = _piece_products(x_ptr, rm, m_ok, K, stride_xm, w1, u1, acc, acc_up, P1, K1, SWIGLU, PRODUCTS)
        acc, acc_up = _piece_products(x_ptr, rm, m_ok, K, stride_xm, w2, u2, acc, acc_up, P2, K2, SWIGLU, PRODUCTS)
        acc, acc_up = _piece_products(x_ptr, rm, m_ok, K, stride_xm, w3, u3, acc, acc_up, P3, K3, SWIGLU, PRODUCTS)
    else:
        if PREFETCH:  # the slab of W (both halves with SWIGLU) into L2 while the kernel before still runs
            _prefetch_slab(w_ptr, rn, N, K, stride_wn, SWIGLU, LINE, LINES)
        enter(PDL)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            tile = w_ptr + rn[:, None] * stride_wn + kk[None, :]
            acc, acc_up = _tile_products(x.to(tl.float32), tile, n_ok[:, None] & k_ok[None, :], N, stride_wn, acc,
                                         acc_up, SWIGLU, PRODUCTS)  # fmt: skip
    leave(PDL)
    return acc, acc_up


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    LINE: tl.constexpr,
    LINES: tl.constexpr,
    ONE_TILE: tl.constexpr,
    K1: tl.constexpr,
    K2: tl.constexpr,
    K3: tl.constexpr,
    PRODUCTS: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    acc, acc_up = _row_products(x_ptr, w_ptr, rm, rn, m_ok, n_ok, N, K, stride_xm, stride_wn, SWIGLU, BLOCK_M,
                                BLOCK_N, BLOCK_K, PDL, PREFETCH, LINE, LINES, ONE_TILE, K1, K2, K3,
                                PRODUCTS)  # fmt: skip
    acc = bias_swiglu(acc, acc_up, b_ptr, y_ptr, rn, n_ok, N, HAS_BIAS, SWIGLU)
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True where the kernel applies: <= MAX_ROWS rows (MAX_DOT_ROWS of 16-bit types, rows of at least 16 elements
    past MAX_ROWS: tensor-core tiles), a row-contiguous weight, one dtype, a Triton device."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        (x.is_cuda or interpreting())
        and x.dtype in SUPPORTED_DTYPES
        and 0 < rows <= max_rows(x.dtype)
        and (rows <= MAX_ROWS or x.shape[-1] >= DOT_MIN_ROWS)
        and weight_fits(x, weight, bias)
    )


def skinny_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    meta: dict | None = None,
    swiglu: bool = False,
    pdl: bool = False,
    prefetch: bool = False,
) -> torch.Tensor:
    """The kernel itself (no fallback): x [..., K] with <= MAX_ROWS rows (MAX_DOT_ROWS of a 16-bit type), weight
    [N, K] -> [..., N].

    swiglu: weight is [gate; up] stacked ([2I, K], as a fused gate/up projection) and the result is
    silu(x @ gate^T) * (x @ up^T), [..., I], without the [..., 2I] intermediate.
    pdl: launched with programmatic dependent launch (`kernels.pdl`) where the device has it; prefetch: with pdl,
    the program's slab of W pulled into L2 before it waits for the kernel before."""
    if not supported(x, weight, bias):
        raise ValueError(
            f"skinny_linear_triton needs <= {MAX_ROWS} rows of {SUPPORTED_DTYPES} ({MAX_DOT_ROWS} of 16-bit types), "
            "a weight [N, K] with unit "
            f"stride along K of the same dtype; got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype} stride {weight.stride()}"
        )
    n, k = weight.shape
    if swiglu:
        if n % 2:
            raise ValueError(f"swiglu needs a stacked [gate; up] weight with an even row count, got {n}")
        n //= 2
    if meta is None and DOT_KERNEL == "split" and rows_gemm.supported(x, weight, bias):
        return rows_gemm.rows_linear(x, weight, bias, swiglu=swiglu, pdl=pdl)
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    block_m = triton.next_power_of_2(m)
    cfg = meta or skinny_meta(m, weight.shape[0], k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["block_n"]),)
    tiles = row_tiles(k, cfg, cfg["block_n"] * (2 if swiglu else 1))
    _skinny_kernel[grid](
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        SWIGLU=swiglu,
        BLOCK_M=block_m,
        BLOCK_N=cfg["block_n"],
        **tiles,
        PRODUCTS=products(block_m, weight.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **launch_meta(x2.device, pdl, weight.dtype, tiles["BLOCK_K"], prefetch, launch_kind(weight.shape[0], k, tiles)),
    )
    return y.view(*x.shape[:-1], n)


def preferred(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    min_weight: int | None = None,
    rows: int = 1,
) -> bool:
    """True where the kernel beats cuBLAS as measured (module doc): one row, a weight of at least `min_weight`
    elements (None: MIN_WEIGHT), `supported`; where a caller asks for up to `rows` rows, also more rows whose
    products run on tensor cores (`one_or_dot`; so far slower than cuBLAS in a step: `DOT_META`)."""
    least = MIN_WEIGHT if min_weight is None else min_weight
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return 0 < m <= rows and one_or_dot(m, x.dtype) and weight.numel() >= least and supported(x, weight, bias)


def skinny_swiglu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pdl: bool = False,
    prefetch: bool = False,
    min_weight: int | None = None,
    rows: int = 1,
) -> torch.Tensor | None:
    """silu(gate) * up from a stacked [gate; up] weight in one kernel where it wins (`preferred`, up to `rows`
    rows); None elsewhere (the caller runs its matmul and activation). pdl, prefetch: as `skinny_linear_triton`'s."""
    if preferred(x, weight, bias, min_weight, rows) and weight.shape[0] % 2 == 0:
        return skinny_linear_triton(x, weight, bias, swiglu=True, pdl=pdl, prefetch=prefetch)
    return None


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pdl: bool = False,
    prefetch: bool = False,
    min_weight: int | None = None,
    rows: int = 1,
) -> torch.Tensor:
    """F.linear with the skinny kernel where it wins (`preferred`: weights from `min_weight` elements, up to `rows`
    rows), F.linear elsewhere. pdl, prefetch: as `skinny_linear_triton`'s."""
    if preferred(x, weight, bias, min_weight, rows):
        return skinny_linear_triton(x, weight, bias, pdl=pdl, prefetch=prefetch)
    return F.linear(x, weight, bias)
