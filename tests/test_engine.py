"""The rollout engine end to end on tiny random models: exactness of SD, batching, preemption, errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from scipy.stats import chisquare

from tests.helpers.engine import PROMPTS, TINY, make_engine, tiny_pair
from tlt_rt.models.generate import generate_simple
from tlt_rt.models.llama import Glue
from tlt_rt.options import ConfigError
from tlt_rt.rollout import Engine, SamplingParams


def _tokens(outs):
    return [(o.prompt_index, o.sample_index, o.token_ids) for o in outs]


@pytest.mark.parametrize("strategies", [("3_3_8",), ("4_2_6",), ("2_4_10",)])
def test_greedy_sd_equals_plain_decoding(strategies):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=24, stop_token_ids=[])
    off = make_engine("off").generate(PROMPTS, params)
    on = make_engine("on", strategies).generate(PROMPTS, params)
    assert _tokens(on) == _tokens(off)
    # the oracle: a plain loop over the dense/paged forward, no engine
    target, _ = tiny_pair(0, 4.0)
    ref = generate_simple(target, PROMPTS, max_new_tokens=24, eos_ids=())
    assert [o.token_ids for o in off if o.sample_index == 0] == ref
    for a, b in zip(on, off, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_speculative_steps_accept_tokens():
    eng = make_engine("on", ("3_3_8",))
    eng.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=24, stop_token_ids=[]))
    st = eng.stats()
    assert st["sd_steps"] > 0 and st["decode_steps"] == 0
    # a 12-token vocabulary with 3-way branching: chance acceptance is frequent
    assert st["mean_accept_length"] > 1.2


@pytest.mark.parametrize("speculative,temperature", [("off", 0.8), ("on", 0.0)])
def test_preemption_loses_nothing_and_changes_nothing(speculative, temperature):
    # sampled plain decoding draws token t of a sample from counter t of its own stream, and greedy output is
    # unique, so either way a preempted-and-recomputed run must give the same tokens as a roomy one
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=30, seed=7, stop_token_ids=[])
    roomy = make_engine(speculative).generate(PROMPTS, params)
    tight_engine = make_engine(speculative, num_blocks=40)
    tight = tight_engine.generate(PROMPTS, params)
    assert tight_engine.stats()["preemptions"] > 0
    assert _tokens(tight) == _tokens(roomy)


def test_preemption_under_sampled_speculation_completes_every_request():
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=30, seed=7, stop_token_ids=[])
    eng = make_engine("on", num_blocks=40)
    outs = eng.generate(PROMPTS, params)
    assert eng.stats()["preemptions"] > 0
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, j) for i in range(len(PROMPTS)) for j in range(3)]
    assert all(len(o.token_ids) == 30 and o.finish_reason == "length" for o in outs)
    assert eng.blocks.num_free == eng.blocks.num_blocks  # every block came back


def test_samples_are_independent_streams():
    outs = make_engine("off").generate(
        [[1, 2], [1, 2]], SamplingParams(n=4, temperature=1.0, max_new_tokens=12, stop_token_ids=[])
    )
    seqs = [tuple(o.token_ids) for o in outs]
    assert len(set(seqs)) == len(seqs)
    again = make_engine("off").generate(
        [[1, 2], [1, 2]], SamplingParams(n=4, temperature=1.0, max_new_tokens=12, stop_token_ids=[])
    )
    assert _tokens(again) == _tokens(outs)  # reproducible from the seed


def _exact_pair_probs(target, prompt, temperature):
    """p(x1, x2 | prompt) for every pair, by brute force over the dense forward."""
    v = TINY.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        seqs = torch.tensor([prompt + [a] for a in range(v)])
        p2 = torch.softmax(target(seqs).logits[:, -1] / temperature, -1)
    return (p1[:, None] * p2).flatten()


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_sampled_output_is_distributed_as_the_target(speculative):
    n, temperature = 3000, 1.3
    eng = make_engine(speculative, ("3_3_8",), max_batch=512, scale=2.0)
    outs = eng.generate(
        [[1, 2, 3]], SamplingParams(n=n, temperature=temperature, max_new_tokens=2, stop_token_ids=[], seed=11)
    )
    v = TINY.vocab_size
    counts = torch.zeros(v * v)
    for o in outs:
        counts[o.token_ids[0] * v + o.token_ids[1]] += 1
    expected = _exact_pair_probs(eng.target, [1, 2, 3], temperature) * n
    # merge cells with small expectation so the chi-square approximation holds
    order = torch.argsort(expected)
    small = expected[order].cumsum(0) < 25
    obs = torch.cat([counts[order][small].sum(0, keepdim=True), counts[order][~small]])
    exp = torch.cat([expected[order][small].sum(0, keepdim=True), expected[order][~small]])
    # false-alarm rate 1e-4 per test
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-4
    if speculative == "on":
        assert eng.stats()["sd_steps"] > 0


def test_returned_logprobs_and_hidden_match_the_target():
    eng = make_engine("on")
    outs = eng.generate(
        [[1, 2, 3]], SamplingParams(n=2, temperature=0.7, max_new_tokens=10, stop_token_ids=[], return_hidden=True)
    )
    for o in outs:
        seq = torch.tensor([[1, 2, 3] + o.token_ids])
        with torch.no_grad():
            dense = eng.target(seq)
        logp = torch.log_softmax(dense.logits[0, 2:-1] / 0.7, -1)
        want = logp.gather(1, torch.tensor(o.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(o.logprobs), want, atol=1e-4, rtol=1e-4)
        assert o.hidden.shape == (3 + len(o.token_ids) - 1, TINY.hidden_size)
        torch.testing.assert_close(o.hidden, dense.hidden[0, :-1], atol=1e-4, rtol=1e-4)


def test_stop_tokens_and_lengths():
    outs = make_engine("on").generate(
        PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=40, stop_token_ids=[5, 7])
    )
    for o in outs:
        assert len(o.token_ids) <= 40
        stops = [t for t in o.token_ids if t in (5, 7)]
        if o.finish_reason == "stop":
            assert stops == [o.token_ids[-1]]
        else:
            assert not stops and len(o.token_ids) == 40


def test_bad_input_fails_before_any_work():
    eng = make_engine("off", max_context=16)
    with pytest.raises(ValueError, match="context"):
        eng.generate([[1] * 16])
    with pytest.raises(ValueError, match="vocabulary"):
        eng.generate([[1, 99]])
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="speculative"):
        make_engine("sometimes")


def test_auto_without_drafter_warns():
    target, _ = tiny_pair()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        Engine(target, speculative="auto", strategies=("3_3_8",), block_size=4)
    assert any("freshly initialised" in str(x.message) for x in w)


def test_stats_report_what_ran():
    eng = make_engine("on")
    eng.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=8, stop_token_ids=[]))
    st = eng.stats()
    assert st["generated_tokens"] == len(PROMPTS) * 2 * 8
    assert sum(st["strategy_use"].values()) == st["sd_steps"]
    assert math.isfinite(st["tokens_per_second"]) and st["tokens_per_second"] > 0


def test_sequence_hidden_rows_keep_their_order():
    from tlt_rt.rollout.sequence import MERGE_EVERY, Sequence, StepRows, flush_hidden

    log = StepRows()
    s = Sequence(1, 0, 0, [1], 0, 10, step_rows=log)
    x, y = Sequence(7, 0, 0, [1], 0, 10, step_rows=log), Sequence(8, 0, 0, [1], 0, 10, step_rows=log)
    step = torch.arange(6.0).view(3, 2)  # a plain step's [B, H] hidden states; this sequence is row 1, then 2
    s.add_hidden(torch.zeros(1, 2))
    log.add(step, [x, s, y])
    s.add_hidden(torch.ones(2, 2))  # a speculative step's rows come after the logged plain row
    log.add(step, [x, y, s])
    assert s.hidden_rows(1, 5).tolist() == [[2, 3], [1, 1], [1, 1], [4, 5]]
    assert s.hidden_rows(2, 5).tolist() == [[1, 1], [1, 1], [4, 5]] and len(s.hidden_chunks) > 1  # tail only
    assert s.hidden_rows(0, 2).tolist() == [[0, 0], [2, 3]] and s.hidden_rows(5, 5).shape == (0, 2)
    assert x.hidden().tolist() == [[0, 1], [0, 1]] and y.hidden().tolist() == [[4, 5], [2, 3]]
    log.add(step, [x, y, s])
    s.reset_for_recompute()  # drops its own rows; the others keep theirs
    assert s.hidden_chunks == [] and not log.steps and x.hidden().tolist() == [[0, 1]] * 3
    log.add(step[:1], [s])
    assert s.hidden().tolist() == [[0, 1]]
    # many sequences and steps at once, the batch the same from step to step or not
    other = torch.arange(10.0, 16.0).view(3, 2)
    for varied in (True, False):
        log = StepRows()
        seqs = [Sequence(i, 0, 0, [1], 0, 10, step_rows=log) for i in range(3)]
        log.add(step, seqs)
        log.add(other, seqs if not varied else seqs[::-1])
        flush_hidden(seqs[:1])
        assert not log.steps
        want = [[[0, 1], [10, 11]], [[2, 3], [12, 13]], [[4, 5], [14, 15]]]
        if varied:
            want = [[[0, 1], [14, 15]], [[2, 3], [12, 13]], [[4, 5], [10, 11]]]
        seqs[1].add_hidden(torch.full((1, 2), -1.0))
        log.add(step[:1], [seqs[1]])
        assert [q.hidden().tolist() for q in seqs] == [want[0], [*want[1], [-1, -1], [0, 1]], want[2]]
    # the log never holds more than MERGE_EVERY steps: rows of finished sequences are not kept by it
    log = StepRows()
    seqs = [Sequence(i, 0, 0, [1], 0, 10, step_rows=log) for i in range(2)]
    for t in range(2 * MERGE_EVERY + 3):
        log.add(torch.tensor([[t, 0.0], [t, 1.0]]), seqs)
        assert len(log.steps) < MERGE_EVERY
    assert len(log.steps) == 3 and len(seqs[1].hidden_chunks) >= 2
    assert seqs[1].hidden().tolist() == [[t, 1.0] for t in range(2 * MERGE_EVERY + 3)]


def test_warm_up_writes_only_to_the_trash_blocks():
    eng = make_engine("auto", ("3_3_8", "4_2_6"), max_batch=4)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6, stop_token_ids=[])
    first = eng.generate(PROMPTS, params)
    n = eng.blocks.num_blocks
    target, drafter = eng.runner.target.cache, eng.runner.drafter.cache
    caches = [target.k, target.v, drafter.k, drafter.v]
    before = [c[:, :n].clone() for c in caches]
    eng.glue = Glue()  # as on CUDA, where the glue is compiled: warm it for one row and for several
    eng.warm_up()
    assert all(torch.equal(c[:, :n], b) for c, b in zip(caches, before, strict=True))
    assert _tokens(eng.generate(PROMPTS, params)) == _tokens(first)


def test_auto_tells_the_policy_how_far_the_drafter_is_behind():
    eng = make_engine("auto", strategies=("3_3_8",))
    strategy = eng.strategies[0]
    seen = []
    decide, observe = eng.policy.decide, eng.policy.observe
    calls = iter(range(10_000))

    def scripted(batch, behind=0):
        decide(batch, behind)
        return None if next(calls) < 12 else strategy  # 12 plain steps, then speculation

    def spy(batch, strat, seconds, tokens, behind=0, switched=False):
        seen.append((strat, behind))
        observe(batch, strat, seconds, tokens, behind, switched)

    eng.policy.decide, eng.policy.observe = scripted, spy
    params = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[])
    outs = eng.generate([[1, 2, 3], [4, 5, 6, 7]], params)
    assert all(len(o.token_ids) == 20 for o in outs)
    first_sd = next(i for i, (s, _) in enumerate(seen) if s is not None)
    rows = eng.drafter_runner.window_rows
    # two sequences, each 1 row behind after its prompt plus 12 plain steps, less the fixed block every SD
    # step runs anyway
    assert seen[first_sd][1] == 2 * (13 - rows)
    assert all(b == 0 for s, b in seen[first_sd + 1 :] if s is not None)  # caught up from then on
    assert all(b == 0 for s, b in seen if s is None)  # plain steps report no catch-up
    # the step timeline records the same rows (what benchmarks show beside a dear step)
    decode = [e for e in eng.timeline if e["kind"] != "prefill"]
    assert [(e["strategy"], e["behind"]) for e in decode] == [(s and str(s), b) for s, b in seen]


def test_auto_tells_the_policy_which_plain_steps_follow_another_kind_of_step():
    """A decode step's reading says whether the step before it was of another kind (a prefill, or a step of
    another option): the policy keeps the first `plain_settle` plain steps after a switch out of plain
    decoding's price, and the price it keeps is a mean of the plain steps that followed as many plain ones."""
    eng = make_engine("auto", strategies=("3_3_8",))
    strategy, seen = eng.strategies[0], []
    observe = eng.policy.observe
    calls = iter(range(10_000))
    eng.policy.costs.set(eng.policy.bucket(2), None, 1.0)  # a profiled price: the first online reading replaces it

    def spy(batch, strat, seconds, tokens, behind=0, switched=False):
        seen.append((strat, switched, seconds))
        observe(batch, strat, seconds, tokens, behind, switched)

    # SD, plain, plain, plain, SD, ...
    eng.policy.decide = lambda batch, behind=0: strategy if next(calls) % 4 == 0 else None
    eng.policy.observe = spy
    params = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=[])
    eng.generate([[1, 2, 3], [4, 5, 6, 7]], params)
    kinds = [e["strategy"] or e["kind"] for e in eng.timeline]
    want = [kinds[i] != kinds[i - 1] for i in range(len(kinds)) if kinds[i] != "prefill"]
    assert [sw for _, sw, _ in seen] == want and want[0]  # the first decode step follows the prefill
    places, run = [], 0  # each plain step's place in its run of plain steps
    for s, sw, _ in seen:
        run = 0 if s is not None else 1 if sw else run + 1
        places.append(run)
    settle = eng.policy.plain_settle
    assert settle == 2  # the default: a run of three plain steps (see the decide above) prices with its last
    clean = [t for (s, _, t), place in zip(seen, places, strict=True) if s is None and place > settle]
    early = sum(s is None and 0 < place <= settle for (s, _, _), place in zip(seen, places, strict=True))
    assert len(clean) > 2 and eng.policy.stats()["switch_readings"] == early
    assert min(clean) <= eng.policy.costs.get(eng.policy.bucket(2), None) <= max(clean)


def test_speculative_steps_log_the_rows_each_sequence_kept():
    """A speculative step's [B, D+1, H] rows enter the log with how many each sequence kept; flushed, every
    history is what appending each sequence's kept rows at once would give, across plain and speculative
    steps, runs of the same batch and batches that change."""
    from tlt_rt.rollout.sequence import Sequence, StepRows

    g = torch.Generator().manual_seed(0)
    for runs in ((0, 0, 0, 0), (0, 1, 0, 2)):  # which batch order each step runs in
        log = StepRows()
        seqs = [Sequence(i, 0, 0, [1], 0, 10, step_rows=log) for i in range(3)]
        orders = [seqs, seqs[::-1], [seqs[1], seqs[2], seqs[0]]]
        want = {id(s): [] for s in seqs}
        for step, r in enumerate(runs):
            q = orders[r]
            if step % 2:  # plain: a row each
                rows = torch.randn(3, 4, generator=g)
                log.add(rows, q)
                for i, s in enumerate(q):
                    want[id(s)].append(rows[i : i + 1])
            else:  # speculative: depth 3, some rows kept of each
                rows = torch.randn(3, 4, 4, generator=g)
                kept = [1 + (step + i) % 4 for i in range(3)]
                log.add(rows, q, kept)
                for i, s in enumerate(q):
                    want[id(s)].append(rows[i, : kept[i]])
        assert len(log.steps) == len(runs)
        got = [s.hidden() for s in seqs]  # the first read flushes the whole log
        assert not log.steps
        for s, h in zip(seqs, got, strict=True):
            assert torch.equal(h, torch.cat(want[id(s)]))


@pytest.mark.parametrize("speculative,temperature", [("off", 0.8), ("on", 0.0)])
def test_preemption_while_forking_keeps_every_token(speculative, temperature, monkeypatch):
    # three one-block prompts of three samples each in eight blocks: the prefill admits all three, and the
    # fork of the second runs out of blocks and preempts samples of the first. The fork defers its block
    # copies and first tokens, so it must apply them before a preemption: every victim has its first token
    from tlt_rt.rollout.scheduler import Scheduler

    victims = []
    preempt = Scheduler.preempt_youngest

    def spy(self):
        victims.append(len(self.running[-1].output))
        return preempt(self)

    prompts = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 1, 2]]
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=12, seed=7, stop_token_ids=[])
    roomy = make_engine(speculative).generate(prompts, params)
    monkeypatch.setattr(Scheduler, "preempt_youngest", spy)
    tight = make_engine(speculative, num_blocks=8, max_batch=16).generate(prompts, params)
    assert 1 in victims and 0 not in victims  # preempted right after its fork, never before its first token
    assert _tokens(tight) == _tokens(roomy)


def echo_pair():
    """A target whose layers add nothing (its next token depends on the current token alone) and a drafter
    that computes the same map, sure of it (a sharp head): every draft is accepted whole."""
    target, drafter = tiny_pair(0, 50.0)
    with torch.no_grad():
        for layer in [*target.model.layers, *drafter.layers]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        h = drafter.fc.weight.shape[0]
        drafter.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], 1))  # the token's embedding alone
        if drafter.fc.bias is not None:
            drafter.fc.bias.zero_()
    return target, drafter


@pytest.mark.parametrize("slack", [1, 0])
def test_one_plain_step_between_speculative_ones_needs_no_catch_up(slack):
    # auto mode keeps one row more than the deepest strategy's block: a sequence that accepted a whole
    # draft and then took one plain step is depth + 2 rows past the drafter, still inside the block. Without
    # that row (slack 0) the speculative step after the plain one catches a row up eagerly
    target, drafter = echo_pair()
    eng = Engine(target, drafter=drafter, speculative="auto", strategies=["3_3_8"], block_size=4)
    runner = eng.drafter_runner
    assert runner.window_rows == 3 + 2
    runner.window_rows -= 1 - slack
    strategy, seen = eng.strategies[0], []
    calls = iter(range(10_000))
    observe = eng.policy.observe

    def spy(batch, strat, seconds, tokens, behind=0, switched=False):
        seen.append((strat, behind, tokens))
        observe(batch, strat, seconds, tokens, behind, switched)

    eng.policy.decide = lambda batch, behind=0: None if next(calls) % 3 == 2 else strategy  # SD, SD, plain, ...
    eng.policy.observe = spy
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=80, stop_token_ids=[])
    outs = eng.generate(PROMPTS, params)
    target, _ = echo_pair()
    assert _tokens(outs) == _tokens(Engine(target, speculative="off", block_size=4).generate(PROMPTS, params))
    assert all(t == 4 for s, _, t in seen[:6] if s is not None)  # whole drafts accepted
    after_plain = [
        b for (prev, _, _), (s, b, _) in zip(seen[:-1], seen[1:], strict=True) if prev is None and s is not None
    ]
    assert len(after_plain) > 5
    assert all(b == 0 for b in after_plain) if slack else all(b > 0 for b in after_plain)


def test_timeline_split_adds_up_the_steps_by_kind():
    from tlt_rt.rollout.stats import timeline_split

    entries = [
        {"kind": "prefill", "batch": 2, "seconds": 0.5},
        {"kind": "decode", "batch": 2, "seconds": 0.1},
        {"kind": "sd", "batch": 1, "seconds": 0.3},
        {"kind": "decode", "batch": 1, "seconds": 0.1},
    ]
    got = timeline_split(entries, wall=1.5)
    assert got["prefill_seconds"] == 0.5 and got["decode_seconds"] == pytest.approx(0.2) and got["sd_seconds"] == 0.3
    assert got["other_seconds"] == pytest.approx(0.5) and got["decode_steps"] == 3 and got["decode_rows"] == 4
    assert got["mean_decode_batch"] == pytest.approx(4 / 3)
    assert timeline_split([], wall=0.2)["mean_decode_batch"] == 0.0


@pytest.mark.parametrize("speculative,temperature", [("off", 0.8), ("off", 0.0), ("on", 0.0)])
def test_admitting_prompts_in_groups_changes_no_token_and_takes_fewer_prefills(speculative, temperature):
    """prefill_min_samples: with a stream of prompts refilling a full batch, the engine waits until enough
    places are free and prefills several prompts in one step. Each sample draws from its own stream, so the
    tokens are those of admitting each prompt as soon as it fits (greedy speculation: the unique greedy path)."""
    prompts = [[1 + i % 9, 2 + i % 7, 3 + i % 5][: 1 + i % 3] for i in range(12)]
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=3, stop_token_ids=[11])
    eager, grouped = make_engine(speculative, max_batch=6), make_engine(speculative, max_batch=6, prefill_min_samples=4)
    one, many = eager.generate(prompts, params), grouped.generate(prompts, params)
    assert _tokens(many) == _tokens(one)
    prefills = [sum(e["kind"] == "prefill" for e in eng.timeline) for eng in (eager, grouped)]
    assert prefills[1] < prefills[0], prefills
    with pytest.raises(ConfigError, match="prefill_min_samples"):
        make_engine("off", prefill_min_samples=-1)


def test_graph_batches_choose_the_captured_sizes_and_keep_max_batch():
    """graph_batches: only those sizes (and max_batch) are buckets; a live batch runs in the smallest that
    holds it. Out-of-range sizes are config errors naming the field."""
    eng = make_engine("auto", max_batch=8, graph_batches=[2, 4])
    assert eng.buckets == [2, 4, 8]
    assert eng.bucket(3) == 4 and eng.bucket(1) == 2 and eng.bucket(5) == 8
    assert eng.policy.buckets == [2, 4, 8]
    assert make_engine("off", max_batch=8).buckets == [1, 2, 4, 8]
    for bad in ([0], [9], [True]):
        with pytest.raises(ConfigError, match="graph_batches"):
            make_engine("off", max_batch=8, graph_batches=bad)
