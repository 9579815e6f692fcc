"""The padded one-sequence prefill through the Triton prefill kernel (Triton's interpreter without CUDA) against the
eager unpadded prefill through the torch reference: the kernel sees the padding rows' positions past the real ones
(their table entries point at block 0) and the real rows are unchanged."""

from __future__ import annotations

import importlib
import os

import torch

# the kernels run in Triton's interpreter without CUDA: switched on before the kernel modules load (reloaded if an
# earlier test imported them without it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import tlt_rt.codegen.kernels.decode_attention as _dec
    import tlt_rt.codegen.kernels.paged as _paged
    import tlt_rt.codegen.kernels.prefill_attention as _pre

    if _paged.compiled_for_gpu(_pre._prefill_attention_kernel):
        importlib.reload(_dec)
        importlib.reload(_pre)

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402

from tests.helpers.engine import TINY  # noqa: E402
from tlt_rt.codegen.backend import TritonAttention  # noqa: E402
from tlt_rt.models.attention import TorchAttention  # noqa: E402
from tlt_rt.models.llama import CausalLM  # noqa: E402
from tlt_rt.rollout.step.target import Layout, PaddedPrefill, TargetRunner  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARCH = replace(TINY, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=64)


@pytest.mark.parametrize("start,n", [(0, 11), (5, 3)])
def test_the_triton_prefill_kernel_on_a_padded_chunk_gives_the_unpadded_rows(start, n):
    torch.manual_seed(0)
    target = CausalLM(ARCH).to(DEVICE).eval()
    bs, width, table = 4, 8, [6, 2, 9, 4]
    prompt = torch.randint(0, 11, (start + n,)).tolist()
    outs = []
    for backend, padded in ((TorchAttention(), False), (TritonAttention(), True)):
        target.attn_backend = backend
        runner = TargetRunner(target, 12, bs)
        torch.manual_seed(1)
        for c in (runner.cache.k, runner.cache.v):
            c.normal_()  # block 0 and the rest hold values the padding rows may read
        if start:
            runner.forward(prompt[:start], Layout([table], [0], [start]), "prefill", logits_rows=[start - 1])
        if padded:
            outs.append(PaddedPrefill(runner, width, [16])(prompt[start:], start, table, 16))
        else:
            outs.append(runner.forward(prompt[start:], Layout([table], [start], [n]), "prefill", logits_rows=[n - 1]))
    want, got = outs
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-4, atol=1e-4)
