"""Scheduler.postprocess: its fast path for the usual step against the general `_append` rule."""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_rt.rollout.block_manager import BlockManager
from tlt_rt.rollout.scheduler import Scheduler
from tlt_rt.rollout.sequence import Sequence


@st.composite
def steps(draw):
    """Sequences near their limits (new tokens, context, stop tokens) and one step's tokens for each."""
    context = draw(st.integers(8, 14))
    seqs, toks = [], []
    for i in range(draw(st.integers(1, 6))):
        prompt = [1] * draw(st.integers(1, 4))
        seq = Sequence(i, i, 0, prompt, 0, draw(st.integers(1, 8)), output=[2] * draw(st.integers(0, 3)))
        seq.stop = draw(st.sampled_from([None, frozenset({5}), frozenset()]))
        seqs.append(seq)
        toks.append(draw(st.lists(st.integers(3, 7), min_size=1, max_size=5)))
    return context, seqs, toks


@settings(max_examples=200, deadline=None)
@given(steps())
def test_postprocess_keeps_what_append_keeps(case):
    context, seqs, toks = case
    lps = [[-0.1 * (j + 1) for j in range(len(t))] for t in toks]
    ref_seqs = copy.deepcopy(seqs)

    def scheduler(running):
        sched = Scheduler(BlockManager(64, 4), 16, 64, Counter(), frozenset({7}), context)
        for s in running:
            sched.blocks.allocate(s.seq_id, len(s.prompt) + len(s.output))
        sched.running = list(running)
        return sched

    sched, ref = scheduler(seqs), scheduler(ref_seqs)
    emitted = sched.postprocess(seqs, SimpleNamespace(tokens=toks, logprobs=lps, hidden=None))
    want = 0
    for s, t, lp in zip(ref_seqs, toks, lps, strict=True):  # the general rule, one sequence at a time
        s.counter += 1
        k = ref._append(s, t, lp)
        s.num_cached += k
        want += k
    assert emitted == want
    for a, b in zip(seqs, ref_seqs, strict=True):
        assert (a.output, a.logprobs, a.num_cached, a.counter, a.finish_reason) == (
            b.output, b.logprobs, b.num_cached, b.counter, b.finish_reason
        )  # fmt: skip
    assert [s.seq_id for s in sched.done] == [s.seq_id for s in ref.done]
    assert sched.stats["generated_tokens"] == want
