"""KV commit kernel against `kv_commit_reference` and a row-by-row model of the rule."""

from __future__ import annotations

import importlib
import os

import torch

# See tests/test_kernel_attention.py: the interpreter must be on before the kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import tlt_rt.codegen.kernels.kv_commit as _commit

    if isinstance(_commit._kv_commit_kernel, triton.runtime.JITFunction):  # imported earlier, compiled
        importlib.reload(_commit)

import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tlt_rt.codegen.kernels.kv_commit import kv_commit, kv_commit_reference, launch_plan  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_layers(layout: str, n_layers: int, shape: tuple[int, ...], dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if layout == "interleaved":  # one [L, 2, num_blocks, page, Hkv, D] allocation
        store = torch.randn(n_layers, 2, *shape, device=DEVICE, dtype=dtype)
        return [(store[i, 0], store[i, 1]) for i in range(n_layers)]
    if layout == "stacks":  # separate [L, ...] K and V allocations
        ks = torch.randn(n_layers, *shape, device=DEVICE, dtype=dtype)
        vs = torch.randn(n_layers, *shape, device=DEVICE, dtype=dtype)
        return [(ks[i], vs[i]) for i in range(n_layers)]
    return [(torch.randn(shape, device=DEVICE, dtype=dtype), torch.randn(shape, device=DEVICE, dtype=dtype))
            for _ in range(n_layers)]  # fmt: skip


def expected_commit(layers, tables, prefix, nodes, alen):
    """The rule row by row on copies: read every source row, then write every destination row."""
    page = layers[0][0].shape[1]
    out = [(k.clone(), v.clone()) for k, v in layers]
    for b in range(tables.shape[0]):
        moves = [(prefix[b] + nodes[b][j], prefix[b] + j + 1) for j in range(alen[b])]
        for (k_old, v_old), (k_new, v_new) in zip(layers, out, strict=True):
            for old, new in ((k_old, k_new), (v_old, v_new)):
                rows = [old[tables[b, s // page], s % page].clone() for s, _ in moves]
                for row, (_, d) in zip(rows, moves, strict=True):
                    new[tables[b, d // page], d % page] = row
    return out


def random_path(data, t: int, any_order: bool) -> list[int]:
    """Accepted nodes of a random tree of t nodes: a root-to-node path (root excluded), or with any_order
    any distinct non-root nodes in any order (the commit does not rely on tree order)."""
    if any_order:
        return data.draw(st.lists(st.integers(1, t - 1), unique=True, max_size=t - 1))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, t)]
    node = data.draw(st.integers(0, t - 1))
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def build_batch(data, batch: int, page: int, max_t: int, any_order: bool):
    paths, prefixes, need = [], [], []
    for _ in range(batch):
        t = data.draw(st.integers(2, max_t))
        prefix = data.draw(st.sampled_from([0, 1, page - 1, page, 40]) | st.integers(0, 70))
        paths.append(random_path(data, t, any_order))
        prefixes.append(prefix)
        need.append(-(-(prefix + t) // page))
    n_cols = max(len(p) for p in paths) + data.draw(st.integers(0, 2))
    n_cols = max(n_cols, 1)
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.full((batch, max(need) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    nodes = torch.full((batch, n_cols), -1, dtype=torch.int64)
    for b, p in enumerate(paths):
        nodes[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
    alen = [len(p) for p in paths]
    return tables, prefixes, nodes, alen, num_blocks


@given(
    data=st.data(),
    batch=st.integers(1, 4),
    n_layers=st.integers(1, 3),
    page=st.sampled_from([16, 32]),
    n_kv=st.integers(1, 2),
    head_dim=st.sampled_from([16, 64, 128]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    layout=st.sampled_from(["interleaved", "stacks", "separate"]),
    any_order=st.booleans(),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_commit_matches_reference(data, batch, n_layers, page, n_kv, head_dim, dtype, layout, any_order,
                                  index_dtype):  # fmt: skip
    tables, prefixes, nodes, alen, num_blocks = build_batch(data, batch, page, 16, any_order)
    layers = make_layers(layout, n_layers, (num_blocks, page, n_kv, head_dim), dtype)
    want = expected_commit(layers, tables, prefixes, nodes.tolist(), alen)
    args = (tables.to(DEVICE), torch.tensor(prefixes, dtype=index_dtype, device=DEVICE),
            nodes.to(index_dtype).to(DEVICE), torch.tensor(alen, dtype=index_dtype, device=DEVICE))  # fmt: skip
    ref_layers = [(k.clone(), v.clone()) for k, v in layers]
    kv_commit_reference(ref_layers, *args)
    kv_commit(layers, *args)
    for got, ref, exp in zip(layers, ref_layers, want, strict=True):
        for i in range(2):  # exact: rows are moved, never computed
            assert torch.equal(ref[i], exp[i])
            assert torch.equal(got[i], exp[i])


@pytest.mark.parametrize("commit", [kv_commit, kv_commit_reference])
def test_overlapping_moves(commit):
    """Nodes [2, 3] move 2 -> 1 and 3 -> 2: position 2 is read before it is overwritten."""
    page = 16
    k = torch.arange(2 * page, dtype=torch.float32, device=DEVICE).view(2, page, 1, 1).expand(2, page, 1, 16)
    k = k.contiguous()
    v = -k
    tables = torch.tensor([[1, 0]], dtype=torch.int32, device=DEVICE)  # position p lives in block 1 - p // 16
    prefix = 14  # the moves cross the block boundary
    commit([(k, v)], tables, torch.tensor([prefix], device=DEVICE), torch.tensor([[2, 3, -1]], device=DEVICE),
           torch.tensor([2], device=DEVICE))  # fmt: skip

    def at(pos: int) -> float:
        blk = tables[0, pos // page].item()
        return k[blk, pos % page, 0, 0].item()

    original = lambda pos: (1 - pos // page) * page + pos % page  # noqa: E731
    assert at(prefix + 1) == original(prefix + 2)
    assert at(prefix + 2) == original(prefix + 3)
    assert at(prefix) == original(prefix) and at(prefix + 3) == original(prefix + 3)
    assert torch.equal(v, -k)


def test_nothing_accepted_is_a_no_op():
    layers = make_layers("interleaved", 2, (4, 16, 2, 64), torch.bfloat16)
    before = [(k.clone(), v.clone()) for k, v in layers]
    kv_commit(layers, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE),
              torch.tensor([3, 9], device=DEVICE), torch.tensor([[4, 5], [1, 2]], device=DEVICE),
              torch.zeros(2, dtype=torch.long, device=DEVICE))  # fmt: skip
    for (k, v), (k0, v0) in zip(layers, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize(("layout", "runs"), [("interleaved", 1), ("stacks", 2)])
def test_stacked_layers_take_few_launches(layout, runs):
    layers = make_layers(layout, 28, (2, 16, 1, 16), torch.float16)
    plan = launch_plan([c for pair in layers for c in pair])
    assert len(plan) == runs and sum(count for _, count, _ in plan) == 56


def test_rejects_bad_inputs():
    k = torch.zeros(4, 16, 2, 64, device=DEVICE)
    args = (
        torch.zeros(1, 2, dtype=torch.int32, device=DEVICE),
        torch.zeros(1, dtype=torch.long, device=DEVICE),
        torch.zeros(1, 3, dtype=torch.long, device=DEVICE),
        torch.zeros(1, dtype=torch.long, device=DEVICE),
    )
    with pytest.raises(AssertionError, match="twice"):
        kv_commit([(k, k)], *args)
    with pytest.raises(AssertionError, match="one shape"):
        kv_commit([(k, torch.zeros(4, 16, 1, 64, device=DEVICE))], *args)
    with pytest.raises(AssertionError, match="accepted_nodes"):
        kv_commit([(k, k.clone())], args[0], args[1], args[2].float(), args[3])


@pytest.mark.gpu
def test_qwen7b_commit_on_gpu():
    """28 layers of one [L, 2, ...] bf16 allocation, batch 64, depth-8 paths: one launch, equal to the reference."""
    batch, page, n_layers, depth = 64, 16, 28, 8
    prefixes = torch.randint(1000, 4000, (batch,))
    need = (prefixes + 64) // page + 1
    num_blocks = int(need.sum()) + 8
    perm = torch.randperm(num_blocks)
    tables = torch.full((batch, int(need.max())), -1, dtype=torch.int32)
    used = 0
    for b in range(batch):
        tables[b, : need[b]] = perm[used : used + need[b]].int()
        used += int(need[b])
    alen = torch.randint(0, depth + 1, (batch,))
    steps = torch.randint(1, 4, (batch, depth)).cumsum(1)  # increasing node ids, overlapping moves included
    nodes = torch.where(torch.arange(depth)[None] < alen[:, None], steps, -1)
    layers = make_layers("interleaved", n_layers, (num_blocks, page, 4, 128), torch.bfloat16)
    ref = [(k.clone(), v.clone()) for k, v in layers]
    args = (tables.cuda(), prefixes.cuda(), nodes.cuda(), alen.cuda())
    kv_commit(layers, *args)
    kv_commit_reference(ref, *args)
    for got, want in zip(layers, ref, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
