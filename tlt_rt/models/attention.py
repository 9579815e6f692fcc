"""The attention interface every model forward goes through, and its plain-torch reference.

Paged KV cache layout (one pair per decoder layer):
    k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim]
A sequence's token at cache position `p` lives in slot
    block_tables[b, p // block_size] * block_size + p % block_size
(a flat index into the first two dims). Cache positions are where K/V sit in storage; rotary positions are
separate (tree nodes share rotary positions by depth while each has its own cache position).

One step packs the new tokens of B sequences into `q: [N, n_heads, head_dim]`. Sequence b owns rows
`cu_seqlens_q[b]:cu_seqlens_q[b+1]`; its new tokens occupy the LAST q_len cache positions of its
`seq_lens[b]` cached tokens (their K/V are written before attention). With prefix = seq_lens - q_len, new
token i of sequence b attends to
    every cache position < prefix, and
    new token j (cache position prefix + j) when j <= i (causal) or tree_mask[b, i, j] (verify).
Prefill, chunked prefill, decode (q_len = 1) and tree verify are all this one rule.

Verify may widen the tree window: a tree_mask [B, T, W] with W >= T covers the last W cache positions
(the new tokens are the last T of them), and positions before the window are attended fully. The
drafter uses this while it grows a tree level by level: each level's nodes see their ancestors among
earlier levels, but not their cousins.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Mode = Literal["prefill", "decode", "verify"]


@dataclass
class AttnMetadata:
    """Everything attention needs about one step's batch; built by the engine, passed explicitly."""

    mode: Mode
    cu_seqlens_q: torch.Tensor  # [B+1] int32, offsets of each sequence's new tokens in the packed batch
    seq_lens: torch.Tensor  # [B] int32, cached tokens per sequence after this step's writes
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 / any value past the sequence's blocks is unused
    slot_mapping: torch.Tensor  # [N] int64, flat cache slot of each new token's K/V; -1 skips the write
    max_q_len: int  # host int: 1 for decode, T for verify, longest chunk for prefill
    tree_mask: torch.Tensor | None = None  # [B, T, W>=T] bool for verify; None means causal among new tokens
    # (cu_seqlens_q, seq_lens) as host lists where the builder has them: prefill then plans without a sync
    host: tuple[list[int], list[int]] | None = None
    # True once -1 slots point at the trash slot (`with_resolved_slots`): writes then need no remapping
    slots_resolved: bool = False

    @property
    def window(self) -> int:
        """Cache positions (from the end) that the tree mask covers; T for an ordinary verify."""
        return self.max_q_len if self.tree_mask is None else self.tree_mask.shape[-1]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def validate(self, num_tokens: int) -> None:
        """Cheap shape checks (no device sync) that catch most engine-side mistakes early."""
        b = self.seq_lens.shape[0]
        if self.cu_seqlens_q.shape != (b + 1,):
            raise ValueError(f"cu_seqlens_q must be [B+1]={b + 1}, got {tuple(self.cu_seqlens_q.shape)}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != b:
            raise ValueError(f"block_tables must be [B={b}, max_blocks], got {tuple(self.block_tables.shape)}")
        if self.slot_mapping.shape != (num_tokens,):
            raise ValueError(f"slot_mapping must be [N={num_tokens}], got {tuple(self.slot_mapping.shape)}")
        if self.mode == "decode" and num_tokens != b:
            raise ValueError(f"decode packs one token per sequence: N={num_tokens} but B={b}")
        if self.mode == "verify":
            if self.tree_mask is None:
                raise ValueError("verify needs a tree_mask [B, T, T]")
            t = self.max_q_len
            if self.tree_mask.shape[:2] != (b, t) or self.tree_mask.shape[2] < t or num_tokens != b * t:
                raise ValueError(
                    f"verify needs tree_mask [B={b}, T={t}, W>=T] and N=B*T tokens, "
                    f"got mask {tuple(self.tree_mask.shape)} and N={num_tokens}"
                )


def resolve_slots(slot_mapping: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Slots with -1 (padding rows) sent to the cache's very last slot: owners of a cache keep its last
    block out of circulation as a trash block, so skipped writes need no host-side filtering."""
    return torch.where(slot_mapping >= 0, slot_mapping, torch.full_like(slot_mapping, num_slots - 1))


def with_resolved_slots(meta: AttnMetadata, num_slots: int) -> AttnMetadata:
    """`meta` with its -1 slots resolved once (`resolve_slots`), for a forward whose layers all write."""
    if meta.slots_resolved:
        return meta
    return replace(meta, slot_mapping=resolve_slots(meta.slot_mapping, num_slots), slots_resolved=True)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    resolved: bool = False,
) -> None:
    """Scatter new K/V [N, n_kv, D] into the paged cache at their slots (-1: the trash slot, see
    `resolve_slots`; `resolved` says the caller has done that already)."""
    nb, bs, h, d = k_cache.shape
    slots = slot_mapping if resolved else resolve_slots(slot_mapping, nb * bs)
    k_cache.view(nb * bs, h, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slots, v.to(v_cache.dtype))


def _gather_cache(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length, n_kv, D]: the first `length` cache positions of every sequence (padding reads block 0)."""
    nb, bs, h, d = cache.shape
    pos = torch.arange(length, device=cache.device)
    blocks = block_tables[:, pos // bs].clamp(min=0).long()  # [B, length]
    slots = blocks * bs + pos % bs
    return cache.view(nb * bs, h, d)[slots]


# on the host, decode attention reads keys up to the batch's longest sequence, not the tables' static bound
# (a row's last bits then depend on the batch it runs in; tests turn it off to run as a captured step does)
TIGHT_HOST_BOUND = True


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Tq, Hq, D], k/v [B, L, Hkv, D], allowed [B, Tq, L] -> [B, Tq, Hq, D] in fp32 math.

    A query that may see no key at all (a padding row) gets zeros, as the Triton kernels give."""
    hq, hkv = q.shape[2], k.shape[2]
    qf = q.float().transpose(1, 2)  # [B, Hq, Tq, D]
    kf = k.float().transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed[:, None], scale=scale)
    out = torch.where(allowed.any(-1)[:, None, :, None], out, 0.0)
    return out.transpose(1, 2).to(q.dtype)


def paged_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float
) -> torch.Tensor:
    """Plain-torch paged attention: q [N, Hq, D] -> [N, Hq, D], following the rule in the module docstring."""
    if meta.mode in ("decode", "verify"):
        b, t = meta.num_seqs, meta.max_q_len
        max_len = meta.block_tables.shape[1] * k_cache.shape[1]  # a static bound: CUDA graphs capture this
        if q.device.type == "cpu" and TIGHT_HOST_BOUND:  # the batch's longest sequence: free to read, tighter
            max_len = max(1, min(max_len, int(meta.seq_lens.max())))
        k = _gather_cache(k_cache, meta.block_tables, max_len)
        v = _gather_cache(v_cache, meta.block_tables, max_len)
        key_pos = torch.arange(max_len, device=q.device)
        w = meta.window
        prefix = (meta.seq_lens.long() - w).view(b, 1, 1)
        in_prefix = key_pos.view(1, 1, -1) < prefix  # [B, 1, L]
        rel = key_pos.view(1, 1, -1) - prefix  # position inside the window
        if meta.mode == "decode":
            new_ok = rel == 0
        else:
            assert meta.tree_mask is not None
            rel_idx = rel.clamp(0, w - 1).expand(b, t, max_len)
            new_ok = (rel >= 0) & (rel < w) & torch.gather(meta.tree_mask, 2, rel_idx)
        allowed = in_prefix | new_ok
        out = _attend(q.view(b, t, *q.shape[1:]), k, v, allowed, scale)
        return out.reshape(q.shape)
    # prefill: variable-length chunks, padded into groups of sequences; the plan is made once per forward
    out = torch.empty_like(q)
    nb, bs, h, d = k_cache.shape
    flat_k, flat_v = k_cache.view(nb * bs, h, d), v_cache.view(nb * bs, h, d)
    for g in _prefill_plan(meta, bs, q.device):
        qpad = q.new_zeros(g.shape[0], g.shape[1], *q.shape[1:])
        qpad[g.seq, g.tok] = q[g.rows]
        res = _attend(qpad, flat_k[g.slots], flat_v[g.slots], g.allowed, scale)
        out[g.rows] = res[g.seq, g.tok]
    return out


PREFILL_GROUP_KEYS = 1 << 16  # padded key positions (sequences x longest) one prefill group may gather


@dataclass
class _PrefillGroup:
    """Consecutive sequences of a prefill batch attended in one padded SDPA call."""

    rows: slice  # their packed query rows
    shape: tuple[int, int]  # (sequences, longest chunk)
    seq: torch.Tensor  # [n] sequence (in the group) of each packed row
    tok: torch.Tensor  # [n] its index among that sequence's new tokens
    slots: torch.Tensor  # [g, L] cache slot of each sequence's positions 0..L-1 (L = the longest)
    allowed: torch.Tensor  # [g, tq, L] causal over cached and new tokens; padding rows see nothing


def _prefill_plan(meta: AttnMetadata, block_size: int, device) -> list[_PrefillGroup]:
    """Groups of the prefill batch (sequences x longest <= PREFILL_GROUP_KEYS), built on the first layer's
    call and kept on `meta` for the others: they only depend on the batch layout."""
    plan = meta.__dict__.get("_prefill_plan")
    if plan is not None:
        return plan
    cu, lens = meta.host if meta.host is not None else (meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist())
    plan, start = [], 0
    while start < meta.num_seqs:
        end, longest = start + 1, lens[start]
        while end < meta.num_seqs and (end + 1 - start) * max(longest, lens[end]) <= PREFILL_GROUP_KEYS:
            longest = max(longest, lens[end])
            end += 1
        q_lens = [cu[i + 1] - cu[i] for i in range(start, end)]
        if max(q_lens) > 0:
            plan.append(_prefill_group(meta.block_tables[start:end], cu[start : end + 1], lens[start:end], q_lens,
                                       block_size, device))  # fmt: skip
        start = end
    meta.__dict__["_prefill_plan"] = plan
    return plan


def _prefill_group(tables, cu: list[int], lens: list[int], q_lens: list[int], block_size: int, dev) -> _PrefillGroup:
    g, tq, longest = len(lens), max(q_lens), max(lens)
    q_lens_t = torch.tensor(q_lens, device=dev)
    seq = torch.repeat_interleave(torch.arange(g, device=dev), q_lens_t)
    starts = torch.tensor(cu[:-1], device=dev) - cu[0]
    tok = torch.arange(cu[-1] - cu[0], device=dev) - starts[seq]
    pos = torch.arange(longest, device=dev)
    slots = tables[:, pos // block_size].clamp(min=0).long() * block_size + pos % block_size
    j = torch.arange(tq, device=dev)
    qpos = (torch.tensor(lens, device=dev) - q_lens_t)[:, None] + j  # [g, tq] cache position of each query
    allowed = (pos.view(1, 1, -1) <= qpos[..., None]) & (j < q_lens_t[:, None])[..., None]
    return _PrefillGroup(slice(cu[0], cu[-1]), (g, tq), seq, tok, slots, allowed)


class AttentionBackend(Protocol):
    """What a model calls for paged attention. K/V of the new tokens are already in the cache."""

    name: str

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float
    ) -> torch.Tensor: ...


class TorchAttention:
    """The reference backend: plain torch, any device, fp32 accumulation."""

    name = "torch"

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float
    ) -> torch.Tensor:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)


# SDPA's kernels for the learner's dense attention on CUDA: not cuDNN's, which builds an execution plan per new
# shape on the host (3-4 ms a call on an H100): an RL step's micro-batches are each a new length, and an
# update on a Qwen 0.5B spent 0.8 of its 2.4 s there with the GPU busy 16% of the time
DENSE_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal attention for the learner: q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]."""
    hq, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    with sdpa_kernel(list(DENSE_SDPA_BACKENDS)) if q.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=hq != hkv)
    return out.transpose(1, 2)
