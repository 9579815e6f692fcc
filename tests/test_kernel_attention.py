"""Paged decode / tree attention kernels against `paged_attention_reference`, and the backend choice."""

from __future__ import annotations

import importlib
import os

import torch

# Without CUDA the kernels run in Triton's interpreter, chosen when @triton.jit runs (and read again by
# Triton at first launch), so it is switched on before our kernel modules load and stays on.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import tlt_rt.codegen.kernels.decode_attention as _dec
    import tlt_rt.codegen.kernels.paged as _paged
    import tlt_rt.codegen.kernels.tree_attention as _tree

    if _paged.compiled_for_gpu(_dec._decode_attention_kernel):  # imported earlier without the interpreter
        importlib.reload(_dec)
        importlib.reload(_tree)

import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tlt_rt.codegen.backend import TritonAttention, select_backend  # noqa: E402
from tlt_rt.codegen.kernels.decode_attention import (  # noqa: E402
    paged_decode_attention,
)
from tlt_rt.codegen.kernels.paged import (  # noqa: E402
    MIN_CHUNK,
    choose_num_splits,
    clamp_splits,
    split_counters,
)
from tlt_rt.codegen.kernels.tree_attention import paged_tree_attention  # noqa: E402
from tlt_rt.models import attention  # noqa: E402
from tlt_rt.models.attention import AttnMetadata, TorchAttention, paged_attention_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
# (dtype, atol, rtol) against an fp32 run on the same (rounded) inputs
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
AWKWARD_LENS = [1, 2, 15, 17, 31, 64, 65, 100, 129, 200, 257]


# ------------------------------------------------------------------------------------------------ builders
def make_paged(lens: list[int], n_kv: int, head_dim: int, page: int, dtype, spare: int, garbage: bool, layout: str):
    """Random K/V in a shuffled paged cache holding sequences of `lens` tokens -> (k, v, block_tables)."""
    need = [-(-n // page) for n in lens]
    max_blocks = max(need) + spare
    num_blocks = sum(need) + 3
    shape = (num_blocks, page, n_kv, head_dim)
    if layout == "stacked":  # a layer's slice of one [L, 2, ...] allocation: non-contiguous view
        store = torch.randn(2, 2, *shape, device=DEVICE).to(dtype)
        k, v = store[1, 0], store[1, 1]
    elif layout == "heads_major":  # [num_blocks, Hkv, page, D] storage viewed as [num_blocks, page, Hkv, D]
        k = torch.randn(num_blocks, n_kv, page, head_dim, device=DEVICE).to(dtype).transpose(1, 2)
        v = torch.randn(num_blocks, n_kv, page, head_dim, device=DEVICE).to(dtype).transpose(1, 2)
    else:
        k = torch.randn(shape, device=DEVICE).to(dtype)
        v = torch.randn(shape, device=DEVICE).to(dtype)
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
        if garbage:  # unused entries may hold any block id
            tables[b, n:] = torch.randint(0, num_blocks, (max_blocks - n,), dtype=torch.int32)
    return k, v, tables.to(DEVICE)


def random_tree_mask(t: int, rng: st.DataObject) -> torch.Tensor:
    """[T, T] ancestor-or-self mask of a random tree whose parents precede their children (node 0 root)."""
    parents = [-1] + [rng.draw(st.integers(0, i - 1)) for i in range(1, t)]
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def check_close(out: torch.Tensor, ref32: torch.Tensor, dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref32, atol=atol, rtol=rtol)


def fp32_reference(q, k, v, meta, scale):
    # .float() also makes strided caches contiguous, which the reference's flat view needs
    return paged_attention_reference(q.float(), k.float().contiguous(), v.float().contiguous(), meta, scale)


shapes = dict(
    batch=st.integers(1, 3),
    n_kv=st.integers(1, 2),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([64, 128]),
    page=st.sampled_from([16, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    num_splits=st.sampled_from([1, 2, 3, 5]),
    spare=st.integers(0, 2),
    garbage=st.booleans(),
    layout=st.sampled_from(["plain", "stacked", "heads_major"]),
)


# ------------------------------------------------------------------------------------------------ decode
@given(data=st.data(), **shapes)
def test_decode_matches_reference(data, batch, n_kv, group, head_dim, page, dtype, num_splits, spare, garbage,
                                  layout):  # fmt: skip
    lens = [data.draw(st.sampled_from(AWKWARD_LENS) | st.integers(1, 260)) for _ in range(batch)]
    k, v, tables = make_paged(lens, n_kv, head_dim, page, dtype, spare, garbage, layout)
    q = torch.randn(batch, n_kv * group, head_dim, device=DEVICE).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k, v, tables, seq_lens, scale, num_splits=num_splits)
    meta = AttnMetadata("decode", torch.arange(batch + 1, dtype=torch.int32, device=DEVICE), seq_lens, tables,
                        torch.zeros(batch, dtype=torch.long, device=DEVICE), 1)  # fmt: skip
    check_close(out, fp32_reference(q, k, v, meta, scale), dtype)


def test_decode_query_from_fused_qkv():
    """q as a strided slice of a fused [B, Hq + 2 Hkv, D] projection output."""
    k, v, tables = make_paged([40, 129], 2, 64, 16, torch.float32, 1, False, "plain")
    qkv = torch.randn(2, 8 + 4, 64, device=DEVICE)
    q = qkv[:, :8]
    seq_lens = torch.tensor([40, 129], dtype=torch.int32, device=DEVICE)
    meta = AttnMetadata("decode", torch.arange(3, dtype=torch.int32, device=DEVICE), seq_lens, tables,
                        torch.zeros(2, dtype=torch.long, device=DEVICE), 1)  # fmt: skip
    ref = paged_attention_reference(q, k, v, meta, 0.125)
    for splits in (1, 3):
        check_close(paged_decode_attention(q, k, v, tables, seq_lens, 0.125, num_splits=splits), ref, torch.float32)


# ------------------------------------------------------------------------------------------------ tree
@given(data=st.data(), n_tree=st.integers(2, 16), **shapes)
def test_tree_matches_reference(data, n_tree, batch, n_kv, group, head_dim, page, dtype, num_splits, spare,
                                garbage, layout):  # fmt: skip
    prefixes = [data.draw(st.sampled_from([0, 1, 17, 100, 130]) | st.integers(0, 220)) for _ in range(batch)]
    lens = [p + n_tree for p in prefixes]
    k, v, tables = make_paged(lens, n_kv, head_dim, page, dtype, spare, garbage, layout)
    q = torch.randn(batch * n_tree, n_kv * group, head_dim, device=DEVICE).to(dtype)
    mask = torch.stack([random_tree_mask(n_tree, data) for _ in range(batch)]).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = paged_tree_attention(q, k, v, tables, seq_lens, mask, scale, num_splits=num_splits)
    meta = AttnMetadata("verify", torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * n_tree, seq_lens,
                        tables, torch.zeros(batch * n_tree, dtype=torch.long, device=DEVICE), n_tree, mask)  # fmt: skip
    check_close(out, fp32_reference(q, k, v, meta, scale), dtype)


@given(data=st.data(), n_tree=st.integers(1, 8), extra=st.integers(1, 24), **shapes)
def test_tree_window_matches_reference(data, n_tree, extra, batch, n_kv, group, head_dim, page, dtype, num_splits,
                                       spare, garbage, layout):  # fmt: skip
    """A drafter level's mask covers W > T positions: the T new tokens and earlier levels' nodes."""
    w = n_tree + extra
    prefixes = [data.draw(st.sampled_from([0, 1, 17, 100]) | st.integers(0, 150)) for _ in range(batch)]
    lens = [p + w for p in prefixes]
    k, v, tables = make_paged(lens, n_kv, head_dim, page, dtype, spare, garbage, layout)
    q = torch.randn(batch * n_tree, n_kv * group, head_dim, device=DEVICE).to(dtype)
    seed = data.draw(st.integers(0, 2**16))
    mask = torch.rand(batch, n_tree, w, generator=torch.Generator().manual_seed(seed)) < 0.4
    mask[:, torch.arange(n_tree), extra + torch.arange(n_tree)] = True  # every node sees itself
    mask = mask.to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = paged_tree_attention(q, k, v, tables, seq_lens, mask, scale, num_splits=num_splits)
    meta = AttnMetadata("verify", torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * n_tree, seq_lens,
                        tables, torch.zeros(batch * n_tree, dtype=torch.long, device=DEVICE), n_tree, mask)  # fmt: skip
    check_close(out, fp32_reference(q, k, v, meta, scale), dtype)


@pytest.mark.parametrize("splits", [16, 24])
def test_tree_splits_past_the_prefix_are_neither_written_nor_read(splits, monkeypatch):
    """A table far wider than the prefixes (an engine's whole context) splits the prefix into many chunks, most
    empty: above `EVERY_SPLIT_MAX` splits their partials stay as allocated (NaN here) and the combine, whose 16-row
    blocks here hold rows of two sequences with different used counts, never reads them; up to it every split
    writes (an empty one zeros) and the combine reads them all."""
    import tlt_rt.codegen.kernels.tree_attention as tree

    kept = []

    def nan_partials(rows, n_heads, num_splits, head_dim, device):
        parts = tuple(torch.full(shape, float("nan"), device=device)
                      for shape in ((rows, n_heads, num_splits, head_dim), (rows, n_heads, num_splits)))  # fmt: skip
        kept.append(parts)
        return parts

    monkeypatch.setattr(tree, "split_partials", nan_partials)
    assert tree.EVERY_SPLIT is None and tree.EVERY_SPLIT_MAX == 16
    t, prefixes = 3, [0, 40, 100, 260]  # 1 / 1 / 2 / 5 splits of 64-position tiles used
    lens = [p + t for p in prefixes]
    k, v, tables = make_paged(lens, 2, 64, 16, torch.float32, 100, True, "plain")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens) * t, 6, 64, device=DEVICE)  # 3 tokens x 6 heads: 18 rows a sequence
    mask = torch.ones(len(lens), t, t, dtype=torch.bool).tril().to(DEVICE)
    out = paged_tree_attention(q, k, v, tables, seq_lens, mask, 0.125, num_splits=splits)
    meta = AttnMetadata("verify", torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE) * t, seq_lens,
                        tables, torch.zeros(len(lens) * t, dtype=torch.long, device=DEVICE), t, mask)  # fmt: skip
    check_close(out, paged_attention_reference(q, k, v, meta, 0.125), torch.float32)
    [(o_part, lse_part)] = kept
    assert o_part.shape[2] == splits
    for b, used in enumerate([1, 1, 2, 5] if splits > tree.EVERY_SPLIT_MAX else [splits] * 4):
        rows = slice(b * t, (b + 1) * t)
        assert not o_part[rows, :, :used].isnan().any() and not lse_part[rows, :, :used].isnan().any()
        assert o_part[rows, :, used:].isnan().all() and lse_part[rows, :, used:].isnan().all()


def test_tree_every_split_path_gives_the_same_bits(monkeypatch):
    """Writing and merging every split (empty ones as lse = -inf, zero output) gives the bits of the used ones
    alone: the empty splits weigh exactly 0 in the merge."""
    import tlt_rt.codegen.kernels.tree_attention as tree

    t, lens = 4, [4, 70, 150]
    k, v, tables = make_paged(lens, 2, 64, 16, torch.bfloat16, 30, True, "plain")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens) * t, 4, 64, device=DEVICE).to(torch.bfloat16)
    mask = torch.ones(len(lens), t, t, dtype=torch.bool).tril().to(DEVICE)
    outs = []
    for every in (True, False):
        monkeypatch.setattr(tree, "EVERY_SPLIT", every)
        outs.append(paged_tree_attention(q, k, v, tables, seq_lens, mask, 0.125, num_splits=12))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("extra", [{"merge_tile": 16 * 64 * 2}, {"block_m": 64, "merge_tile": 4096}])
def test_tree_merge_tile_and_block_rows_keep_the_result(extra, monkeypatch):
    """TREE_META's optional merge tile (the combine's splits a step: here two, or four) and a smaller row block
    (which walks the window inside the prefix loop): the reference's output over several splits and sequences."""
    import tlt_rt.codegen.kernels.tree_attention as tree

    monkeypatch.setattr(tree, "TREE_META", {**tree.TREE_META, **extra})
    t, lens = 12, [12, 90, 200]
    k, v, tables = make_paged(lens, 2, 64, 16, torch.float32, 30, True, "plain")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens) * t, 12, 64, device=DEVICE)  # 12 tokens x 6 heads a KV head: 72 rows, two 64-row blocks
    mask = torch.ones(len(lens), t, t, dtype=torch.bool).tril().to(DEVICE)
    meta = AttnMetadata("verify", torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE) * t, seq_lens,
                        tables, torch.zeros(len(lens) * t, dtype=torch.long, device=DEVICE), t, mask)  # fmt: skip
    want = paged_attention_reference(q, k, v, meta, 0.125)
    for splits in (3, 5):
        out = paged_tree_attention(q, k, v, tables, seq_lens, mask, 0.125, num_splits=splits)
        check_close(out, want, torch.float32)


def test_tree_chain_mask_is_causal_decode():
    """A chain tree is causal attention; its last token equals a decode step over the same cache."""
    t, lens = 5, [37, 80]
    k, v, tables = make_paged(lens, 1, 64, 16, torch.float32, 0, False, "plain")
    q = torch.randn(2 * t, 4, 64, device=DEVICE)
    chain = torch.ones(t, t, dtype=torch.bool).tril().expand(2, t, t).contiguous().to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_tree_attention(q, k, v, tables, seq_lens, chain, 0.125, num_splits=2)
    last = paged_decode_attention(q.view(2, t, 4, 64)[:, -1].contiguous(), k, v, tables, seq_lens, 0.125)
    torch.testing.assert_close(out.view(2, t, 4, 64)[:, -1], last, atol=1e-5, rtol=1e-5)


def test_tree_many_query_blocks():
    """T * group > 128 rows: the (token, head) axis spans several query blocks."""
    t, group = 40, 4
    k, v, tables = make_paged([50], 1, 64, 16, torch.float32, 0, False, "plain")
    q = torch.randn(t, group, 64, device=DEVICE)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None].to(DEVICE)
    seq_lens = torch.tensor([50], dtype=torch.int32, device=DEVICE)
    meta = AttnMetadata("verify", torch.tensor([0, t], dtype=torch.int32, device=DEVICE), seq_lens, tables,
                        torch.zeros(t, dtype=torch.long, device=DEVICE), t, mask)  # fmt: skip
    out = paged_tree_attention(q, k, v, tables, seq_lens, mask, 0.125, num_splits=1)
    check_close(out, paged_attention_reference(q, k, v, meta, 0.125), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_rows_give_zeros(num_splits):
    """Graph-padding sequences (seq_len 0, block table all -1) come out as zeros, never NaN or a bad read."""
    k, v, tables = make_paged([90, 1], 1, 64, 16, torch.float32, 0, False, "plain")
    tables[1] = -1
    seq_lens = torch.tensor([90, 0], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(torch.randn(2, 2, 64, device=DEVICE), k, v, tables, seq_lens, 0.125,
                                 num_splits=num_splits)  # fmt: skip
    assert torch.isfinite(out).all() and not out[1].any() and out[0].abs().sum() > 0
    mask = torch.ones(2, 4, 4, dtype=torch.bool, device=DEVICE).tril()
    out = paged_tree_attention(torch.randn(8, 2, 64, device=DEVICE), k, v, tables, seq_lens, mask, 0.125,
                               num_splits=num_splits)  # fmt: skip
    assert torch.isfinite(out).all() and not out[4:].any() and out[:4].abs().sum() > 0


# ------------------------------------------------------------------------------------------------ host side
def test_choose_num_splits():
    assert choose_num_splits(work_items=512, max_ctx=32768, sm_count=132) == 1  # enough programs already
    s = choose_num_splits(work_items=4, max_ctx=32768, sm_count=132)  # batch 1, 4 KV heads, long context
    assert 32 <= s <= 64
    assert choose_num_splits(work_items=4, max_ctx=300, sm_count=132) == 1  # chunks keep MIN_CHUNK positions
    assert choose_num_splits(work_items=4, max_ctx=4 * MIN_CHUNK, sm_count=132) == 4


@pytest.mark.parametrize("max_ctx", [1, 63, 64, 1000, 4096])
@pytest.mark.parametrize("splits", [1, 3, 7, 64])
def test_clamp_splits_keeps_a_tile_per_split(max_ctx, splits):
    n = clamp_splits(splits, max_ctx, 64)
    assert 1 <= n <= splits and (n == splits or n == -(-max_ctx // 64))


@pytest.mark.parametrize("merge", ["in-launch", "separate"])
def test_split_merge_paths_agree_and_leave_counters_zeroed(merge, monkeypatch):
    """The last program of a (sequence, KV head) merges the partials and zeroes its arrival counter, so the
    next launch starts clean; without a counter buffer a second kernel merges them, to the same result."""
    import tlt_rt.codegen.kernels.decode_attention as dec

    if merge == "separate":
        monkeypatch.setattr(dec, "split_counters", lambda device, n: None)
    lens = [5, 130, 257]
    k, v, tables = make_paged(lens, 2, 64, 16, torch.float32, 2, True, "plain")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 4, 64, device=DEVICE)
    meta = AttnMetadata("decode", torch.arange(4, dtype=torch.int32, device=DEVICE), seq_lens, tables,
                        torch.zeros(3, dtype=torch.long, device=DEVICE), 1)  # fmt: skip
    ref = paged_attention_reference(q, k, v, meta, 0.125)
    for _ in range(2):  # twice: a counter left non-zero by the first launch would break the second
        check_close(paged_decode_attention(q, k, v, tables, seq_lens, 0.125, num_splits=4), ref, torch.float32)
    t = 3
    mask = torch.ones(3, t, t, dtype=torch.bool).tril().to(DEVICE)
    qt = torch.randn(3 * t, 4, 64, device=DEVICE)
    meta_t = AttnMetadata("verify", torch.arange(4, dtype=torch.int32, device=DEVICE) * t, seq_lens, tables,
                          torch.zeros(3 * t, dtype=torch.long, device=DEVICE), t, mask)  # fmt: skip
    ref_t = paged_attention_reference(qt, k, v, meta_t, 0.125)
    for _ in range(2):
        check_close(paged_tree_attention(qt, k, v, tables, seq_lens, mask, 0.125, num_splits=4), ref_t, torch.float32)
    assert not split_counters(torch.device(DEVICE), 1).any()


def test_rejects_bad_inputs():
    k, v, tables = make_paged([20], 2, 64, 16, torch.float32, 0, False, "plain")
    seq_lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 3, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="multiple of n_kv_heads"):
        paged_decode_attention(q, k, v, tables, seq_lens, 0.1)
    with pytest.raises(AssertionError, match="dtypes differ"):
        paged_decode_attention(torch.randn(1, 4, 64, device=DEVICE).half(), k, v, tables, seq_lens, 0.1)
    with pytest.raises(AssertionError, match="int32"):
        paged_decode_attention(torch.randn(1, 4, 64, device=DEVICE), k, v, tables, seq_lens.long(), 0.1)
    with pytest.raises(AssertionError, match="tree_mask"):
        paged_tree_attention(torch.randn(3, 4, 64, device=DEVICE), k, v, tables, seq_lens,
                             torch.ones(1, 3, 3, dtype=torch.int32, device=DEVICE), 0.1)  # fmt: skip
    with pytest.raises(AssertionError, match="B\\*T=3"):
        paged_tree_attention(torch.randn(4, 4, 64, device=DEVICE), k, v, tables, seq_lens,
                             torch.ones(1, 3, 3, dtype=torch.bool, device=DEVICE), 0.1)  # fmt: skip


# ------------------------------------------------------------------------------------------------ backend
def _batch(mode: str):
    lens, t = [19, 70], 3 if mode == "verify" else 1
    k, v, tables = make_paged(lens, 2, 64, 16, torch.float32, 1, True, "plain")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    if mode == "prefill":  # chunked prefill: 4 and 6 new tokens at the ends of the two sequences
        cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
        meta = AttnMetadata("prefill", cu, seq_lens, tables, torch.zeros(10, dtype=torch.long, device=DEVICE), 6)
        return torch.randn(10, 4, 64, device=DEVICE), k, v, meta
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3).contiguous()
    meta = AttnMetadata(mode, torch.arange(3, dtype=torch.int32, device=DEVICE) * t, seq_lens, tables,
                        torch.zeros(2 * t, dtype=torch.long, device=DEVICE), t,
                        mask.to(DEVICE) if mode == "verify" else None)  # fmt: skip
    return torch.randn(2 * t, 4, 64, device=DEVICE), k, v, meta


@pytest.mark.parametrize("mode", ["decode", "verify", "prefill"])
@pytest.mark.parametrize("num_splits", [None, 2])
def test_triton_backend_matches_torch_backend(mode, num_splits):
    q, k, v, meta = _batch(mode)
    meta.validate(q.shape[0])
    out = TritonAttention(num_splits=num_splits)(q, k, v, meta, 0.125)
    check_close(out, TorchAttention()(q, k, v, meta, 0.125), torch.float32)


@given(data=st.data())
def test_batched_prefill_equals_one_sequence_at_a_time(data):
    """Prefill packs chunks of different lengths, each at the end of its cached tokens; grouping sequences
    into padded batches gives what dense causal attention over each sequence on its own gives."""
    lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    chunks = [data.draw(st.integers(0, n)) for n in lens]
    budget = data.draw(st.sampled_from([1, 64, 1 << 16]))  # one sequence a group, a few, all at once
    k, v, tables = make_paged(lens, 2, 16, 8, torch.float32, 1, True, "plain")
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    n = int(cu[-1])
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    meta = AttnMetadata("prefill", cu, seq_lens, tables, torch.zeros(n, dtype=torch.long, device=DEVICE), max(chunks))
    q = torch.randn(n, 4, 16, device=DEVICE)
    saved, attention.PREFILL_GROUP_KEYS = attention.PREFILL_GROUP_KEYS, budget
    try:
        out = paged_attention_reference(q, k, v, meta, 0.25)
    finally:
        attention.PREFILL_GROUP_KEYS = saved
    for b, (total, qn) in enumerate(zip(lens, chunks, strict=True)):
        if qn == 0:
            continue
        slots = torch.tensor([int(tables[b, p // 8]) * 8 + p % 8 for p in range(total)], device=DEVICE)
        kb = k.reshape(-1, 2, 16)[slots].repeat_interleave(2, dim=1)  # [total, Hq, D]
        vb = v.reshape(-1, 2, 16)[slots].repeat_interleave(2, dim=1)
        qb = q[int(cu[b]) : int(cu[b + 1])]
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * 0.25
        allowed = torch.arange(total, device=DEVICE)[None] <= torch.arange(total - qn, total, device=DEVICE)[:, None]
        want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vb)
        torch.testing.assert_close(out[int(cu[b]) : int(cu[b + 1])], want, atol=1e-5, rtol=1e-5)


def test_select_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend("cpu").name == "torch"
    assert select_backend("cpu", "torch").name == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend("cpu", "triton")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("cpu", "flash")
    assert select_backend(torch.device("cuda")).name == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # the interpreter makes kernels testable on CPU, but "auto" still runs models on the torch path there
    assert select_backend("cpu").name == "torch"
    assert select_backend("cpu", "triton").name == "triton"
    with pytest.raises(ValueError, match="num_splits"):
        TritonAttention(num_splits=0)


# ------------------------------------------------------------------------------------------------ GPU shapes
QWEN_7B = dict(n_heads=28, n_kv=4, head_dim=128, page=16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("batch", "ctx", "n_tree"), [(1, 32768, 64), (4, 8192, 48), (16, 4096, 16),
                                                      (64, 1024, 8), (64, 2048, 1)])  # fmt: skip
def test_qwen7b_shapes_on_gpu(dtype, batch, ctx, n_tree):
    """Qwen2.5-7B attention (28 q heads, 4 KV heads, head dim 128): decode and verify against the reference."""
    h, hkv, d, page = QWEN_7B["n_heads"], QWEN_7B["n_kv"], QWEN_7B["head_dim"], QWEN_7B["page"]
    lens = torch.randint(ctx // 2, ctx + 1, (batch,)).tolist()
    k, v, tables = make_paged(lens, hkv, d, page, dtype, 1, True, "plain")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    q = torch.randn(batch * n_tree, h, d, device=DEVICE).to(dtype)
    if n_tree == 1:
        out = paged_decode_attention(q, k, v, tables, seq_lens, scale)
        meta = AttnMetadata("decode", torch.arange(batch + 1, dtype=torch.int32, device=DEVICE), seq_lens, tables,
                            torch.zeros(batch, dtype=torch.long, device=DEVICE), 1)  # fmt: skip
    else:
        parents = [torch.randint(0, max(i, 1), (batch,)) for i in range(n_tree)]
        mask = torch.zeros(batch, n_tree, n_tree, dtype=torch.bool)
        for i in range(n_tree):
            mask[:, i, i] = True
            if i:
                mask[:, i] |= mask[torch.arange(batch), parents[i]]
        mask = mask.to(DEVICE)
        out = paged_tree_attention(q, k, v, tables, seq_lens, mask, scale)
        meta = AttnMetadata("verify", torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * n_tree,
                            seq_lens, tables, torch.zeros(batch * n_tree, dtype=torch.long, device=DEVICE),
                            n_tree, mask)  # fmt: skip
    check_close(out, fp32_reference(q, k, v, meta, scale), dtype)
