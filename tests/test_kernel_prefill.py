"""Paged prefill attention (`codegen/kernels/prefill_attention.py`) against `paged_attention_reference`: packed
chunks of any lengths (empty ones too) at the end of their cached tokens, GQA groups, pages, dtypes and cache
layouts; the Triton backend routes prefill through it unless told not to."""

from __future__ import annotations

import importlib
import os

import torch

# Without CUDA the kernel runs in Triton's interpreter, chosen when @triton.jit runs: switched on before our
# kernel modules load (and the modules reloaded if something imported them without it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import tlt_rt.codegen.kernels.decode_attention as _dec
    import tlt_rt.codegen.kernels.paged as _paged
    import tlt_rt.codegen.kernels.prefill_attention as _pre

    if _paged.compiled_for_gpu(_pre._prefill_attention_kernel):
        importlib.reload(_dec)
        importlib.reload(_pre)

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tlt_rt.codegen.backend import TritonAttention  # noqa: E402
from tlt_rt.codegen.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from tlt_rt.models.attention import AttnMetadata, TorchAttention  # noqa: E402

from .test_kernel_attention import DEVICE, check_close, fp32_reference, make_paged  # noqa: E402


def _batch(lens: list[int], chunks: list[int], n_kv: int, group: int, head_dim: int, page: int, dtype, layout: str,
           garbage: bool = True):  # fmt: skip
    k, v, tables = make_paged(lens, n_kv, head_dim, page, dtype, 1, garbage, layout)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    n = int(cu[-1])
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    meta = AttnMetadata("prefill", cu, seq_lens, tables, torch.zeros(n, dtype=torch.long, device=DEVICE),
                        max(chunks))  # fmt: skip
    q = torch.randn(n, n_kv * group, head_dim, device=DEVICE).to(dtype)
    return q, k, v, meta


@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    n_kv=st.integers(1, 2),
    group=st.sampled_from([1, 3, 6]),
    head_dim=st.sampled_from([64, 128]),
    page=st.sampled_from([8, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    layout=st.sampled_from(["plain", "stacked", "heads_major"]),
)
def test_prefill_matches_reference(data, n_kv, group, head_dim, page, dtype, layout):
    lens = data.draw(st.lists(st.integers(1, 90), min_size=1, max_size=4))
    chunks = [data.draw(st.integers(0, n)) for n in lens]
    if not any(chunks):
        chunks[0] = lens[0]
    q, k, v, meta = _batch(lens, chunks, n_kv, group, head_dim, page, dtype, layout)
    out = paged_prefill_attention(q, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.max_q_len,
                                  head_dim**-0.5)  # fmt: skip
    check_close(out, fp32_reference(q, k, v, meta, head_dim**-0.5), dtype)


def test_a_chunk_longer_than_a_tile_attends_causally_inside_itself():
    """One 100-token prompt, no cached prefix (ten tiles of 64 (token, head) rows, two tiles of keys): each token
    sees itself and the tokens before it only."""
    q, k, v, meta = _batch([100], [100], 1, 6, 64, 16, torch.float32, "plain", garbage=False)
    out = paged_prefill_attention(q, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, 100, 0.125)
    check_close(out, fp32_reference(q, k, v, meta, 0.125), torch.float32)
    # the first token sees only itself: its output is its own V row
    slot = int(meta.block_tables[0, 0]) * 16
    want = v.reshape(-1, 1, 64)[slot, 0].expand(6, 64)
    torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused():
    q, k, v, meta = _batch([5, 7], [5, 7], 1, 2, 64, 8, torch.float32, "plain")
    with pytest.raises(AssertionError, match="cu_seqlens_q must be"):
        paged_prefill_attention(q, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q.long(), 7, 0.1)
    with pytest.raises(AssertionError, match="cu_seqlens_q must be"):
        paged_prefill_attention(q, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q[:2], 7, 0.1)
    empty = paged_prefill_attention(q[:0], k, v, meta.block_tables, meta.seq_lens,
                                    torch.zeros(3, dtype=torch.int32, device=DEVICE), 0, 0.1)  # fmt: skip
    assert empty.shape == (0, 2, 64)


@pytest.mark.parametrize("prefill_kernel", [True, False])
def test_the_backend_runs_prefill_through_the_kernel_unless_told_not_to(prefill_kernel, monkeypatch):
    q, k, v, meta = _batch([9, 30], [4, 30], 2, 2, 64, 16, torch.float32, "plain")
    calls = []
    import tlt_rt.codegen.kernels.prefill_attention as kernel_module

    real = kernel_module.paged_prefill_attention
    monkeypatch.setattr(kernel_module, "paged_prefill_attention", lambda *a: calls.append(a) or real(*a))
    out = TritonAttention(prefill_kernel=prefill_kernel)(q, k, v, meta, 0.125)
    assert len(calls) == (1 if prefill_kernel else 0)
    check_close(out, TorchAttention()(q, k, v, meta, 0.125), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("batch", "chunk", "ctx"), [(1, 512, 512), (8, 200, 700), (120, 80, 400)])
def test_qwen_coder_shapes_on_gpu(dtype, batch, chunk, ctx):
    """Qwen2.5-Coder-1.5B attention (12 query heads, 2 KV heads, head dim 128): a prompt, a batch of chunked
    prompts, and a drafter catch-up of ~120 sequences a plain stretch left behind."""
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(ctx // 2, ctx + 1, (batch,), generator=g).tolist()
    chunks = [min(n, int(torch.randint(chunk // 2, chunk + 1, (1,), generator=g))) for n in lens]
    q, k, v, meta = _batch(lens, chunks, 2, 6, 128, 16, dtype, "plain")
    out = paged_prefill_attention(q, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.max_q_len,
                                  128**-0.5)  # fmt: skip
    check_close(out, fp32_reference(q, k, v, meta, 128**-0.5), dtype)
