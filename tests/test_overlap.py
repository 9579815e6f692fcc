"""Plain decoding one step ahead (`EngineConfig.overlap`): the same tokens, log-probs and schedule as one step at
a time, through stops, length limits, waiting prompts and preemption; steps that could differ are dropped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.engine import PROMPTS, make_engine
from tlt_rt.ir.strategy import bucket_for
from tlt_rt.models import attention
from tlt_rt.rollout import SamplingParams
from tlt_rt.rollout.block_manager import BlockManager
from tlt_rt.rollout.step.graph import StepArgs, StepValues
from tlt_rt.rollout.step.io import PinnedRing


def _outputs(outs):
    return [(o.prompt_index, o.sample_index, o.token_ids, o.logprobs, o.finish_reason) for o in outs]


def _schedule(engine):
    """What each step ran on: its kind, batch and tokens kept."""
    return [(e["kind"], e["batch"], e["tokens"]) for e in engine.timeline]


def _spy_launches(monkeypatch, engine) -> dict:
    """Count the runner's launches: all of them, and those queued ahead of an uncollected step."""
    seen = {"all": 0, "ahead": 0}
    real = engine.runner.launch

    def launch(*args, **kw):
        seen["all"] += 1
        seen["ahead"] += kw.get("after") is not None
        return real(*args, **kw)

    monkeypatch.setattr(engine.runner, "launch", launch)
    return seen


# (engine options, sampling params): stops by EOS at random points, a batch too small for every sample (prompts
# wait while others run), a cache small enough to preempt, limits of length and of context
CASES = {
    "stops": ({}, dict(n=3, temperature=0.0, max_new_tokens=40)),
    "sampled-stops": ({}, dict(n=3, temperature=0.9, seed=5, max_new_tokens=40)),
    "waiting": ({"max_batch": 4}, dict(n=3, temperature=0.9, seed=2, max_new_tokens=30)),
    "preempting": ({"num_blocks": 40}, dict(n=3, temperature=0.8, seed=7, max_new_tokens=30, stop_token_ids=[])),
    "context": ({"max_context": 24}, dict(n=2, temperature=0.0, max_new_tokens=60, stop_token_ids=[])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlap_changes_no_token_and_no_step(case, monkeypatch):
    options, sampling = CASES[case]
    params = SamplingParams(**sampling)
    one = make_engine("off", overlap=False, **options)
    two = make_engine("off", overlap=True, **options)
    launches = _spy_launches(monkeypatch, two)
    expected, got = one.generate(PROMPTS, params), two.generate(PROMPTS, params)
    assert _outputs(got) == _outputs(expected)
    assert _schedule(two) == _schedule(one)  # every step on the same batch, dropped steps not counted
    assert launches["ahead"] > 0
    assert two.blocks.num_free == two.blocks.num_blocks and two._pending is None
    if case == "preempting":
        assert one.stats()["preemptions"] == two.stats()["preemptions"] > 0


def test_steps_queued_ahead_are_dropped_only_where_samples_stop(monkeypatch):
    # no stop token, one length for all: every plain step but the first of a batch runs ahead, none is dropped
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=20, stop_token_ids=[])
    eng = make_engine("off")
    launches = _spy_launches(monkeypatch, eng)
    eng.generate(PROMPTS, params)
    decode_steps = eng.stats()["decode_steps"]
    assert launches["all"] == decode_steps  # nothing dropped
    assert launches["ahead"] >= decode_steps - 2  # the batch's first step, and the one before the last
    # stops at random points with prompts waiting: a sample stopping drops the step queued behind it
    eng = make_engine("off", max_batch=4)
    launches = _spy_launches(monkeypatch, eng)
    outs = eng.generate(PROMPTS, SamplingParams(n=3, temperature=0.9, seed=2, max_new_tokens=30))
    assert any(o.finish_reason == "stop" for o in outs)
    assert launches["all"] > eng.stats()["decode_steps"]  # some were dropped and run again


def _as_captured(monkeypatch, engine) -> None:
    """Run every step of `engine` (CPU) as a captured one would: its graph key from the batch bucket, the batch
    padded to the bucket with rows that write only to the trash block, then the live rows' results."""
    runner = engine.runner
    steps = runner.steps

    def run_args(option, mode, args):
        b, c = args.ints.shape
        size = bucket_for(b, engine.buckets)
        ints = torch.zeros(size, 3 + runner.width, dtype=args.ints.dtype)  # the captured step's static width
        ints[:b, :c] = args.ints
        ints[b:, 3:] = runner.trash_block  # a plain step's columns: prefix_len, ctx_len, root, table
        floats = torch.zeros(size, args.floats.shape[1])
        floats[:b] = args.floats
        floats[b:, -2:] = torch.tensor([-1.0, 1.0])  # top_k, top_p of padding rows
        if args.tokens is not None:  # roots from the step before, as the captured step's fill copies them
            ints[:b, 2] = args.tokens
        out = steps.eager(option, mode, StepArgs(ints, floats, None))
        return StepValues(out.host[:b], out.hidden[:b], None)

    # `_keeps` asks only whether the steps are captured
    monkeypatch.setattr(runner, "pool", SimpleNamespace(graphs={}, pool_bytes=0))
    monkeypatch.setattr(runner, "key", lambda b, option, mode, w: ("step", bucket_for(b, engine.buckets), option, mode))
    monkeypatch.setattr(runner, "run_args", run_args)
    monkeypatch.setattr(attention, "TIGHT_HOST_BOUND", False)  # keys up to the static bound, as on the GPU


def test_rows_of_stopped_samples_are_kept_out_of_a_captured_steps_results(monkeypatch):
    """Where a step queued ahead ran in the graph its remaining samples would run in (a CUDA engine's captured
    steps), it stands: the stopped samples' rows are left out. Here on the CPU, each step run as a captured step
    would run it (`_as_captured`). The host's BLAS rounds a row's last bits by its place in the batch, so the
    log-probs agree to float rounding; bit for bit on the GPU (test_engine_gpu.py)."""
    params = SamplingParams(n=3, temperature=0.9, seed=5, max_new_tokens=40)
    one = make_engine("off", overlap=False, graph_batches=[4, 8, 16])
    _as_captured(monkeypatch, one)
    expected = one.generate(PROMPTS, params)
    eng = make_engine("off", graph_batches=[4, 8, 16])
    _as_captured(monkeypatch, eng)
    launches = _spy_launches(monkeypatch, eng)
    got = eng.generate(PROMPTS, params)
    assert [o[:3] + o[4:] for o in _outputs(got)] == [o[:3] + o[4:] for o in _outputs(expected)]
    for a, b in zip(got, expected, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    stops = sum(o.finish_reason == "stop" for o in got)
    assert stops > 0
    # every stop inside a bucket kept its step: fewer launches than a drop per stop would take
    assert launches["all"] - eng.stats()["decode_steps"] < stops


def test_blocks_short_counts_what_ensure_many_takes():
    bm = BlockManager(num_blocks=32, block_size=4)
    for s, n in ((1, 3), (2, 4), (3, 9)):
        bm.allocate(s, n)
    ids, need = [1, 2, 3], [5, 4, 13]
    short, free = bm.blocks_short(ids, need), bm.num_free
    assert short == 1 + 0 + 1
    assert bm.ensure_many(ids, need) == 3 and free - bm.num_free == short


def test_pinned_ring_on_the_cpu_hands_back_its_tensor():
    ring = PinnedRing(torch.device("cpu"))
    t = torch.arange(6).view(2, 3)
    assert ring.stage("ints", t) is t


@pytest.mark.gpu
def test_pinned_ring_alternates_two_buffers_and_grows():
    ring = PinnedRing(torch.device("cuda"))
    a, b, c = (ring.stage("ints", torch.full((2, 3), i)) for i in range(3))
    assert a.is_pinned() and a.data_ptr() != b.data_ptr() and c.data_ptr() == a.data_ptr()
    assert torch.equal(c, torch.full((2, 3), 2)) and torch.equal(b, torch.full((2, 3), 1))
    big = ring.stage("ints", torch.ones(40, 5, dtype=torch.long))
    assert big.shape == (40, 5) and bool(big.eq(1).all())


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_auto_queues_its_plain_steps_ahead_and_decides_while_they_run(temperature, monkeypatch):
    """Under 'auto' the policy decides the step after a plain one while that one runs: a plain choice is queued
    ahead, a speculative one kept for the next step, so each step is decided once. Greedy tokens stay plain
    decoding's; sampled ones complete every request (their draws are exact, and which steps speculate depends
    on timings)."""
    params = SamplingParams(n=3, temperature=temperature, seed=4, max_new_tokens=40, stop_token_ids=[])
    eng = make_engine("auto", ("3_3_8", "4_2_6"), epsilon=0.3)
    launches = _spy_launches(monkeypatch, eng)
    decisions = []
    decide = eng.policy.decide
    monkeypatch.setattr(eng.policy, "decide", lambda *a, **k: decisions.append(decide(*a, **k)) or decisions[-1])
    outs = eng.generate(PROMPTS, params)
    st = eng.stats()
    assert st["sd_steps"] > 0 and launches["ahead"] > 0
    assert len(decisions) == st["steps"]  # one decision a step, speculative ones made while a plain step ran too
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, j) for i in range(len(PROMPTS)) for j in range(3)]
    assert eng.blocks.num_free == eng.blocks.num_blocks and eng._pending is None
    if temperature == 0.0:
        off = make_engine("off", overlap=False).generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in off]


SD_CASES = {
    "greedy": ({}, dict(n=2, temperature=0.0, max_new_tokens=40)),
    "sampled": ({}, dict(n=3, temperature=0.9, seed=5, max_new_tokens=40)),
    "waiting": ({"max_batch": 4}, dict(n=3, temperature=0.9, seed=2, max_new_tokens=30)),
    "limits": ({"max_context": 40}, dict(n=2, temperature=0.8, seed=9, max_new_tokens=27, stop_token_ids=[])),
}


@pytest.mark.parametrize("case", sorted(SD_CASES))
def test_speculative_steps_queued_ahead_change_no_token_and_no_step(case, monkeypatch):
    """`overlap_speculative`: a speculative step queued after one of the same strategy, its inputs moved on by
    that step's accept lengths and tokens on the device and the drafter's windows as that step left them, gives
    what one step at a time gives: the same drafts, so the same accept lengths, tokens and log-probs."""
    options, sampling = SD_CASES[case]
    params = SamplingParams(**sampling)
    one = make_engine("on", ("3_3_8",), overlap=False, **options)
    two = make_engine("on", ("3_3_8",), overlap_speculative=True, **options)
    launches = _spy_launches(monkeypatch, two)
    expected, got = one.generate(PROMPTS, params), two.generate(PROMPTS, params)
    assert _outputs(got) == _outputs(expected)
    assert _schedule(two) == _schedule(one)
    assert two.stats()["accept_length_hist"] == one.stats()["accept_length_hist"]
    assert launches["ahead"] > 0 and two.stats()["sd_steps"] > 0
    assert two.blocks.num_free == two.blocks.num_blocks and two._pending is None


def test_auto_with_speculative_steps_queued_ahead_keeps_greedy_tokens(monkeypatch):
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=40)
    eng = make_engine("auto", ("3_3_8", "4_2_6"), epsilon=0.3, overlap_speculative=True)
    launches = _spy_launches(monkeypatch, eng)
    outs = eng.generate(PROMPTS, params)
    off = make_engine("off", overlap=False).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off]
    assert eng.stats()["sd_steps"] > 0 and launches["ahead"] > 0
    assert eng.blocks.num_free == eng.blocks.num_blocks and eng._pending is None


@pytest.mark.parametrize("overlap_speculative", [False, True])
def test_windows_across_plain_stretches_queued_ahead_match_one_step_at_a_time(overlap_speculative, monkeypatch):
    """A scripted 'auto' schedule (three plain steps, then two speculative ones, in turn) with no stop token, so
    that every step is decided once and in the same order either way: the plain steps queued ahead note their
    hidden rows for the drafter's windows as one at a time does, so the speculative steps after them draft the
    same trees and sampled answers come out the same, draw for draw."""
    params = SamplingParams(n=2, temperature=0.9, seed=6, max_new_tokens=36, stop_token_ids=[])
    results = []
    for overlap in (False, True):
        eng = make_engine("auto", ("3_3_8",), overlap=overlap, overlap_speculative=overlap_speculative)
        calls = []

        def scripted(batch, behind=0, _calls=calls, _s=eng.strategies[0]):
            _calls.append(batch)
            return _s if len(_calls) % 5 in (4, 0) else None

        monkeypatch.setattr(eng.policy, "decide", scripted)
        launches = _spy_launches(monkeypatch, eng)
        outs = eng.generate(PROMPTS, params)
        st = eng.stats()
        results.append((_outputs(outs), st["accept_length_hist"], st["sd_steps"], len(calls) == st["steps"]))
        if overlap:
            assert launches["ahead"] > 0
    assert results[1] == results[0] and results[0][2] > 0 and results[1][3]


def test_advance_ints_moves_a_speculative_steps_inputs_on_by_the_step_before():
    """`graph.advance_ints`: ints packed before a speculative step of depth 2 (R = 3 ctx tokens, the root last),
    moved on by its host row: the prefix grows by a + 1, ctx_len is min(prefix, R), and the ctx tokens are the last
    R of the old ones and the a + 1 emitted ones, the bonus token the new root."""
    from tlt_rt.rollout.step.graph import advance_ints

    ints = torch.tensor([[7, 3, 11, 12, 13, 5, 6], [1, 1, 0, 0, 21, 9, 9]])  # prefix, ctx_len, 3 tokens, 2 blocks
    # accept length, 3 tokens (accepted drafts, then the bonus), 3 log-probs
    after = torch.tensor([[0, 40, -1, -1, 0.0, 0.0, 0.0], [2, 50, 51, 52, 0.0, 0.0, 0.0]], dtype=torch.float64)
    advance_ints(ints, after, 3)
    assert ints.tolist() == [[8, 3, 12, 13, 40, 5, 6], [4, 3, 50, 51, 52, 9, 9]]


def test_step_out_rows_keep_the_picked_samples_results_and_hidden_rows():
    from tlt_rt.rollout.step.io import StepOut

    hidden = torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3)
    out = StepOut([0, 1, 2, 1], [[5], [6, 7], [8, 9, 10], [11, 12]], [[-0.5], [-1.0, -1.5], [-2.0] * 3, [-3.0] * 2],
                  hidden)  # fmt: skip
    picked = out.rows([3, 1])
    assert picked.accept_len == [1, 1]
    assert picked.tokens == [[11, 12], [6, 7]]
    assert picked.logprobs == [[-3.0, -3.0], [-1.0, -1.5]]
    assert torch.equal(picked.hidden, torch.stack([hidden[3], hidden[1]]))
    assert out.rows([]).hidden.shape == (0, 2, 3)
    assert StepOut([0], [[1]], [[0.0]], None).rows([0]).hidden is None
