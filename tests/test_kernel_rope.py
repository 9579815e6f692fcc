"""Fused rotary + KV-cache write kernel against rotate_pair + write_kv (interpreter on CPU)."""

from __future__ import annotations

import importlib
import os

import torch

# See tests/test_kernel_attention.py: the interpreter must be on before the kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import tlt_rt.codegen.kernels.rope_cache as _rope

    if isinstance(_rope._rope_write_kernel, triton.runtime.JITFunction):  # imported earlier, compiled
        importlib.reload(_rope)

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tlt_rt.codegen.kernels.rope_cache import rope_write_kv, rope_write_kv_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@settings(deadline=None, max_examples=10)
@given(
    n=st.integers(1, 6),
    n_kv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 5]),
    dim=st.sampled_from([8, 16, 24]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_matches_rotate_then_write(n, n_kv, group, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hq = n_kv * group
    # q / k / v as strided views of one fused projection, as the engine's forward makes them
    qkv = torch.randn(n, (hq + 2 * n_kv) * dim, generator=g).to(DEVICE, dtype)
    q, k, v = (t.view(n, -1, dim) for t in qkv.split([hq * dim, n_kv * dim, n_kv * dim], dim=-1))
    positions = torch.randint(0, 5000, (n,), generator=g).to(DEVICE)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)).to(DEVICE)
    num_blocks, page = 5, 4
    slots = torch.randperm(num_blocks * page, generator=g)[:n].to(DEVICE)
    caches = [torch.randn(num_blocks, page, n_kv, dim, generator=g).to(DEVICE, dtype) for _ in range(2)]
    ref_k, ref_v = (c.clone() for c in caches)
    ref_q = rope_write_kv_reference(q, k, v, positions, inv_freq, ref_k, ref_v, slots)
    got_q = rope_write_kv(q, k, v, positions, inv_freq, caches[0], caches[1], slots)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(got_q, ref_q, **tol)
    torch.testing.assert_close(caches[0], ref_k, **tol)
    torch.testing.assert_close(caches[1], ref_v, atol=0, rtol=0)  # V is copied bit for bit


def test_bad_shapes_are_named():
    q = torch.randn(2, 4, 8, device=DEVICE)
    k = torch.randn(2, 2, 8, device=DEVICE)
    cache = torch.zeros(3, 4, 2, 8, device=DEVICE)
    inv = torch.ones(4, device=DEVICE)
    pos = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        rope_write_kv(q, k, k[:, :1], pos, inv, cache, cache, pos)
    with pytest.raises(ValueError, match="inv_freq"):
        rope_write_kv(q, k, k, pos, inv.double(), cache, cache, pos)
