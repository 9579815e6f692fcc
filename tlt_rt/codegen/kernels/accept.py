"""Tree acceptance for speculative decoding: walk the verified draft tree, greedy or exact sampling.

B sequences, T tree nodes, D = max depth, V vocab. logits [B, T, V]: row i is the target's prediction of
the token after node i. tree_tokens [B, T]: node 0 is the root (the last emitted token), nodes 1.. are
drafts; parents [B, T]: parents[:, 0] = -1 and 0 <= parents[:, i] < i. uniforms [B, D+1, 2] in [0, 1):
u[d, 0] drives the accept scan at depth d, u[d, 1] the correction/bonus draw at depth d.

With cur = root, d = 0, p the filtered target distribution at cur (`sampling.py`: temperature, top-k,
top-p; raw softmax for greedy rows) and children c_1 < ... < c_m of cur (none once d = D):

    greedy    t = argmax_v logits[cur, v] (lowest id on ties); accept the first child with token t,
              else emit t as the bonus.
    sampled   accept the first c_j with  u[d, 0] < sum_{i <= j} p(tok(c_i)) [c_i is the first sibling
              with its token];  else bonus = the smallest v with r(v) > 0 and
              sum_{w <= v} r(w) > u[d, 1] * sum_w r(w),  r = p with the children's tokens removed.
    accepted  cur = c_j, d += 1, repeat.

Lossless: child j is accepted with probability p(tok(c_j)), and the bonus after rejecting all children
(probability 1 - sum_j p(tok(c_j))) is drawn from p restricted to the remaining tokens, so every emitted
token is distributed exactly as p. Rounding guards, shared with the reference: if the residual mass is
<= 0 the bonus is drawn from p itself; if the inverse CDF runs off the end, the largest residual token;
if no residual token remains, the argmax. With x the row's logits, s = 1 / temperature (1 when greedy):

    logprobs[d] = log p(t) = s (x_t - max x) - log sum_{v kept} exp(s (x_v - max x))

(greedy rows: log_softmax of the raw logits). Kernel and reference agree up to a uniform falling within
float32 rounding of a CDF boundary. The draws are only as fine as a float32 uniform: the bonus resolves
about 2^-24 of the residual mass, so tokens rarer than that are drawn with a relative error ~ 2^-24 / p.

Kernel: one program per sequence walks the tree, levels in order. Each visited node's row is streamed
once in BLOCK_V chunks with per-lane running max / argmax / sum-exp (one exp2 per logit, no barrier in
the loop); the children's logits are gathered and the scan decides. A sampled row that stops streams
its row once more for the bonus: block sums find the block where the CDF crosses the target, and only
that block is scanned; the children's ids are zeroed block by block. Traffic: accept_len + 1 rows (+1
for a sampled bonus), each on one SM, which bounds small batches by per-SM throughput (H100, V = 152k:
~13 us a row). Not fused: top-k / top-p need a per-row threshold from a torch sort of all B*T rows
(`sampling.filter_thresholds`), far costlier than the walk; `filtering=False` skips it. No host sync
on CUDA, so the launcher can be captured in a CUDA graph. The input checks, the filtering choice and the
torch reference the kernel is tested against are in `accept_reference.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tlt_rt.codegen.kernels.accept_reference import (
    AcceptOutput,
    accept_tree_reference,
    check_inputs,
    resolve_filtering,
)
from tlt_rt.codegen.kernels.sampling import filter_thresholds

__all__ = ["AcceptOutput", "accept_tree", "accept_tree_reference"]

DEFAULT_BLOCK_V = 8192  # with 16 warps (32 when all greedy): the fastest on an H100 at V = 49k..152k
_NEG_INF = tl.constexpr(float("-inf"))
_LOWEST = tl.constexpr(-1e30)  # below any real logit, and finite
_LOG2E = tl.constexpr(1.4426950408889634)


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _row_stats(row_ptr, V, thr, scale2, BLOCK_V: tl.constexpr):
    """Stream one row x: raw max mx, its lowest argmax, S = sum_{x_v >= thr} 2^(scale2 (x_v - mx)).

    Per-lane running max m / argmax / sum s, reduced once at the end, so the loop body has no barrier;
    one exp2 per element: with a = 2^(scale2 (min(x, m) - max(x, m))), a new lane max gives s <- s a + k,
    any other x gives s <- s + k a (k = [x >= thr]). Exponents are scale2 (x - max), never a difference
    of scaled values, so no fused multiply-add rounds them apart and the max token adds exactly 1.
    """
    offs0 = tl.arange(0, BLOCK_V)
    m_l = tl.full([BLOCK_V], _LOWEST, tl.float32)  # finite, so a lane of -inf logits never does inf - inf
    i_l = tl.zeros([BLOCK_V], tl.int32)
    s_l = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        x = tl.load(row_ptr + offs, mask=offs < V, other=_NEG_INF).to(tl.float32)
        k = tl.where(x >= thr, 1.0, 0.0)
        up = x > m_l  # strict: each lane keeps its lowest id on ties
        a = tl.exp2((tl.minimum(x, m_l) - tl.maximum(x, m_l)) * scale2)
        s_l = tl.where(up, s_l * a + k, s_l + k * a)
        i_l = tl.where(up, offs, i_l)
        m_l = tl.maximum(m_l, x)
    mx = tl.max(m_l, axis=0)
    amax = tl.min(tl.where(m_l == mx, i_l, V), axis=0)
    s = tl.sum(s_l * tl.exp2((m_l - mx) * scale2), axis=0)
    return mx, amax, s


@triton.jit
def _residual_inverse_cdf(row_ptr, V, mx, thr, scale2, ex_tok, target, fallback, BLOCK_V: tl.constexpr):
    """Smallest v with r(v) > 0 and sum_{w <= v} r(w) > target, r(v) = [x_v >= thr] 2^(scale2 (x_v - mx))
    with the ids in ex_tok [BLOCK_T] (-1: none) zeroed; else the largest v with r(v) > 0; else fallback.
    Block sums locate the crossing; only the block that crosses is scanned."""
    offs0 = tl.arange(0, BLOCK_V)
    carry = tl.full([], 0.0, tl.float32)
    found = tl.full([], 0, tl.int32) + V
    last = tl.full([], -1, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        x = tl.load(row_ptr + offs, mask=offs < V, other=_NEG_INF).to(tl.float32)
        r = tl.where(x >= thr, tl.exp2((x - mx) * scale2), 0.0)
        pending = (ex_tok >= start) & (ex_tok < start + BLOCK_V)  # one step per excluded id in this block
        while tl.max(pending.to(tl.int32), axis=0) > 0:
            t = tl.min(tl.where(pending, ex_tok, V), axis=0)
            r = tl.where(offs == t, 0.0, r)
            pending = pending & (ex_tok != t)
        bsum = tl.sum(r, axis=0)
        if (found == V) & (carry + bsum > target):
            c = tl.cumsum(r, axis=0) + carry
            found = tl.min(tl.where((c > target) & (r > 0), offs, V), axis=0)
        last = tl.maximum(last, tl.max(tl.where(r > 0, offs, -1), axis=0))
        carry += bsum
    return tl.where(found < V, found, tl.where(last >= 0, last, fallback))


@triton.jit
def _accept_tree_kernel(
    # pointers
    LOGITS,  # [B, T, V] fp32/bf16/fp16, unit stride over V
    TOKENS,  # [B, T] int64
    PARENTS,  # [B, T] int64
    TEMP,  # [B] fp32, <= 0: greedy (unread when ALL_GREEDY)
    THR,  # [B, T] fp32 keep thresholds (read when FILTER)
    UNIF,  # [B, D+1, 2] fp32
    ACCEPT_LEN,  # [B] int64
    OUT_TOKENS,  # [B, D+1] int64
    OUT_NODES,  # [B, D+1] int64
    BONUS,  # [B] int64
    LOGPROBS,  # [B, D+1] fp32
    # sizes
    T, V, D,
    # strides
    stride_lb, stride_lt,
    stride_nb, stride_nt,
    stride_pb, stride_pt,
    stride_hb, stride_ht,
    stride_ub, stride_ud, stride_uk,
    stride_ob,  # the three [B, D+1] outputs, unit stride over D+1
    # meta
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALL_GREEDY: tl.constexpr,  # every row greedy: no sampling code at all
    FILTER: tl.constexpr,  # apply the top-k / top-p thresholds
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    in_tree = offs_t < T
    par = tl.load(PARENTS + pid * stride_pb + offs_t * stride_pt, mask=in_tree, other=-2)  # [BLOCK_T]
    tok = tl.load(TOKENS + pid * stride_nb + offs_t * stride_nt, mask=in_tree, other=-1)  # [BLOCK_T]
    tok_ok = in_tree & (tok >= 0) & (tok < V)
    # a child adds mass only as the first sibling with its token: same[i, j] = i < j, same parent and token
    same = (par[:, None] == par[None, :]) & (tok[:, None] == tok[None, :]) & (offs_t[:, None] < offs_t[None, :])
    first = tok_ok & (tl.max(same.to(tl.int32), axis=0) == 0)

    if ALL_GREEDY:
        greedy = tl.full([], 1, tl.int1)
        scale = tl.full([], 1.0, tl.float32)
    else:
        temp = tl.load(TEMP + pid)
        greedy = temp <= 0.0
        scale = tl.where(greedy, 1.0, tl.math.div_rn(1.0, tl.where(greedy, 1.0, temp)))
    scale2 = scale * _LOG2E  # exponents in base 2
    lrow = LOGITS + pid * stride_lb
    urow = UNIF + pid * stride_ub
    orow = pid * stride_ob

    cur = tl.full([], 0, tl.int64)
    done = tl.full([], 0, tl.int32)
    for d in range(0, D + 1):
        if done == 0:
            row = lrow + cur * stride_lt
            if FILTER:
                thr = tl.load(THR + pid * stride_hb + cur * stride_ht)
            else:
                thr = tl.full([], _NEG_INF, tl.float32)
            mx, amax, s = _row_stats(row, V, thr, scale2, BLOCK_V)
            log_s = tl.log(s)
            # at depth D the children are not considered: no node has parent -3
            cur_par = tl.where(d < D, cur, -3)
            is_child = par == cur_par
            x_c = tl.load(row + tok, mask=is_child & tok_ok, other=_NEG_INF).to(tl.float32)
            e_c = tl.where(x_c >= thr, tl.exp2((x_c - mx) * scale2), 0.0)  # [BLOCK_T], 0 off the children
            take = is_child & (tok == amax)
            if not ALL_GREEDY:
                u = tl.load(urow + d * stride_ud)
                cum = tl.cumsum(tl.where(first, e_c / s, 0.0), axis=0)
                take = tl.where(greedy, take, is_child & (u < cum))
            j = tl.min(tl.where(take, offs_t, BLOCK_T), axis=0)
            if j < BLOCK_T:
                t_j = tl.sum(tl.where(offs_t == j, tok, 0), axis=0)
                x_j = tl.sum(tl.where(offs_t == j, x_c, 0.0), axis=0)
                tl.store(OUT_TOKENS + orow + d, t_j)
                tl.store(OUT_NODES + orow + d, j.to(tl.int64))
                tl.store(LOGPROBS + orow + d, (x_j - mx) * scale - log_s)
                cur = j.to(tl.int64)
            else:
                b_tok = amax
                if not ALL_GREEDY:
                    if not greedy:
                        resid = s - tl.sum(tl.where(first, e_c, 0.0), axis=0)
                        ex_tok = tl.where(is_child & tok_ok, tok, -1)
                        ex_tok = tl.where(resid > 0, ex_tok, -1)
                        resid = tl.where(resid > 0, resid, s)
                        target = tl.load(urow + d * stride_ud + stride_uk) * resid
                        b_tok = _residual_inverse_cdf(row, V, mx, thr, scale2, ex_tok, target, amax, BLOCK_V)
                x_b = tl.load(row + b_tok).to(tl.float32)
                tl.store(OUT_TOKENS + orow + d, b_tok.to(tl.int64))
                tl.store(OUT_NODES + orow + d, tl.full([], -1, tl.int64))
                tl.store(LOGPROBS + orow + d, (x_b - mx) * scale - log_s)
                tail = (offs_d > d) & (offs_d <= D)
                tl.store(OUT_TOKENS + orow + offs_d, tl.full([BLOCK_D], -1, tl.int64), mask=tail)
                tl.store(OUT_NODES + orow + offs_d, tl.full([BLOCK_D], -1, tl.int64), mask=tail)
                tl.store(LOGPROBS + orow + offs_d, tl.full([BLOCK_D], 0.0, tl.float32), mask=tail)
                tl.store(ACCEPT_LEN + pid, tl.full([], 0, tl.int64) + d)
                tl.store(BONUS + pid, b_tok.to(tl.int64))
                done = tl.full([], 1, tl.int32)


# ---------------------------------------------------------------------------------------------- launcher
def _is_interpreted() -> bool:
    return type(_accept_tree_kernel).__name__ == "InterpretedFunction"


def accept_tree(
    logits: Tensor,
    tree_tokens: Tensor,
    parents: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    uniforms: Tensor,
    max_depth: int,
    *,
    all_greedy: bool = False,
    filtering: bool | None = None,
    backend: str = "auto",
    block_v: int | None = None,
    num_warps: int | None = None,
) -> AcceptOutput:
    """Walk each sequence's verified draft tree and emit its accepted tokens and bonus (module docstring).

    logits [B, T, V] fp32/bf16/fp16 (unit stride over V); tree_tokens, parents [B, T] int64;
    temperature [B] float32 (<= 0: greedy row); top_k [B] int32 (-1: off); top_p [B] float32 (1.0: off);
    uniforms [B, D+1, 2] float32 in [0, 1); max_depth D.
    all_greedy: every row greedy whatever `temperature` says (the kernel drops its sampling code).
    filtering: whether any row uses top-k / top-p. None: look (CPU) or assume yes (CUDA, no sync);
    False skips the threshold sort and on CUDA is the caller's promise.
    backend: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (`accept_tree_reference`), or
    "auto" (triton where it can run, else torch).
    block_v, num_warps: vocab chunk per loop step (a power of 2) and warps per program; None picks
    DEFAULT_BLOCK_V with 16 warps (32 when all greedy), measured best on an H100.
    """
    inputs = (logits, tree_tokens, parents, temperature, top_k, top_p, uniforms)
    B, T, V, D = check_inputs(*inputs, max_depth)
    assert backend in ("auto", "triton", "torch"), f"backend must be auto|triton|torch, got {backend!r}"
    can_triton = logits.is_cuda or _is_interpreted()
    if backend == "torch" or (backend == "auto" and not can_triton):
        return accept_tree_reference(*inputs, D, all_greedy=all_greedy, filtering=filtering)
    assert can_triton, "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before importing tlt_rt"
    assert logits.stride(-1) == 1, f"logits must have unit stride over V, got strides {logits.stride()}"
    filtering = resolve_filtering(filtering, all_greedy, top_k, top_p, V)

    dev = logits.device
    thr = filter_thresholds(logits, temperature, top_k, top_p) if filtering else temperature  # unread
    thr_strides = thr.stride() if filtering else (0, 0)
    accept_len = torch.empty(B, dtype=torch.int64, device=dev)
    bonus = torch.empty(B, dtype=torch.int64, device=dev)
    out_tokens = torch.empty(B, D + 1, dtype=torch.int64, device=dev)
    out_nodes = torch.empty(B, D + 1, dtype=torch.int64, device=dev)
    logprobs = torch.empty(B, D + 1, dtype=torch.float32, device=dev)
    if block_v is None:
        block_v = 4096 if _is_interpreted() else DEFAULT_BLOCK_V
    BLOCK_V = min(triton.next_power_of_2(V), block_v)
    assert BLOCK_V == triton.next_power_of_2(BLOCK_V), f"block_v must be a power of 2, got {block_v}"
    _accept_tree_kernel[(B,)](
        logits, tree_tokens, parents, temperature, thr, uniforms,
        accept_len, out_tokens, out_nodes, bonus, logprobs,
        T, V, D,
        logits.stride(0), logits.stride(1),
        tree_tokens.stride(0), tree_tokens.stride(1),
        parents.stride(0), parents.stride(1),
        thr_strides[0], thr_strides[1],
        uniforms.stride(0), uniforms.stride(1), uniforms.stride(2),
        out_tokens.stride(0),
        BLOCK_T=max(16, triton.next_power_of_2(T)),
        BLOCK_V=BLOCK_V,
        BLOCK_D=max(16, triton.next_power_of_2(D + 1)),
        ALL_GREEDY=all_greedy,
        FILTER=filtering,
        num_warps=num_warps or (32 if all_greedy else 16),
    )  # fmt: skip
    return AcceptOutput(accept_len, out_tokens, out_nodes, bonus, logprobs)
