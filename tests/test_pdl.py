"""Programmatic dependent launch off the GPU: the flags fall away where PDL cannot run, so the kernels run as before,
and `rollout.pdl` reaches the glue and the attention backend. (The PDL contract in the kernels' PTX is checked by
tests/kernel_compile_check.py; their results with PDL on by tests/test_pdl_gpu.py.)"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers.engine import PROMPTS, make_engine  # noqa: E402
from tlt_rt.codegen.backend import TritonAttention, select_backend  # noqa: E402
from tlt_rt.codegen.model_kernels import KernelGlue  # noqa: E402
from tlt_rt.models.glue import Glue  # noqa: E402
from tlt_rt.rollout import SamplingParams  # noqa: E402
from tlt_rt.rollout.config import EngineConfig  # noqa: E402

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="what PDL does off the GPU")


@CPU_ONLY
def test_launch_meta_turns_pdl_off_where_it_cannot_run():
    from tlt_rt.codegen.kernels.pdl import launch_meta, line_elems, pdl_supported

    assert not pdl_supported("cpu")
    assert launch_meta(torch.device("cpu"), True) == {"PDL": False, "launch_pdl": False}
    meta = launch_meta(torch.device("cpu"), True, torch.bfloat16, 1024, prefetch=True)
    assert meta == {"PDL": False, "launch_pdl": False, "PREFETCH": False, "LINE": 64, "LINES": 16}
    assert line_elems(torch.float32) == 32 and launch_meta(torch.device("cpu"), False, torch.float32, 16)["LINES"] == 1
    assert launch_meta(torch.device("cpu"), 2)["PDL"] == 0
    with pytest.raises(ValueError, match="pdl must be"):
        launch_meta(torch.device("cpu"), 4)


def test_signal_first_classes_signal_before_their_wait(monkeypatch):
    """A PDL launch of a class named in SIGNAL_FIRST signals before its wait (SIGNAL_BEFORE_WAIT); other classes,
    and launches signalling at their end, keep their mode; without PDL nothing changes."""
    from tlt_rt.codegen.kernels import pdl
    from tlt_rt.codegen.kernels.skinny_gemm import NARROW_N, launch_kind, row_tiles, skinny_meta

    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)
    monkeypatch.setattr(pdl, "SIGNAL_FIRST", frozenset({"attention", "narrow"}))
    dev = torch.device("cpu")
    assert pdl.launch_meta(dev, True, kind="attention")["PDL"] == pdl.SIGNAL_BEFORE_WAIT
    assert pdl.launch_meta(dev, True, kind="norm")["PDL"] == pdl.SIGNAL_AT_START
    assert pdl.launch_meta(dev, pdl.SIGNAL_AT_END, kind="attention")["PDL"] == pdl.SIGNAL_AT_END
    assert pdl.launch_meta(dev, False, kind="attention") == {"PDL": 0, "launch_pdl": False}

    def kind(rows, k):
        return launch_kind(rows, k, row_tiles(k, skinny_meta(1, rows, k), 2))

    # Qwen2.5-Coder-1.5B's one-row matmuls: o, down (8,960 wide rows), the head
    assert (kind(1536, 1536), kind(1536, 8960), kind(151936, 1536)) == ("narrow", "long", "wide")
    assert kind(NARROW_N - 1, 512) == "narrow" and kind(NARROW_N, 512) == "wide"


@CPU_ONLY
def test_kernels_asked_for_pdl_run_as_without_it_under_the_interpreter():
    from tlt_rt.codegen.kernels.norm_linear import norm_linear
    from tlt_rt.codegen.kernels.skinny_gemm import skinny_linear_triton

    meta = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 1}
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(1, 96, generator=g), torch.randn(1, 96, generator=g)
    w, b, nw = torch.randn(130, 96, generator=g), torch.randn(130, generator=g), torch.rand(96, generator=g)
    plain = skinny_linear_triton(x, w, b, meta=meta)
    assert torch.equal(skinny_linear_triton(x, w, b, meta=meta, pdl=True, prefetch=True), plain)
    torch.testing.assert_close(plain, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    s0, y0 = norm_linear(x, r, nw, 1e-6, w, b, meta=meta)
    s1, y1 = norm_linear(x, r, nw, 1e-6, w, b, meta=meta, pdl=True, prefetch=True)
    assert torch.equal(s0, s1) and torch.equal(y0, y1)


def test_decode_chain_sets_and_restores_the_glue():
    glue = KernelGlue(pieces=Glue())
    assert glue.linear is F.linear and not (glue.pdl or glue.skinny or glue.fused_norm)
    glue.decode_chain(pdl=True)
    assert glue.pdl and not glue.prefetch and glue.skinny and glue.fused_norm and glue.skinny_min_weight == 0
    assert glue.linear == glue._skinny_linear
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    torch.testing.assert_close(glue.linear(x, w), F.linear(x, w))  # on CPU: F.linear behind the kernel's choice
    glue.decode_chain(pdl=False)
    assert glue.skinny and not glue.pdl
    glue.decode_chain(False, pdl=True)
    assert glue.linear is F.linear and not (glue.pdl or glue.prefetch or glue.skinny or glue.fused_norm)
    assert glue.skinny_min_weight is None


def test_decode_chain_leaves_weights_over_its_limit_to_cublas(monkeypatch):
    """`decode_chain(max_weight=N)` (`rollout.decode_chain_max_weight`): the chain's kernels take weights of at most N
    elements; larger ones go to F.linear (cuBLAS), their gate/up activation and add + norm to the compiled glue."""
    import tlt_rt.codegen.model_kernels as mk
    from tlt_rt.codegen.kernels import skinny_gemm

    taken = []
    monkeypatch.setattr(mk, "_inference_linear", lambda x, w, b=None, *a: taken.append(w.numel()) or F.linear(x, w, b))

    def swiglu_kernel(x, w, *a):
        taken.append(("swiglu", w.numel()))
        return torch.zeros(x.shape[0], w.shape[0] // 2)

    monkeypatch.setattr(skinny_gemm, "skinny_swiglu", swiglu_kernel)
    glue = KernelGlue(pieces=Glue())
    glue.decode_chain(pdl=True, max_weight=200)
    x = torch.randn(1, 16)
    small, big = torch.randn(8, 16), torch.randn(32, 16)  # 128 and 512 elements
    with torch.no_grad():  # inference: where the chain's kernels apply
        torch.testing.assert_close(glue.linear(x, small), F.linear(x, small))
        torch.testing.assert_close(glue.linear(x, big), F.linear(x, big))
        gate, up = F.linear(x, big).chunk(2, dim=-1)
        torch.testing.assert_close(glue.linear_swiglu(x, big), F.silu(gate) * up)  # the glue's activation
        assert torch.equal(glue.linear_swiglu(x, small), torch.zeros(1, 4))  # the chain's kernel (a stand-in here)
    assert taken == [128, ("swiglu", 128)]
    glue.decode_chain(False, max_weight=200)
    assert glue.max_weight == 0 and glue.linear is F.linear
    assert EngineConfig().decode_chain_max_weight == 0
    with pytest.raises(ValueError, match="decode_chain_max_weight"):
        EngineConfig(decode_chain_max_weight=-1)


def test_rollout_decode_chain_and_pdl_reach_the_kernels_and_keep_the_tokens():
    assert EngineConfig().pdl is False and EngineConfig().decode_chain is False
    with pytest.raises(ValueError, match="pdl: launches the decode chain"):
        EngineConfig(pdl=True)
    attn = select_backend("cpu", "triton", fuse_rope=True, pdl=True)
    assert isinstance(attn, TritonAttention) and attn.pdl and attn.eager().pdl
    assert not select_backend("cpu", "triton").pdl
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    outs = []
    for chain in (False, True):
        engine = make_engine(speculative="on", decode_chain=chain, pdl=chain)  # off the GPU: the torch kernels
        assert engine.config.pdl is chain and engine.glue is None
        outs.append([o.token_ids for o in engine.generate(PROMPTS[:2], params)])
    assert outs[0] == outs[1]
