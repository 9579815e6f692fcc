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
from tlt_rt.train.drafter.eval import chain_agreement
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
