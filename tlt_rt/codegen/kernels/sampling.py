"""The target's filtered sampling distribution (temperature, top-k, top-p) in plain torch.

One definition, used by tree acceptance (`accept.py`) and by anything else that samples from the target,
so that speculative and plain decoding draw from the same distribution. For one row of logits x [V]
(read as float32), temperature tau > 0, top_k k and top_p P:

    z = x * (1 / tau)
    s = x sorted in descending order
    top-k (on when 0 < k < V):   thr_k = s[k-1]                              else thr_k = -inf
    top-p (on when P < 1):       q = softmax(z) over the tokens with x >= thr_k, in the order of s
                                 n = #{i : x_(i) >= thr_k and sum_{j<i} q_j < P}  (>= 1)
                                 thr_p = s[n-1]                              else thr_p = -inf
    keep(v)  <=>  x_v >= thr = max(thr_k, thr_p)
    p(v)     =    keep(v) * exp(z_v - m) / sum_w keep(w) exp(z_w - m),       m = max_v z_v

computed as exp((x_v - max x) * (1 / tau)): subtracting before scaling keeps the max token's term 1.

i.e. top-k keeps the k largest logits, then top-p keeps the smallest prefix of the (renormalised) top-k
distribution whose mass reaches P. Ties at either boundary are all kept, so the kept set is exactly
{v : x_v >= thr}; that is what lets a kernel apply the filter as one per-row threshold. Rows with
temperature <= 0 are greedy: no filter (thr = -inf), p = softmax(x).

Cost: the threshold needs a sort of every row (in the logits' own dtype), O(R V log V) for R rows, plus
a values + int64 indices buffer; rows go in chunks of at most `_SORT_CHUNK_ELEMS` elements to bound the
memory. On an H100, 64 x 48 rows of V = 49152 bf16 take ~12.5 ms, 48 rows ~0.4 ms. Callers that know
no row filters skip it (`filtering=False` in `accept_tree`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["filter_thresholds", "filtered_probs", "inverse_temperature"]

_SORT_CHUNK_ELEMS = 1 << 26  # 64M logits per sort call: up to 256 MB values + 512 MB int64 indices


def inverse_temperature(temperature: Tensor) -> Tensor:
    """[B] float32: 1 / temperature where temperature > 0, else 0 (the greedy marker)."""
    t = temperature.float()
    return torch.where(t > 0, 1.0 / t.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(t))


def _row_thresholds(x: Tensor, scale: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """x [R, V] logits, scale/top_k/top_p [R] -> thr [R] float32 (see the module docstring)."""
    V = x.shape[-1]
    # sorting in the logits' own dtype is exact (widening to float32 keeps the order) and cheaper
    s = torch.sort(x, dim=-1, descending=True).values.float()  # [R, V]
    k = top_k.long()
    k_on = (k > 0) & (k < V)
    thr_k = s.gather(1, (k.clamp(1, V) - 1)[:, None]).squeeze(1)
    thr_k = torch.where(k_on, thr_k, torch.full_like(thr_k, float("-inf")))

    in_k = s >= thr_k[:, None]  # a prefix of the sorted row
    zs = torch.where(in_k, s * scale[:, None], torch.full_like(s, float("-inf")))
    q = torch.softmax(zs, dim=-1)
    mass_before = torch.nn.functional.pad(torch.cumsum(q, dim=-1)[:, :-1], (1, 0))  # sum_{j<i} q_j
    n = ((mass_before < top_p[:, None]) & in_k).sum(dim=-1).clamp_min(1)
    thr_p = s.gather(1, (n - 1)[:, None]).squeeze(1)
    p_on = top_p < 1.0
    return torch.where(p_on, torch.maximum(thr_k, thr_p), thr_k)


def filter_thresholds(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Per-row keep threshold of the filtered distribution: keep token v of row (b, i) iff
    float32(logits[b, i, v]) >= thr[b, i].

    logits [B, T, V] (any float dtype), temperature [B] (<= 0: greedy, no filter), top_k [B] int
    (<= 0 or >= V: off), top_p [B] float (>= 1: off; must be > 0). Returns thr [B, T] float32, -inf
    where no filter applies. No host sync.
    """
    B, T, V = logits.shape
    inv_t = inverse_temperature(temperature)
    greedy = inv_t == 0
    scale = torch.where(greedy, torch.ones_like(inv_t), inv_t)
    # per-row parameters, broadcast over the T nodes of each sequence: [B*T]
    scale_r = scale.repeat_interleave(T)
    k_r = torch.where(greedy, torch.zeros_like(top_k), top_k).long().repeat_interleave(T)
    p_r = torch.where(greedy, torch.ones_like(top_p), top_p.float()).repeat_interleave(T)
    rows = logits.reshape(B * T, V)
    chunk = max(1, _SORT_CHUNK_ELEMS // max(V, 1))
    out = [
        _row_thresholds(rows[i : i + chunk], scale_r[i : i + chunk], k_r[i : i + chunk], p_r[i : i + chunk])
        for i in range(0, B * T, chunk)
    ]
    return torch.cat(out).reshape(B, T)


def filtered_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The filtered target distribution p [B, T, V] float32 of the module docstring (greedy rows:
    softmax of the raw logits)."""
    x = logits.float()
    inv_t = inverse_temperature(temperature)
    scale = torch.where(inv_t == 0, torch.ones_like(inv_t), inv_t)[:, None, None]
    thr = filter_thresholds(logits, temperature, top_k, top_p)[..., None]
    e = torch.where(x >= thr, torch.exp((x - x.amax(dim=-1, keepdim=True)) * scale), 0.0)
    return e / e.sum(dim=-1, keepdim=True)
