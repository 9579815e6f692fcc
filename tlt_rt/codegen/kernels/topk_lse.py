"""Top-k log-probabilities of each row of logits in two launches: what a draft level needs to grow its tree.

    logp, tokens = topk_logprobs(logits, k)      # logits [R, V] -> log-probs [R, k] f32, tokens [R, k] int64
    logp, tokens = topk_logprobs(logits, k, id_map=d2t)   # tokens mapped: d2t[t_j] (a reduced draft head)

    logp[r, j] = x[r, t_j] - log sum_v exp(x[r, v]),   x[r, t_0] >= x[r, t_1] >= ... (ties: the lower id first)

A draft level scores its R = B*K frontier rows over the whole vocabulary. torch does that as a top-k
(a radix select of ~7 launches over [R, V]) and a log-sum-exp (float copy, max, exp, sum, log). Here the
first kernel gives each (row, chunk of BLOCK_V logits) program its chunk's k best logits (k rounds of a
max, lowest id on ties) and the chunk's max and sum of exp; the second merges a row's chunks: the same
k rounds over the chunks' candidates, and the log-sum-exp from the chunks' (max, sum). Logits are read
once. With `id_map` (a reduced draft vocabulary's draft -> target ids) the merge writes the mapped ids,
which saves a draft level the gather launch of its own. A row of -inf logits (a reduced draft vocabulary
scattered to the full one) is safe: its chunks give -inf candidates and a zero sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

DEFAULT_BLOCK_V = 4096
MAX_K = 16


@triton.jit
def _topk_chunk_kernel(
    # pointers
    X,  # [R, V] logits, unit stride over V
    CAND_V,  # [R, NC, K] f32 the chunk's k best logits
    CAND_I,  # [R, NC, K] int64 their token ids
    CHUNK_M,  # [R, NC] f32 the chunk's max
    CHUNK_S,  # [R, NC] f32 sum of exp(x - max) over the chunk
    # sizes
    V,
    NC,
    # strides
    stride_x,
    # meta
    K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(X + row * stride_x + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    s = tl.sum(tl.exp(x - m_safe), axis=0)
    slot = row * NC + chunk
    tl.store(CHUNK_M + slot, m)
    tl.store(CHUNK_S + slot, s)
    for j in tl.static_range(K):
        best = tl.max(x, axis=0)
        at = tl.min(tl.where(x == best, offs, V + BLOCK_V), axis=0)  # the lowest id among the maxima
        tl.store(CAND_V + slot * K + j, best)
        tl.store(CAND_I + slot * K + j, at)
        x = tl.where(offs == at, -float("inf"), x)


@triton.jit
def _topk_merge_kernel(
    # pointers
    CAND_V,
    CAND_I,
    CHUNK_M,
    CHUNK_S,
    OUT_LP,  # [R, K] f32
    OUT_I,  # [R, K] int64
    ID_MAP,  # [V] int64 id -> output id (read when HAS_MAP)
    # sizes
    NC,
    BIG,  # an id past every real one
    # meta
    K: tl.constexpr,
    BLOCK_NC: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_NC)
    m = tl.load(CHUNK_M + row * NC + c, mask=c < NC, other=-float("inf"))
    s = tl.load(CHUNK_S + row * NC + c, mask=c < NC, other=0.0)
    big_m = tl.max(m, axis=0)
    big_m = tl.where(big_m == -float("inf"), 0.0, big_m)
    lse = big_m + tl.log(tl.sum(s * tl.exp(m - big_m), axis=0))
    n = tl.arange(0, BLOCK_C)
    v = tl.load(CAND_V + row * NC * K + n, mask=n < NC * K, other=-float("inf"))
    ids = tl.load(CAND_I + row * NC * K + n, mask=n < NC * K, other=BIG)
    for j in tl.static_range(K):
        best = tl.max(v, axis=0)
        at = tl.min(tl.where(v == best, ids, BIG), axis=0)
        tl.store(OUT_LP + row * K + j, best - lse)
        if HAS_MAP:
            tl.store(OUT_I + row * K + j, tl.load(ID_MAP + at))
        else:
            tl.store(OUT_I + row * K + j, at)
        v = tl.where((v == best) & (ids == at), -float("inf"), v)


def topk_logprobs(
    logits: Tensor, k: int, block_v: int | None = None, id_map: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """logits [R, V] (f32 / bf16 / f16, unit stride over V) -> (log-probs [R, k] f32 descending, token ids
    [R, k] int64; `id_map[id]` instead where an int64 map [V] on the logits' device is given). Two launches,
    no host sync (graph-capturable)."""
    assert logits.dim() == 2, f"logits must be [R, V], got shape {tuple(logits.shape)}"
    assert logits.stride(-1) == 1, f"logits must have unit stride over V, got strides {logits.stride()}"
    R, V = logits.shape
    assert 1 <= k <= min(V, MAX_K), f"k must be in [1, {min(V, MAX_K)}], got {k}"
    if id_map is not None:
        assert id_map.shape == (V,) and id_map.dtype == torch.int64 and id_map.device == logits.device, (
            f"id_map must be int64 [{V}] on {logits.device}, "
            f"got {id_map.dtype} {tuple(id_map.shape)} on {id_map.device}"
        )
        id_map = id_map.contiguous()
    dev = logits.device
    if R == 0:
        return torch.empty(0, k, device=dev), torch.empty(0, k, dtype=torch.int64, device=dev)
    # launch 1: every (row, chunk of block_v ids)'s k best logits and its (max, sum of exp(x - max))
    block_v = min(triton.next_power_of_2(V), block_v or DEFAULT_BLOCK_V)
    nc = triton.cdiv(V, block_v)
    cand_v = torch.empty(R, nc, k, dtype=torch.float32, device=dev)
    cand_i = torch.empty(R, nc, k, dtype=torch.int64, device=dev)
    chunk_m = torch.empty(R, nc, dtype=torch.float32, device=dev)
    chunk_s = torch.empty(R, nc, dtype=torch.float32, device=dev)
    _topk_chunk_kernel[(R, nc)](
        logits, cand_v, cand_i, chunk_m, chunk_s,
        V, nc,
        logits.stride(0),
        K=k, BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
    )  # fmt: skip
    # launch 2: each row's k best over its chunks, less the log-sum-exp the chunks' (max, sum) give
    out_lp = torch.empty(R, k, dtype=torch.float32, device=dev)
    out_i = torch.empty(R, k, dtype=torch.int64, device=dev)
    _topk_merge_kernel[(R,)](
        cand_v, cand_i, chunk_m, chunk_s, out_lp, out_i, out_i if id_map is None else id_map,
        nc, V + block_v,
        K=k, BLOCK_NC=max(16, triton.next_power_of_2(nc)), BLOCK_C=max(16, triton.next_power_of_2(nc * k)),
        HAS_MAP=id_map is not None, num_warps=1,
    )  # fmt: skip
    return out_lp, out_i


def topk_logprobs_reference(logits: Tensor, k: int, id_map: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The same in torch: top-k of the logits less their log-sum-exp (ties in torch.topk's order)."""
    vals, ids = torch.topk(logits, k, dim=-1, sorted=True)
    return vals.float() - torch.logsumexp(logits.float(), -1, keepdim=True), ids if id_map is None else id_map[ids]
