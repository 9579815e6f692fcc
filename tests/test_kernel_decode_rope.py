"""Decode attention with the new token's rotary and K/V write fused in, against rotary + write + paged attention
(the two-kernel path's references), interpreted on CPU and compiled on CUDA."""

from __future__ import annotations

import importlib
import os

import torch

# See tests/test_kernel_attention.py: the interpreter must be on before the kernel modules load.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import tlt_rt.codegen.kernels.decode_attention as _dec
    import tlt_rt.codegen.kernels.decode_rope_attention as _rope_dec
    import tlt_rt.codegen.kernels.paged as _paged

    if _paged.compiled_for_gpu(_rope_dec._decode_rope_attention_kernel):  # imported earlier, compiled
        importlib.reload(_dec)
        importlib.reload(_rope_dec)

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tlt_rt.codegen.kernels.decode_rope_attention import decode_rope_attention  # noqa: E402
from tlt_rt.codegen.kernels.rope_cache import rope_write_kv_reference  # noqa: E402
from tlt_rt.models.attention import AttnMetadata, paged_attention_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16


def rope_inv_freq_of(head_dim: int, theta: float) -> torch.Tensor:
    return (1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()


def _case(lens, n_heads, n_kv, head_dim, dtype, seed):
    """A shuffled paged cache holding len - 1 tokens of each sequence, this step's un-rotated q / k / v as views of
    one projection, and the decode metadata whose slots are each sequence's position len - 1."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in lens]
    num_blocks = sum(need) + 2
    width = max(need) + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    shape = (num_blocks, PAGE, n_kv, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    b = len(lens)
    qkv = torch.randn(b, n_heads + 2 * n_kv, head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([n_heads, n_kv, n_kv], dim=1)
    lens_t = torch.tensor(lens)
    positions = lens_t - 1
    slots = (tables[torch.arange(b), positions // PAGE].long() * PAGE + positions % PAGE).long()
    dev = [t.to(DEVICE) for t in (q, k, v, positions, slots, k_cache, v_cache)]
    meta = AttnMetadata("decode", torch.arange(b + 1, dtype=torch.int32, device=DEVICE), lens_t.int().to(DEVICE),
                        tables.to(DEVICE), dev[4], 1, slots_resolved=True)  # fmt: skip
    return dev, meta


def _reference(q, k, v, positions, slots, k_cache, v_cache, meta, inv_freq, scale):
    kc, vc = k_cache.clone(), v_cache.clone()
    q_rot = rope_write_kv_reference(q, k, v, positions, inv_freq, kc, vc, slots)
    return paged_attention_reference(q_rot, kc, vc, meta, scale), kc, vc


@settings(deadline=None, max_examples=8)
@given(
    lens=st.lists(st.integers(1, 140), min_size=1, max_size=3),
    shape=st.sampled_from([(4, 2, 32), (6, 2, 64), (2, 2, 32)]),
    splits=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 999),
)
def test_matches_rotary_write_then_attention(lens, shape, splits, seed):
    n_heads, n_kv, head_dim = shape
    (q, k, v, positions, slots, k_cache, v_cache), meta = _case(lens, n_heads, n_kv, head_dim, torch.float32, seed)
    inv_freq = rope_inv_freq_of(head_dim, 10000.0).to(DEVICE)
    scale = head_dim**-0.5
    want, want_k, want_v = _reference(q, k, v, positions, slots, k_cache, v_cache, meta, inv_freq, scale)
    got = decode_rope_attention(q, k, v, positions, inv_freq, k_cache, v_cache, slots, meta.block_tables,
                                meta.seq_lens, scale, num_splits=splits)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_cache, want_k, atol=1e-6, rtol=1e-6)  # the new token's K/V written, nothing else
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)


def test_reading_ahead_of_the_wait_changes_nothing(monkeypatch):
    """The lengths, tables and first cache tile read before the PDL wait (EARLY_LOADS) or after it: the same output
    and cache, bit for bit (chunks of one tile and of several, an empty split)."""
    import tlt_rt.codegen.kernels.decode_rope_attention as mod

    outs = []
    for early in (True, False):
        monkeypatch.setattr(mod, "EARLY_LOADS", early)
        (q, k, v, positions, slots, k_cache, v_cache), meta = _case([3, 70, 140], 6, 2, 32, torch.float32, 5)
        inv_freq = rope_inv_freq_of(32, 10000.0).to(DEVICE)
        for splits in (1, 3, 8):
            got = decode_rope_attention(q, k, v, positions, inv_freq, k_cache, v_cache, slots, meta.block_tables,
                                        meta.seq_lens, 0.2, num_splits=splits)  # fmt: skip
            outs.append((got, k_cache.clone(), v_cache.clone()))
    for a, b in zip(outs[:3], outs[3:], strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("extra", "block_s"),
    [
        ({"merge_tile": 16 * 32 * 2}, 2),  # 16 padded rows x 2 splits x head size 32
        ({"merge_tile": 1 << 20, "maxnreg": 128}, 8),
        ({"merge_tile": 4 * 32 * 2, "tight_merge": 1}, 2),  # the group's 3 heads padded to 4 rows only
    ],
)
def test_a_smaller_merge_step_or_a_register_cap_keeps_the_result(monkeypatch, extra, block_s):
    """DECODE_META's optional merge tile (here two splits a merge step, or every split at once), register cap and
    merge over the group's rows only: the output within fp32 rounding of the reference over 1-8 splits (the merge's
    online sum in other steps), the new token's K/V written the same."""
    import tlt_rt.codegen.kernels.decode_rope_attention as mod
    from tlt_rt.codegen.kernels.paged import merge_block_s

    rows = 4 if extra.get("tight_merge") else 16  # 3 heads a KV head: the products pad them to 16 rows
    assert merge_block_s(rows, 8, 32, extra["merge_tile"]) == block_s
    monkeypatch.setattr(mod, "DECODE_META", {**mod.DECODE_META, **extra})
    (q, k, v, positions, slots, k_cache, v_cache), meta = _case([5, 70, 140], 6, 2, 32, torch.float32, 11)
    inv_freq = rope_inv_freq_of(32, 10000.0).to(DEVICE)
    want, want_k, want_v = _reference(q, k, v, positions, slots, k_cache, v_cache, meta, inv_freq, 0.2)
    for splits in (1, 3, 8):
        kc, vc = k_cache.clone(), v_cache.clone()
        got = decode_rope_attention(q, k, v, positions, inv_freq, kc, vc, slots, meta.block_tables, meta.seq_lens,
                                    0.2, num_splits=splits)  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kc, want_k, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(vc, want_v, atol=0, rtol=0)


def test_bf16_within_rounding_of_the_two_kernels():
    (q, k, v, positions, slots, k_cache, v_cache), meta = _case([1, 40, 100], 6, 2, 64, torch.bfloat16, 3)
    inv_freq = rope_inv_freq_of(64, 1e6).to(DEVICE)
    want, want_k, _ = _reference(q, k, v, positions, slots, k_cache, v_cache, meta, inv_freq, 0.125)
    got = decode_rope_attention(q, k, v, positions, inv_freq, k_cache, v_cache, slots, meta.block_tables,
                                meta.seq_lens, 0.125)  # fmt: skip
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(k_cache.float(), want_k.float(), atol=1e-2, rtol=1e-2)


def test_rejects_what_it_does_not_take():
    (q, k, v, positions, slots, k_cache, v_cache), meta = _case([5, 9], 4, 2, 32, torch.float32, 1)
    inv_freq = rope_inv_freq_of(32, 10000.0).to(DEVICE)
    args = (positions, inv_freq, k_cache, v_cache, slots, meta.block_tables, meta.seq_lens, 0.2)
    with pytest.raises(ValueError, match="must be \\[B=2, Hkv=2, D=32\\]"):
        decode_rope_attention(q, k[:, :1], v, *args)
    with pytest.raises(ValueError, match="inv_freq must be float32"):
        decode_rope_attention(q, k, v, positions, inv_freq.double(), *args[2:])


def _model_step(fuse: bool, seed: int = 0):
    """Logits and cache after one decode step of a tiny qwen2-shaped model (2 sequences, 2 layers) through the Triton
    backend, with the rotary fused into its decode attention or not."""
    from tlt_rt.codegen.backend import TritonAttention
    from tlt_rt.models.arch import ArchConfig
    from tlt_rt.models.llama import CausalLM

    torch.manual_seed(seed)
    arch = ArchConfig(model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, qkv_bias=True,
                      max_position_embeddings=128)  # fmt: skip
    model = CausalLM(arch).to(DEVICE).eval()
    model.fuse_projections()
    model.attn_backend = TritonAttention(fuse_rope=fuse)
    (_, _, _, positions, slots, _, _), meta = _case([9, 30], 4, 2, 32, torch.float32, seed)
    cache = model.make_cache(meta.block_tables.shape[1] * 2 + 2, PAGE)
    g = torch.Generator().manual_seed(seed + 1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    ids = torch.tensor([3, 17], device=DEVICE)
    with torch.no_grad():
        out = model.forward_paged(ids, positions, cache, meta)
    return out.logits, cache


def test_a_model_decode_step_gives_the_two_kernel_logits():
    """CausalLM.forward_paged in decode mode with TritonAttention(fuse_rope=True) equals the glue's rotary + the
    decode kernel: the same logits, the same cache after the step."""
    want, want_cache = _model_step(False)
    got, got_cache = _model_step(True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # (layer 1's K/V come from layer 0's attention, equal up to the order of its sums)
    torch.testing.assert_close(got_cache.k, want_cache.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cache.v, want_cache.v, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA device")
@pytest.mark.parametrize("lens,shape,splits", [([1, 40, 1000], (12, 2, 128), None), ([300], (14, 2, 64), 1),
                                               ([2, 700], (7, 1, 64), 5)])  # fmt: skip
def test_compiled_kernel_on_qwen_heads(lens, shape, splits):
    """Compiled, in bf16 and fp32, on the heads of Qwen2.5-Coder-1.5B / 0.5B and a group of 7: within rounding of
    the two-kernel references, the new K/V in the cache."""
    n_heads, n_kv, head_dim = shape
    inv_freq = rope_inv_freq_of(head_dim, 1e6).to(DEVICE)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        (q, k, v, positions, slots, k_cache, v_cache), meta = _case(lens, n_heads, n_kv, head_dim, dtype, 5)
        want, want_k, want_v = _reference(q, k, v, positions, slots, k_cache, v_cache, meta, inv_freq, head_dim**-0.5)
        got = decode_rope_attention(q, k, v, positions, inv_freq, k_cache, v_cache, slots, meta.block_tables,
                                    meta.seq_lens, head_dim**-0.5, num_splits=splits)  # fmt: skip
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(k_cache.float(), want_k.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)
