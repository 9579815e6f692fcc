"""The glue the engine hands its model (codegen/model_kernels.py): installed once on every module, the compiled
functions of an earlier CompiledGlue kept, the references wherever a kernel does not apply, and on CUDA the
fused rotary + KV write inside the paged forward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.engine import TINY
from tlt_rt.codegen.model_kernels import KernelGlue, engine_glue
from tlt_rt.models.generate import generate_simple
from tlt_rt.models.glue import CompiledGlue, Glue
from tlt_rt.models.llama import CausalLM


def _glues(model: CausalLM) -> set[int]:
    return {id(m.glue) for m in model.modules() if hasattr(m, "glue")}


def test_engine_glue_is_installed_once_and_keeps_the_compiled_functions_of_an_earlier_glue():
    model = CausalLM(TINY)
    assert type(model.model.norm.glue) is Glue
    compiled = model.compile_glue()  # a learner's, before any engine
    assert type(compiled) is CompiledGlue and _glues(model) == {id(compiled)}
    glue = engine_glue(model)
    assert isinstance(glue, KernelGlue) and glue.fused_rope and not glue.skinny
    assert all(getattr(glue, name) is getattr(compiled, name) for name in CompiledGlue.COMPILED)
    assert _glues(model) == {id(glue)}
    assert engine_glue(model) is glue and model.compile_glue() is glue
    fresh = CausalLM(TINY)
    assert isinstance(engine_glue(fresh), KernelGlue) and engine_glue(fresh) is not glue


def test_kernel_glue_runs_the_references_off_cuda_and_with_gradients():
    glue = KernelGlue(skinny=True, pieces=Glue())  # the plain functions, nothing compiled
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    positions, inv_freq, slots = torch.tensor([0, 5, 9]), torch.rand(4), torch.tensor([1, 6, 2])
    caches = [torch.zeros(2, 4, 2, 8) for _ in range(4)]
    want = Glue().rope_write(q, k, v, positions, inv_freq, caches[0], caches[1], slots, resolved=True)
    got = glue.rope_write(q, k, v, positions, inv_freq, caches[2], caches[3], slots, resolved=True)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    x, w = torch.randn(1, 16), torch.randn(24, 16)
    assert torch.equal(glue.linear(x, w), F.linear(x, w))  # gradients on: F.linear, no Triton
    assert torch.equal(glue.linear_swiglu(x, w), Glue().linear_swiglu(x, w))


@pytest.mark.gpu
def test_on_cuda_the_paged_forward_writes_rotary_and_kv_through_the_fused_kernel(monkeypatch):
    from tlt_rt.codegen.backend import select_backend
    from tlt_rt.codegen.kernels import rope_cache, skinny_gemm

    calls = []
    real = rope_cache.rope_write_kv
    monkeypatch.setattr(rope_cache, "rope_write_kv", lambda *a: calls.append(len(a)) or real(*a))
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a: pytest.fail("skinny matmul without skinny=True"))
    torch.manual_seed(0)
    arch = replace(TINY, head_dim=16)  # the Triton attention's smallest head
    models = [CausalLM(arch).cuda().eval() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for m in models:
        m.attn_backend = select_backend("cuda")
        m.fuse_projections()
    engine_glue(models[1])
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    want = generate_simple(models[0], prompts, 4, eos_ids=())
    assert not calls
    assert generate_simple(models[1], prompts, 4, eos_ids=()) == want
    assert len(calls) == TINY.num_hidden_layers * 4  # every layer of the prefill and of the three decode steps
