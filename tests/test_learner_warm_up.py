"""`Learner.warm_up` leaves nothing for the updates to compile: the compiled glue (inductor, dynamic shapes, as
the engine installs it on a GPU) guards its code on the sizes it met, so the warm-up must meet every side."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tlt_rt.config import RLConfig
from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.llama import CausalLM
from tlt_rt.train.rl.learner import (
    Learner,
    LearnSample,
    MiniBatch,
    SamplingFilter,
    _chunks,
    _token_chunks,
    _warm_up_shapes,
)

ARCH = ArchConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, qkv_bias=True)  # fmt: skip


def _samples(lengths: list[int]) -> list[LearnSample]:
    return [LearnSample([1, 2, 3], [5] * (n - 3), [-1.0] * (n - 3), 1.0) for n in lengths]


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor needs a C++ compiler on CPU")
def test_no_update_compiles_after_warm_up():
    """On a CPU, inductor's backward of a norm sums its weight gradient over the B x T rows and guards on
    B*T <= 4096 (its accumulation changes past it): with a warm-up of a few rows only, the first update of
    thousands compiled both norms again, and so did a later one with a lone long sample (a batch of one)."""
    torch._dynamo.reset()
    try:
        model = CausalLM(ARCH)
        model.compile_glue()
        learner = Learner(model, RLConfig(micro_batch_tokens=6000), SamplingFilter())
        assert learner.warm_up() > 0
        # micro-batches (samples x rows): 3 x 1699, then a few rows, then one long sample alone, then mixed
        for lengths in ([1500, 1600, 1700], [20, 30, 40], [5000], [10, 900, 1000, 1100, 1200, 3000], [25]):
            out = learner.update([MiniBatch(_samples(lengths), num_tokens=sum(lengths), num_seqs=len(lengths))])
            assert out.compiles == 0, lengths
    finally:
        torch._dynamo.reset()


def _doubling(rows: int) -> int:
    return (rows - 1).bit_length()  # k for rows in (2^(k-1), 2^k]


@given(
    budget=st.sampled_from([0, 64, 6000, 8192, 16384]),
    per_batch=st.integers(1, 8),
    max_len=st.integers(8, 5000),
    lengths=st.lists(st.integers(2, 5000), min_size=1, max_size=64),
    align=st.sampled_from([0, 8]),
)
def test_warm_up_meets_every_doubling_a_run_can_make(budget, per_batch, max_len, lengths, align):
    """Every micro-batch a run can cut has a warm-up shape of its kind (one sample, or several) whose rows
    (T, or B x T) lie in the same doubling, with `align` also one of the same alignment (T a multiple of 8 or
    not), and no warm-up micro-batch is larger than the run's can be nor of the avoided size."""
    lengths = [min(n, max_len) for n in lengths]
    shapes = _warm_up_shapes(budget, per_batch, max_len, align, avoid=(64,))
    assert all(t != 64 for _, t in shapes) or not align
    longest = max_len - 1
    largest = budget or per_batch * longest
    assert shapes[0] == (1, 7) and all(t <= longest and (b == 1 or b * t <= largest) for b, t in shapes)
    ones = {_doubling(t) for b, t in shapes if b == 1}
    several = {_doubling(b * t) for b, t in shapes if b > 1}
    samples = [LearnSample([1], [2] * (n - 1), [0.0] * (n - 1), 0.0) for n in lengths]
    for chunk in _token_chunks(samples, budget) if budget else _chunks(samples, per_batch):
        t = max(len(s.prompt) + len(s.response) for s in chunk) - 1
        rows = len(chunk) * t
        if rows >= 8:  # below, sizes too small to matter
            assert _doubling(rows) in (ones if len(chunk) == 1 else several), (len(chunk), t)
        if align and t >= 16:
            kind = [(b, u) for b, u in shapes if (b == 1) == (len(chunk) == 1) and (u % align == 0) == (t % align == 0)]
            key = _doubling(rows)
            assert any(_doubling(b * u if b > 1 else u) == key for b, u in kind), (len(chunk), t)


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor needs a C++ compiler on CPU")
def test_compiled_layers_update_as_eager_and_compile_only_in_warm_up():
    """`CausalLM.compile_layers` (the learner's default on a GPU, forced on here on a CPU): one update moves the
    weights as the eager layers do, the layers share one compiled graph per kind of shape, and after the
    warm-up no update compiles anything, whatever its micro-batches' shapes."""
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        eager, compiled = CausalLM(ARCH), CausalLM(ARCH)
        compiled.load_state_dict(eager.state_dict())
        assert RLConfig().compile_layers  # on by default; a CPU learner leaves it off
        learners = [Learner(m, RLConfig(micro_batch_tokens=6000, lr=1e-3), SamplingFilter()) for m in (eager, compiled)]
        assert not compiled.compile_layers
        compiled.compile_layers = True
        assert learners[1].warm_up() > 0
        assert compiled.state_dict().keys() == eager.state_dict().keys()  # the compiled layers stay out of it
        for lengths in ([1500, 1600, 1700], [20, 30, 40], [25]):
            batch = [MiniBatch(_samples(lengths), num_tokens=sum(lengths), num_seqs=len(lengths))]
            outs = [learner.update(batch) for learner in learners]
            assert outs[1].compiles == 0, lengths
            assert outs[0].loss == pytest.approx(outs[1].loss, rel=1e-4, abs=1e-6)
            for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor needs a C++ compiler on CPU")
def test_compiled_layers_under_activation_checkpointing_give_eager_gradients():
    """The larger configs keep only each layer's input (`rl.activation_checkpointing`); a compiled layer then runs
    inside the checkpoint, its forward again in the backward, and the gradients are the eager layers'."""
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = CausalLM(ARCH)
        ids = torch.randint(0, ARCH.vocab_size, (3, 17))
        model(ids).logits.square().mean().backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        model.compile_layers = model.checkpoint_layers = True
        model(ids).logits.square().mean().backward()
        for (name, p), g in zip(model.named_parameters(), want, strict=True):
            torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5, msg=name)
    finally:
        torch._dynamo.reset()
