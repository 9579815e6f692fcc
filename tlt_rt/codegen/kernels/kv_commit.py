"""KV commit after tree verification: move the accepted path's K/V rows next to the root.

Sequence b's tree occupied cache positions P .. P+T-1 (P = prefix_len[b], node n at P + n, the root,
node 0, at P). With a = accept_len[b] accepted draft tokens whose tree nodes are accepted_nodes[b, :a],

    cache[P + k] <- cache[P + accepted_nodes[b, k-1]]     for k = 1 .. a,   in every given layer.

All reads happen before any write, so overlapping moves (nodes [2, 3]: 2 -> 1, 3 -> 2) are exact.
Rows already in place (node == k) are skipped, everything else is left untouched. "Releasing the rest"
is the caller's part: it sets the sequence's length to P + 1 + a (root plus accepted; the bonus token
becomes the next root and is not cached yet), and the block manager frees blocks past that length.

One launch covers every layer whose caches sit at a constant pointer distance from each other (slices of
one stacked allocation, e.g. [L, 2, num_blocks, page, Hkv, D] or separate [L, ...] K and V stacks);
unrelated allocations fall back to one launch per run of evenly spaced caches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["kv_commit", "kv_commit_reference"]

_INT_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _kv_commit_kernel(
    # pointers
    CACHE,  # first cache of the run, [num_blocks, page, Hkv, D]; cache l starts at CACHE + l * layer_stride
    BLOCK_TABLES,  # [B, max_blocks] int32
    PREFIX_LEN,  # [B] cache position of the root
    ACCEPTED,  # [B, n_cols] tree node of accepted draft token k+1 (-1 padding)
    ACCEPT_LEN,  # [B]
    # sizes
    n_cols,
    row_width,  # Hkv * D
    layer_stride,  # elements between consecutive caches of the run
    # strides
    stride_cb, stride_cp, stride_ch, stride_cd,
    stride_btb,
    stride_ab,
    # meta
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MAX_ACCEPT: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    col_blk = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    base = CACHE + layer * layer_stride

    prefix = tl.load(PREFIX_LEN + b).to(tl.int64)
    n_acc = tl.load(ACCEPT_LEN + b)
    ks = tl.arange(0, MAX_ACCEPT)
    node = tl.load(ACCEPTED + b * stride_ab + ks, mask=ks < n_cols, other=-1).to(tl.int64)
    move = (ks < n_acc) & (node >= 0) & (node != ks + 1)
    src = prefix + node
    dst = prefix + ks + 1
    bt_row = BLOCK_TABLES + b * stride_btb
    src_blk = tl.load(bt_row + src // PAGE_SIZE, mask=move, other=0).to(tl.int64)
    dst_blk = tl.load(bt_row + dst // PAGE_SIZE, mask=move, other=0).to(tl.int64)
    src_off = src_blk * stride_cb + (src % PAGE_SIZE) * stride_cp
    dst_off = dst_blk * stride_cb + (dst % PAGE_SIZE) * stride_cp

    cols = col_blk * BLOCK_C + tl.arange(0, BLOCK_C)
    col_off = (cols // HEAD_DIM) * stride_ch + (cols % HEAD_DIM) * stride_cd
    io_mask = move[:, None] & (cols < row_width)[None, :]
    rows = tl.load(base + src_off[:, None] + col_off[None, :], mask=io_mask)  # [MAX_ACCEPT, BLOCK_C]
    # a destination row may be another move's source and another thread may hold it: all reads land first
    tl.debug_barrier()
    tl.store(base + dst_off[:, None] + col_off[None, :], rows, mask=io_mask)


# validated cache sets -> their launch plan as (index of the run's first cache, count, distance): the engine
# passes the same layers every step, and checking 2L caches and planning runs over their pointers cost more
# host time than the commit itself at small batch. Indices, not tensors, so no cache is kept alive here.
_PLANS: dict[tuple, list[tuple[int, int, int]]] = {}


def _check_caches(caches: list[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
    first = caches[0]
    key = (tuple((c.data_ptr(), c.shape, c.stride()) for c in caches), first.dtype, first.device)
    if key in _PLANS:
        return [(caches[i], count, step) for i, count, step in _PLANS[key]]
    assert first.dim() == 4, f"caches must be [num_blocks, page, Hkv, D], got {tuple(first.shape)}"
    for c in caches:
        assert c.shape == first.shape and c.stride() == first.stride(), (
            f"all caches need one shape/stride: {tuple(c.shape)}/{c.stride()} vs {tuple(first.shape)}/{first.stride()}"
        )
        assert c.dtype == first.dtype and c.device == first.device, "all caches need one dtype and device"
    assert len({c.data_ptr() for c in caches}) == len(caches), "the same cache is given twice"
    if len(_PLANS) > 64:
        _PLANS.clear()
    plan = launch_plan(caches)
    index = {c.data_ptr(): i for i, c in enumerate(caches)}
    _PLANS[key] = [(index[start.data_ptr()], count, step) for start, count, step in plan]
    return plan


def _check(kv_caches, block_tables, prefix_len, accepted_nodes, accept_len):
    """Validate the arguments; returns (caches flattened [k0, v0, k1, ...], their launch plan)."""
    assert len(kv_caches) > 0, "kv_caches is empty"
    caches = [c for pair in kv_caches for c in pair]
    first = caches[0]
    plan = _check_caches(caches)
    b = block_tables.shape[0]
    assert block_tables.dim() == 2 and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1, (
        f"block_tables must be contiguous [B, max_blocks] int32, got {tuple(block_tables.shape)} {block_tables.dtype}"
    )
    assert prefix_len.shape == (b,) and prefix_len.dtype in _INT_DTYPES, f"prefix_len must be [B={b}] int"
    assert accept_len.shape == (b,) and accept_len.dtype in _INT_DTYPES, f"accept_len must be [B={b}] int"
    assert b < 2 or (prefix_len.stride(0) == 1 and accept_len.stride(0) == 1), (
        f"prefix_len / accept_len must be contiguous, got strides {prefix_len.stride()} / {accept_len.stride()}"
    )
    assert accepted_nodes.dim() == 2 and accepted_nodes.shape[0] == b and accepted_nodes.dtype in _INT_DTYPES, (
        f"accepted_nodes must be [B={b}, max_accept] int, got {tuple(accepted_nodes.shape)} {accepted_nodes.dtype}"
    )
    for name, t in (("block_tables", block_tables), ("prefix_len", prefix_len), ("accepted_nodes", accepted_nodes),
                    ("accept_len", accept_len)):  # fmt: skip
        assert t.device == first.device, f"{name} is on {t.device}, caches on {first.device}"
    return caches, plan


def kv_commit_reference(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_tables: torch.Tensor,
    prefix_len: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accept_len: torch.Tensor,
) -> None:
    """Plain-torch commit, in place, no host sync (see the module docstring for the rule).

    Rows that do not move write the root's own value back onto the root (position P is never a
    destination), so one gather and one scatter serve every sequence.
    """
    caches, _ = _check(kv_caches, block_tables, prefix_len, accepted_nodes, accept_len)
    page = caches[0].shape[1]
    n_cols = accepted_nodes.shape[1]
    ks = torch.arange(n_cols, device=accepted_nodes.device)
    node = accepted_nodes.long()
    move = (ks[None, :] < accept_len.long()[:, None]) & (node >= 0)  # [B, K]
    prefix = prefix_len.long()[:, None]
    src = prefix + node.clamp(min=0)
    dst = torch.where(move, prefix + ks[None, :] + 1, prefix.expand_as(node))
    src = torch.where(move, src, prefix.expand_as(node))
    tables = block_tables.long()

    def slots(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.gather(tables, 1, pos // page), pos % page

    src_blk, src_row = slots(src)
    dst_blk, dst_row = slots(dst)
    for c in caches:
        rows = c[src_blk, src_row]  # [B, K, Hkv, D], gathered before any write
        c.index_put_((dst_blk, dst_row), rows)


def _even_runs(caches: list[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
    """Split caches into runs at a constant pointer distance: (first, count, distance in elements)."""
    elem = caches[0].element_size()
    runs: list[tuple[torch.Tensor, int, int]] = []
    i = 0
    while i < len(caches):
        j, step = i + 1, 0
        if j < len(caches):
            diff = caches[j].data_ptr() - caches[i].data_ptr()
            if diff % elem == 0:
                step = diff // elem
                while j + 1 < len(caches) and caches[j + 1].data_ptr() - caches[j].data_ptr() == diff:
                    j += 1
                j += 1
        runs.append((caches[i], j - i, step))
        i = j
    return runs


def launch_plan(caches: list[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
    """Fewest runs over [k0, v0, k1, v1, ...]: taken interleaved, or all K then all V."""
    interleaved = _even_runs(caches)
    by_kind = _even_runs(caches[0::2]) + _even_runs(caches[1::2])
    return min(interleaved, by_kind, key=len)


def kv_commit(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_tables: torch.Tensor,
    prefix_len: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accept_len: torch.Tensor,
) -> None:
    """Triton commit of accepted K/V rows, in place, for every (k_cache, v_cache) layer given.

    kv_caches: per layer (k_cache, v_cache), each [num_blocks, page, Hkv, D] with one shape, stride, dtype.
    block_tables [B, max_blocks] int32; prefix_len [B] (cache position of the root); accepted_nodes
    [B, max_accept] tree node of each accepted draft token in order (-1 padding); accept_len [B].
    No host sync: graph-capturable. Usually one launch in all (see the module docstring).
    """
    caches, plan = _check(kv_caches, block_tables, prefix_len, accepted_nodes, accept_len)
    first = caches[0]
    if first.device.type != "cuda" and isinstance(_kv_commit_kernel, triton.runtime.JITFunction):
        raise RuntimeError(f"kv_commit on {first.device} needs TRITON_INTERPRET=1 set before importing {__name__}")
    _, page, n_kv, head_dim = first.shape
    assert page & (page - 1) == 0 and head_dim & (head_dim - 1) == 0, "page and head_dim must be powers of 2"
    assert accepted_nodes.stride(1) == 1, "accepted_nodes rows must be contiguous"
    b, n_cols = accepted_nodes.shape
    row_width = n_kv * head_dim
    block_c = min(triton.next_power_of_2(row_width), max(64, 4096 // triton.next_power_of_2(n_cols)))
    for start, count, step in plan:
        _kv_commit_kernel[(b, triton.cdiv(row_width, block_c), count)](
            start, block_tables, prefix_len, accepted_nodes, accept_len,
            n_cols, row_width, step,
            start.stride(0), start.stride(1), start.stride(2), start.stride(3),
            block_tables.stride(0),
            accepted_nodes.stride(0),
            HEAD_DIM=head_dim, PAGE_SIZE=page, MAX_ACCEPT=triton.next_power_of_2(n_cols), BLOCK_C=block_c,
        )  # fmt: skip
