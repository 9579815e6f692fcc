"""A short prefill of one sequence at a padded, fixed size (`rollout.prefill_graph_tokens`): the program a CUDA graph
captures, run eagerly here, against the eager prefill of the same chunk."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import PROMPTS, make_engine, tiny_pair
from tlt_rt.options import ConfigError
from tlt_rt.rollout import SamplingParams
from tlt_rt.rollout.config import EngineConfig
from tlt_rt.rollout.step.target import Layout, PaddedPrefill, TargetRunner, prefill_graph_sizes


def test_the_padded_sizes_are_powers_of_two_up_to_the_most():
    assert prefill_graph_sizes(0) == []
    assert prefill_graph_sizes(64) == [64]
    assert prefill_graph_sizes(512) == [64, 128, 256, 512]
    assert prefill_graph_sizes(300) == [64, 128, 256, 300]
    assert prefill_graph_sizes(16) == [16]


def test_by_default_only_an_engine_that_captures_its_steps_pads_a_lone_prefill():
    """-1 (the default) is 256 where the engine captures its steps, which needs CUDA: on a CPU every prefill is
    eager and unpadded; a size given is taken as is; below -1 is refused."""
    assert make_engine("off").runner.padded is None
    assert make_engine("off", prefill_graph_tokens=16).runner.padded.sizes == [16]
    with pytest.raises(ConfigError, match="prefill_graph_tokens"):
        EngineConfig(prefill_graph_tokens=-2)


@pytest.mark.parametrize("start,n", [(0, 5), (0, 16), (8, 9), (4, 1)])
def test_a_padded_chunk_computes_what_the_unpadded_one_does_and_writes_only_its_own_slots(start, n):
    torch.manual_seed(1)
    target, _ = tiny_pair(0, scale=4.0)
    bs, width = 4, 12  # room for 48 positions: the chunk's start plus its padded size must fit
    plain, padded = TargetRunner(target, 20, bs), TargetRunner(target, 20, bs)
    prompt = torch.randint(0, 11, (start + n,)).tolist()
    table = [7, 3, 12, 5, 9, 1, 16]  # blocks enough for start + n positions, in no order
    for runner in (plain, padded):  # the same cached prefix for both
        for c in (runner.cache.k, runner.cache.v):
            c.normal_()
        if start:
            runner.forward(prompt[:start], Layout([table], [0], [start]), "prefill", logits_rows=[start - 1])
    before = [c.clone() for c in (padded.cache.k, padded.cache.v)]
    want = plain.forward(prompt[start:], Layout([table], [start], [n]), "prefill", logits_rows=[n - 1])
    program = PaddedPrefill(padded, width, [16, 32])
    t = program.size_for(start, n)
    assert t == (16 if n <= 16 else 32)
    got = program(prompt[start:], start, table, t)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)
    assert got.hidden.shape[0] == n
    # the chunk's K/V where the unpadded prefill wrote them; every other slot untouched but the trash block's
    slots = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
    for c_got, c_want, c_before in zip((padded.cache.k, padded.cache.v), (plain.cache.k, plain.cache.v), before,
                                       strict=True):  # fmt: skip
        flat_got, flat_want, flat_before = (x.flatten(1, 2) for x in (c_got, c_want, c_before))
        torch.testing.assert_close(flat_got[:, slots], flat_want[:, slots], rtol=1e-5, atol=1e-5)
        others = torch.ones(flat_got.shape[1], dtype=torch.bool)
        others[slots] = False
        others[-bs:] = False  # the trash block takes the padding's writes
        assert torch.equal(flat_got[:, others], flat_before[:, others])


def test_no_padded_size_where_the_table_has_no_room():
    target, _ = tiny_pair(0)
    program = PaddedPrefill(TargetRunner(target, 20, 4), 4, [16, 32])  # 16 positions in all
    assert program.size_for(0, 10) == 16
    assert program.size_for(4, 10) is None  # 4 + 16 > 16
    assert program.size_for(0, 17) is None


@pytest.mark.parametrize("speculative", ["off", "on"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("alone", [True, False])
def test_an_engine_with_padded_prefills_gives_the_eager_engines_tokens(speculative, temperature, alone):
    """Fresh engines per case and one strategy: a sampled step's tokens depend on the tree it drafted (exact in
    distribution, not token for token across trees), and with several strategies the policy's choices do not
    repeat from one engine to the next."""
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=10, seed=3, stop_token_ids=[])
    prompts = [PROMPTS[1]] if alone else PROMPTS  # alone: padded; several in one step: eager
    base = make_engine(speculative, strategies=("3_3_8",))
    padded = make_engine(speculative, strategies=("3_3_8",), prefill_graph_tokens=8)  # one size, 8: prompts <= 8
    program = padded.runner.padded
    assert program is not None and program.sizes == [8]
    runs = []
    program.run = lambda key, ins, run=program.run: runs.append(key) or run(key, ins)
    want = [o.token_ids for o in base.generate(prompts, params)]
    assert [o.token_ids for o in padded.generate(prompts, params)] == want
    assert set(runs) == ({("prefill", 8)} if alone else set())
