"""A drafter over-fit on a few greedy answers agrees with the target teacher-forced AND in the engine, and the
engine's paged chain drafting accepts exactly what the dense teacher-forced evaluation predicts."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.llama import CausalLM
from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.eval import (
    chain_agreement,
    drafter_counts_by_shape,
    drafter_hits,
    frozen_copy,
    walk_steps,
)
from tlt_rt.train.drafter.trainer import DrafterTrainer

ARCH = ArchConfig(
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    eos_token_ids=(95,),
)
DEPTH, NEW = 4, 32
PROMPTS = [[1, 7, 30, 2], [5, 9, 61, 12, 40, 3], [44, 8]]


def _answers(engine: Engine, max_new: int) -> list[dict]:
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new, stop_token_ids=[], return_hidden=True)
    return [
        {
            "ids": torch.tensor(PROMPTS[o.prompt_index] + o.token_ids)[:-1],
            "hidden": o.hidden,
            "prompt_len": len(PROMPTS[o.prompt_index]),
        }
        for o in engine.generate(PROMPTS, params)
    ]


def _dense_histogram(ok: torch.Tensor, max_new: int) -> Counter:
    """The engine's greedy chain walk from [depth, R] agreement: the first token comes from the prefill, then
    each step emits (consecutive hits) + 1 until max_new tokens are out."""
    run = torch.cumprod(ok.int(), 0).sum(0).tolist()
    hist, t, emitted = Counter(), 0, 1
    while emitted < max_new:
        hist[run[t] + 1] += 1
        emitted, t = emitted + run[t] + 1, t + run[t] + 1
    return hist


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    target = CausalLM(ARCH).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # confident greedy answers
    plain = Engine(target, speculative="off", block_size=4)
    data = _answers(plain, NEW + DEPTH + 2)  # labels past NEW for the walk's last step
    buf = DrafterBuffer(max_steps=1)
    buf.add(0, [s["ids"] for s in data], [s["hidden"] for s in data])
    drafter = Drafter(ARCH, target)
    trainer = DrafterTrainer(drafter, buf, lr=3e-3, batch_tokens=256, token_weight=1.0, unroll=2)
    for _ in range(100):
        trainer.step()
    drafter.eval()
    return target, drafter, data


def test_overfit_drafter_agrees_teacher_forced_and_in_the_engine(trained):
    target, drafter, data = trained
    ok = torch.cat([chain_agreement(drafter, s, DEPTH) for s in data], 1).float()
    assert ok[0].mean() > 0.95, ok.mean(1)  # depth 1
    assert ok[1].mean() > 0.8, ok.mean(1)  # depth 2: the drafter's own hidden fed back
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = Engine(target, drafter=drafter, speculative="on", strategies=(f"{DEPTH}_2_8",), block_size=4)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=NEW, stop_token_ids=[])
    spec.generate(PROMPTS, params)
    hist = spec.stats()["accept_length_hist"]
    mean = sum(k * v for k, v in hist.items()) / sum(hist.values())
    assert mean > 3.5, hist  # of at most DEPTH + 1 = 5


def test_engine_chain_accepts_what_dense_agreement_predicts(trained):
    target, drafter, data = trained
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = Engine(target, drafter=drafter, speculative="on", strategies=(f"{DEPTH}_1_{DEPTH + 1}",), block_size=4)
    for i, s in enumerate(data):
        before = Counter(spec.stats()["accept_length_hist"])
        spec.generate([PROMPTS[i]], SamplingParams(n=1, temperature=0.0, max_new_tokens=NEW, stop_token_ids=[]))
        got = Counter(spec.stats()["accept_length_hist"])
        got.subtract(before)
        got = +got
        assert got == _dense_histogram(chain_agreement(drafter, s, DEPTH), NEW), i


def test_drafter_hits_are_the_chain_agreement_on_greedy_answers(trained):
    target, drafter, data = trained
    for s in data:
        ok, hits = chain_agreement(drafter, s, DEPTH), drafter_hits(drafter, s, DEPTH, {1, 3})
        # depth j of root r names x_{r+j+1}: in the answer while r + j + 1 <= L - 1 (chain_agreement also
        # judges the one past it, by the target's top-1)
        r, j = torch.arange(ok.shape[1])[None] + s["prompt_len"] - 1, torch.arange(1, DEPTH + 1)[:, None]
        inside = r + j + 1 <= s["ids"].shape[0] - 1
        assert torch.equal(hits[1], ok & inside)
        assert not (hits[1] & ~hits[3]).any()  # a top-3 holds the top-1


def test_drafter_counts_walk_the_hits_per_shape(trained):
    target, drafter, data = trained
    shapes = {"4_1_5": (1, DEPTH), "2_3_8": (3, 2), "1_1_2": (1, 1)}
    got = drafter_counts_by_shape(drafter, data, shapes)
    for name, (k, depth) in shapes.items():
        want = [0, 0]
        for s in data:
            e, n = walk_steps(torch.cumprod(drafter_hits(drafter, s, depth, {k})[k].int(), 0).sum(0).tolist())
            want = [want[0] + e, want[1] + n]
        assert got[name] == tuple(want), name
    tokens, steps = got["4_1_5"]
    assert 3.0 < tokens / steps <= DEPTH + 1  # the over-fit drafter, as in the engine
    assert got["1_1_2"][0] <= 2 * got["1_1_2"][1]  # at most one draft per step
    # an untrained drafter proposes nothing of these answers: one token per step
    untrained = Drafter(ARCH, target).eval()
    tokens, steps = drafter_counts_by_shape(untrained, data, {"c": (1, DEPTH)})["c"]
    assert tokens / steps < 1.2


def test_frozen_copy_keeps_the_weights_it_was_given(trained):
    target, drafter, data = trained
    train_copy = frozen_copy(drafter).train().requires_grad_(True)  # a drafter to move; `drafter` stays as it is
    rng = torch.get_rng_state()
    frozen = frozen_copy(train_copy)
    assert torch.equal(torch.get_rng_state(), rng)  # keeping a copy changes no later draw of the run
    assert not any(p.requires_grad for p in frozen.parameters()) and not frozen.training
    assert frozen.lm_head is target.lm_head  # the target's head is shared, not copied
    before = drafter_counts_by_shape(frozen, data, {"c": (1, DEPTH)})
    assert before == drafter_counts_by_shape(drafter, data, {"c": (1, DEPTH)})
    with torch.no_grad():
        for p in train_copy.parameters():
            p.add_(torch.randn_like(p))
    assert drafter_counts_by_shape(frozen, data, {"c": (1, DEPTH)}) == before
    assert drafter_counts_by_shape(train_copy, data, {"c": (1, DEPTH)}) != before
