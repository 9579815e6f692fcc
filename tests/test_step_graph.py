"""The whole step as one program (rollout/step/graph.py): its static-buffer path (fill, run, result), which
the CUDA graphs replay, gives what the eager step gives, and padding rows write only to the trash block."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import PROMPTS, make_engine
from tlt_rt.ir.program import Op
from tlt_rt.ir.strategy import Strategy
from tlt_rt.rollout import SamplingParams
from tlt_rt.rollout.step.graph import mode_program
from tlt_rt.rollout.step.target import accept_mode


def _through_program(engine, pad: int) -> list:
    """Route every step of `engine` through StepGraphs' static buffers with `pad` padding rows whose buffers
    hold junk, as a captured graph's would after other batches ran."""
    steps, keys = engine.runner.steps, []

    def run_args(option, mode, args):
        b = args.ints.shape[0]
        key = ("step", b + pad, option, mode)
        ins = steps.static_inputs(key)
        ins["ints"][:, : args.ints.shape[1]] = torch.randint(0, 7, ins["ints"][:, : args.ints.shape[1]].shape)
        if "window" in ins:
            ins["window"].normal_()
        steps.fill(key, ins, args)
        keys.append(key)
        with torch.no_grad():
            return steps.result(key, steps.run(key, ins), args)

    engine.runner.run_args = run_args
    return keys


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_padded_program_equals_the_eager_step(temperature):
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=20, stop_token_ids=[], seed=3)
    # one strategy: with several, "on" picks among them by measured wall time, so two engines could differ
    eager, padded = make_engine("on", ("3_3_8",)), make_engine("on", ("3_3_8",))
    keys = _through_program(padded, pad=3)
    want, got = eager.generate(PROMPTS, params), padded.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
    assert {k[2] for k in keys} == {"3_3_8"} and all(k[1] == len(PROMPTS) * 2 + 3 for k in keys[:1])
    # what real rows wrote is the same; padding rows wrote only to the trash block (the last one)
    for name in ("target", "drafter"):
        ca, cb = getattr(eager.runner, name).cache, getattr(padded.runner, name).cache
        torch.testing.assert_close(cb.k[:, :-1], ca.k[:, :-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cb.v[:, :-1], ca.v[:, :-1], atol=1e-4, rtol=1e-4)


def test_plain_steps_draw_through_the_lowered_plain_program():
    """Every plain token comes from `StepProgram.plain_decode` lowered for the batch (one path draws every
    token): its ACCEPT node of depth 0 runs once per plain step."""
    eng = make_engine("off", ())
    runs = []
    lowered = eng.runner.steps.lowered

    def spy(batch, option, mode):
        step = lowered(batch, option, mode)
        runs.append(step.program)
        return step

    eng.runner.steps.lowered = spy
    eng.generate(PROMPTS[:2], SamplingParams(temperature=0.7, max_new_tokens=5, stop_token_ids=[]))
    assert len(runs) == eng.stats()["decode_steps"] > 0
    assert all(p.node(Op.ROOT) is not None and p.node(Op.ACCEPT)["depth"] == 0 for p in runs)


def test_modes_pick_the_acceptance_variant():
    assert accept_mode(SamplingParams(temperature=0.0)) == "greedy"
    assert accept_mode(SamplingParams(temperature=1.0)) == "sampled"
    assert accept_mode(SamplingParams(temperature=1.0, top_p=0.9)) == "filtered"
    assert accept_mode(SamplingParams(temperature=1.0, top_k=5)) == "filtered"
    acc = mode_program(None, "filtered").node(Op.ACCEPT)
    assert acc["mode"] == "filtered" and dict(acc.attrs) == {"mode": "filtered", "depth": 0}  # settings: per row
    assert mode_program(Strategy.parse("3_2_5"), "sampled", rows=6).rows == 6
    assert mode_program(None, "greedy").node(Op.ACCEPT)["mode"] == "greedy"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_reduced_draft_vocabulary_drafts_target_ids_and_stays_exact(temperature):
    """A drafter scoring only part of the vocabulary (its head over `d2t`): the levels take their top-k over
    the small head and map the ids back; every drafted token is in the draft vocabulary, and the output is
    plain decoding's (greedy) / the same sampler's (the target decides every token)."""
    from tests.helpers.engine import TINY, tiny_pair
    from tlt_rt.rollout import Engine

    target, drafter = tiny_pair(0, 4.0)
    d2t = torch.arange(1, TINY.vocab_size, 2)  # the odd ids
    drafter.set_draft_vocab(d2t)
    spec = Engine(target, drafter=drafter, speculative="on", strategies=("3_3_8",), block_size=4)
    drafted = []
    lowered = spec.runner.steps.lowered

    def spy(batch, option, mode):
        step = lowered(batch, option, mode)

        def run(models, values):
            out = step(models, values)
            drafted.append(out["tree_tokens"][:, 1:])
            return out

        return run

    spec.runner.steps.lowered = spy
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=16, stop_token_ids=[], seed=1)
    got = spec.generate(PROMPTS, params)
    plain = make_engine("off", ()).generate(PROMPTS, params)
    if temperature == 0.0:
        assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert spec.stats()["sd_steps"] > 0 and drafted
    assert all(bool((t % 2 == 1).all()) for t in drafted)
