"""The host side of a decode step's results: `Scheduler.postprocess` (`tlt`, the usual step's tokens appended
inline) against the general per-sequence rule it falls back to (`append`: `Scheduler._append` for every
sequence, what postprocess ran before).

    pytest benchmarks/bench_postprocess.py --benchmark-only

One call applies one step to B running samples far from their limits: a plain step (one token each) or a
speculative step (1..5 tokens each), no stop token among them, no hidden rows. Each round starts from the
same sequences, so every timed call appends to lists of the same lengths.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from tlt_rt.rollout.block_manager import BlockManager
from tlt_rt.rollout.scheduler import Scheduler
from tlt_rt.rollout.sequence import Sequence


def _step(b: int, width: int):
    rng = random.Random(b * 10 + width)
    seqs = [Sequence(i, i, 0, [1] * 100, 0, 4096, output=[2] * rng.randrange(0, 64)) for i in range(b)]
    toks = [[rng.randrange(20, 40) for _ in range(rng.randrange(1, width + 1))] for _ in range(b)]
    out = SimpleNamespace(tokens=toks, logprobs=[[-0.5] * len(t) for t in toks], hidden=None)
    return seqs, out


def per_sequence_rule(sched: Scheduler, seqs, out) -> int:
    """Every sequence through `_append`, as postprocess did for all of them."""
    kept = 0
    for seq, toks, lps in zip(seqs, out.tokens, out.logprobs, strict=True):
        seq.counter += 1
        k = sched._append(seq, toks, lps)
        seq.num_cached += k
        kept += k
    return kept


@pytest.mark.parametrize("b", [32, 128])
@pytest.mark.parametrize("width", [1, 5], ids=["plain", "sd"])
@pytest.mark.parametrize("provider", ["tlt", "append"])
def test_postprocess(benchmark, provider, width, b):
    seqs, out = _step(b, width)
    fn = Scheduler.postprocess if provider == "tlt" else per_sequence_rule

    def setup():
        fresh = copy.deepcopy(seqs)
        sched = Scheduler(BlockManager(8, 16), 256, 16384, Counter(), {11}, 1 << 20)
        sched.running = list(fresh)
        return (sched, fresh, out), {}

    emitted = benchmark.pedantic(fn, setup=setup, rounds=200)
    assert emitted == sum(len(t) for t in out.tokens)  # every token kept: far from every limit
