"""One draft level's bookkeeping (one Triton launch) against its torch reference (interpreter on CPU)."""

from __future__ import annotations

import importlib
import os

import torch

# See tests/test_kernel_attention.py: the interpreter must be on before the kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import tlt_rt.codegen.kernels.draft_level as _level

    if isinstance(_level._draft_level_kernel, triton.runtime.JITFunction):  # imported earlier, compiled
        importlib.reload(_level)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tlt_rt.codegen.kernels.draft_level import draft_level, draft_level_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@settings(deadline=None, max_examples=12)
@given(
    b=st.integers(1, 4),
    k=st.integers(1, 5),
    levels=st.integers(1, 3),
    h=st.sampled_from([8, 40, 1100]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(b, k, levels, h, dtype, ties, seed):
    g = torch.Generator().manual_seed(seed)
    front = torch.randn(b, k, generator=g)
    lp = -torch.rand(b * k, k, generator=g) * 5
    if ties:  # equal scores must go to the lower index, as a stable sort does
        front = front.round()
        lp = lp.round()
    tok = torch.randint(0, 50_000, (b * k, k), generator=g)
    hidden = torch.randn(b * k, h, generator=g).to(dtype)
    mask = torch.rand(b, k, levels * k, generator=g) < 0.5
    args = [t.to(DEVICE) for t in (front, lp, tok, hidden, mask)]
    got = draft_level(*args, offset=7)
    want = draft_level_reference(*args, offset=7)
    for name, x, y in zip(("score", "flat", "tok", "best", "feats", "mask"), got, want, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(x, y), name
