"""The drafter's eager catch-up (`models/drafter_catchup.py`): every row's K/V exactly as the whole layer's forward
writes them, and each sequence's last row's logits and hidden as that forward gives them, over packed chunks of
different lengths after cached prefixes of different lengths; and a speculative engine that catches up after
plain stretches still emits plain decoding's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tlt_rt.models.drafter_catchup import catch_up_rows
from tlt_rt.rollout import SamplingParams
from tlt_rt.rollout.step.target import Layout, build_meta

from .helpers.drafter import tiny_pair
from .helpers.engine import PROMPTS, make_engine

BLOCK = 4


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_catch_up_rows_write_the_forward_s_kv_and_give_its_last_rows(model_type):
    target, drafter = tiny_pair(model_type, seed=3)
    g = torch.Generator().manual_seed(5)
    prefix, chunk = [0, 7, 2], [5, 9, 1]  # cached drafter rows before, rows to catch up now
    tables = [[3, 8, 1, 0], [2, 6, 9, 4], [5, 7, 10, 11]]
    caches = [drafter.make_cache(12, BLOCK) for _ in range(2)]
    with torch.no_grad():
        k, v = torch.randn(caches[0].k.shape, generator=g), torch.randn(caches[0].v.shape, generator=g)
        for c in caches:  # identical caches holding every sequence's prefix (random K/V, as earlier steps left)
            c.k.copy_(k)
            c.v.copy_(v)
        meta, positions = build_meta(Layout(tables, prefix, chunk), "prefill", BLOCK, "cpu")
        n = sum(chunk)
        ids = torch.randint(0, target.arch.vocab_size, (n,), generator=g)
        feats = torch.randn(n, target.arch.hidden_size, generator=g)
        last = meta.cu_seqlens_q[1:].long() - 1
        whole = drafter.forward_paged(ids, feats, positions, caches[0], meta, logits_indices=last, full_vocab=False)
        meta, positions = build_meta(Layout(tables, prefix, chunk), "prefill", BLOCK, "cpu")
        rows = catch_up_rows(drafter, ids, feats, positions, caches[1], meta, last)
    assert torch.equal(caches[1].k, caches[0].k) and torch.equal(caches[1].v, caches[0].v)
    torch.testing.assert_close(rows.logits, whole.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows.hidden, whole.hidden[last], atol=1e-5, rtol=1e-5)
    assert rows.logits.shape == (3, drafter.head_weight().shape[0])


def test_an_engine_catching_up_after_plain_stretches_keeps_plain_greedy_tokens():
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=[])
    plain = make_engine("off").generate(PROMPTS, params)
    engine = make_engine("auto", block_size=4)
    calls = {"n": 0}

    def decide(batch, behind=0):  # plain for five steps, then one speculative step, and again
        calls["n"] += 1
        return engine.strategies[0] if calls["n"] % 6 == 0 else None

    engine.policy.decide = decide
    caught = []
    real = engine.runner.drafter.catch_up
    engine.runner.drafter.catch_up = lambda *a, **k: caught.append(1) or real(*a, **k)
    spec = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert caught, "the plain stretches left the drafter behind: the speculative steps caught up eagerly"


def test_the_catch_up_attends_through_its_backend_s_eager_variant():
    """A backend with an eager variant (Triton's: one split-K partition, so no call compiles a new kernel variant
    mid-rollout) serves the catch-up's attention; the result is the same as through the backend itself."""
    from tlt_rt.codegen.backend import TritonAttention
    from tlt_rt.models.attention import TorchAttention

    assert TritonAttention().eager().num_splits == 1 and TritonAttention(4).eager().num_splits == 4
    assert TritonAttention(prefill_kernel=False).eager().prefill_kernel is False

    calls = []

    class Eager(TorchAttention):
        def __call__(self, q, k_cache, v_cache, meta, scale):
            calls.append(meta.mode)
            return super().__call__(q, k_cache, v_cache, meta, scale)

    class WithEager(TorchAttention):
        def eager(self):
            return Eager()

    target, drafter = tiny_pair("llama", seed=3)
    g = torch.Generator().manual_seed(5)
    tables, prefix, chunk = [[3, 8, 1, 0], [2, 6, 9, 4]], [0, 7], [5, 2]
    n = sum(chunk)
    ids = torch.randint(0, target.arch.vocab_size, (n,), generator=g)
    feats = torch.randn(n, target.arch.hidden_size, generator=g)
    outs = []
    for backend in (TorchAttention(), WithEager()):
        drafter.attn_backend = backend
        cache = drafter.make_cache(12, BLOCK)
        meta, positions = build_meta(Layout(tables, prefix, chunk), "prefill", BLOCK, "cpu")
        with torch.no_grad():
            outs.append(catch_up_rows(drafter, ids, feats, positions, cache, meta, meta.cu_seqlens_q[1:].long() - 1))
    assert calls == ["decode"]
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].hidden, outs[1].hidden)
