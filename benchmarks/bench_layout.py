"""The host side of a prefill step: `build_meta` (`tlt`, numpy) against a per-token Python loop (`python`),
and `check_prompts` on plain int prompts (`tlt`, no per-id loop) against the same ids as numpy ints (`per-id`,
the checks every id went through before).

    pytest benchmarks/bench_layout.py --benchmark-only

A prefill step and the drafter's pass over the prompts each build the attention inputs of every new token:
its cache slot from its block table, its position, the offsets of every sequence. B prompts of 90..115
tokens (SmolLM2's chat-formatted arithmetic prompts are ~100), block size 16, tensors left on the CPU so
only host work is timed. The `python` provider is the loop `build_meta` ran before.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from tlt_rt.rollout.params import check_prompts
from tlt_rt.rollout.step.target import Layout, build_meta, table_tensor

BLOCK = 16


def _layout(b: int) -> Layout:
    rng = random.Random(b)
    tables, starts, q_lens, nxt = [], [], [], 0
    for _ in range(b):
        n = rng.randrange(90, 116)
        blocks = -(-n // BLOCK)
        tables.append(list(range(nxt, nxt + blocks)))
        nxt += blocks
        starts.append(0)
        q_lens.append(n)
    return Layout(tables, starts, q_lens)


def per_token_loop(layout: Layout, block_size: int):
    """The same tensors, one token at a time in Python."""
    cu = torch.tensor([0, *itertools.accumulate(layout.q_lens)], dtype=torch.int32)
    slots, positions = [], []
    for t, s, q in zip(layout.tables, layout.starts, layout.q_lens, strict=True):
        for p in range(s, s + q):
            slots.append(t[p // block_size] * block_size + p % block_size)
            positions.append(p)
    return cu, torch.tensor(slots), torch.tensor(positions), table_tensor(layout.tables, "cpu")


@pytest.mark.parametrize("b", [8, 128])
@pytest.mark.parametrize("provider", ["tlt", "python"])
def test_prefill_layout(benchmark, provider, b):
    layout = _layout(b)
    if provider == "tlt":
        meta, positions = benchmark(build_meta, layout, "prefill", BLOCK, "cpu")
        slots = meta.slot_mapping
    else:
        _, slots, positions, _ = benchmark(per_token_loop, layout, BLOCK)
    assert slots.shape == positions.shape == (sum(layout.q_lens),)
    benchmark.extra_info["tokens"] = sum(layout.q_lens)


@pytest.mark.parametrize("b", [8, 128])
@pytest.mark.parametrize("provider", ["tlt", "per-id"])
def test_check_prompts(benchmark, provider, b):
    rng = random.Random(b)
    prompts = [[rng.randrange(49152) for _ in range(rng.randrange(90, 116))] for _ in range(b)]
    if provider == "per-id":
        prompts = [[np.int64(t) for t in p] for p in prompts]
    ids, _ = benchmark(check_prompts, prompts, None, 49152)
    assert ids == [[int(t) for t in p] for p in prompts]
