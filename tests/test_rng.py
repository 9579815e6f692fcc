"""Counter-based uniforms: deterministic, uniform, and independent across seeds, counters and lanes."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import chisquare

from tlt_rt.rollout.step.rng import _mix32, counter_uniforms, host_uniforms, sequence_seed


def test_deterministic_and_in_range():
    seeds = torch.tensor([1, 2, 3, 1 << 40])
    ctr = torch.tensor([0, 5, 5, 9])
    a, b = counter_uniforms(seeds, ctr, 7), counter_uniforms(seeds, ctr, 7)
    assert torch.equal(a, b)
    assert a.dtype == torch.float32 and (a >= 0).all() and (a < 1).all()
    # a row does not depend on its neighbours in the batch
    assert torch.equal(counter_uniforms(seeds[2:3], ctr[2:3], 7), a[2:3])


def test_uniform_histogram():
    seeds = torch.arange(20000)
    u = counter_uniforms(seeds, torch.zeros_like(seeds), 5).flatten()
    counts = torch.histc(u, bins=50, min=0, max=1)
    assert chisquare(counts.numpy()).pvalue > 1e-4


def test_neighbouring_streams_are_uncorrelated():
    seeds = torch.arange(50000)
    u0 = counter_uniforms(seeds, torch.zeros_like(seeds), 2)
    u1 = counter_uniforms(seeds, torch.ones_like(seeds), 2)
    u_next = counter_uniforms(seeds + 1, torch.zeros_like(seeds), 2)
    for x, y in ((u0[:, 0], u0[:, 1]), (u0[:, 0], u1[:, 0]), (u0[:, 0], u_next[:, 0])):
        r = torch.corrcoef(torch.stack([x, y]))[0, 1].abs()
        assert r < 0.02  # about 4.5 standard errors at this size


def test_sequence_seeds_are_distinct():
    seeds = {sequence_seed(s, i, j, o) for s in (0, 1) for i in range(20) for j in range(8) for o in range(2)}
    assert len(seeds) == 2 * 20 * 8 * 2
    assert all(0 <= s < 1 << 63 for s in seeds)


def test_host_uniforms_equal_device_uniforms_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    seeds = torch.randint(0, 2**63 - 1, (37,), generator=g)
    counters = torch.cat([torch.randint(0, 2**40, (36,), generator=g), torch.tensor([2**62])])
    dev = counter_uniforms(seeds, counters, 11)
    host = host_uniforms(seeds.tolist(), counters.tolist(), 11)
    assert host.dtype == np.float32 and host.shape == (37, 11)
    assert np.array_equal(dev.numpy(), host)


@given(
    st.integers(0, 2**63 - 1), st.integers(0, 2**40), st.integers(0, 2**20), st.integers(0, 7)
)  # fmt: skip
def test_sequence_seed_is_the_tensor_mixer_on_plain_ints(seed, prompt, sample, occurrence):
    """Seeds are computed with Python ints; they must equal the device mixer's, bit for bit, or saved runs
    and checkpoints would draw other streams."""
    m = 0xFFFFFFFF
    t = torch.tensor([seed & m, (seed >> 32) & m, prompt & m, sample & m, occurrence & m], dtype=torch.long)
    h = _mix32(t[0:1] ^ 0x3C6EF372)
    for v in t[1:]:
        h = _mix32(h ^ _mix32(v.view(1)))
    h2 = _mix32(h ^ 0xA54FF53A)
    assert sequence_seed(seed, prompt, sample, occurrence) == int(h) << 31 | int(h2) >> 1


def test_prefetched_uniforms_are_the_uniforms_of_the_next_step():
    """A step draws the same batch's next uniforms ahead (`step.io.Uniforms`): what the next step reads is what
    it would have drawn itself, for any width up to the prefetched one and whatever the batch became."""
    from tlt_rt.rollout.sequence import Sequence
    from tlt_rt.rollout.step.io import Uniforms

    seqs = [Sequence(i, 0, 0, [1], seed, 8, counter=c) for i, (seed, c) in enumerate([(5, 1), (2**62 + 3, 40), (9, 0)])]
    u = Uniforms(10)
    for n, batch in [(10, seqs), (4, seqs), (2, seqs[:2]), (6, seqs[::-1])]:
        u.prefetch(batch)
        for s in seqs:
            s.counter += 1
        want = host_uniforms([s.seed for s in batch], [s.counter for s in batch], n)
        assert np.array_equal(u.get(batch, n), want)
    u.prefetch(seqs)
    assert np.array_equal(
        u.get(seqs[1:], 3), host_uniforms([s.seed for s in seqs[1:]], [s.counter for s in seqs[1:]], 3)
    )
    # a narrower prefetch (after a plain step) serves a step of that width, and a wider step draws its own
    for n in (2, 8):
        u.prefetch(seqs, 2)
        assert u._ahead[2].shape == (3, 2)
        for s in seqs:
            s.counter += 1
        want = host_uniforms([s.seed for s in seqs], [s.counter for s in seqs], n)
        assert np.array_equal(u.get(seqs, n), want)
