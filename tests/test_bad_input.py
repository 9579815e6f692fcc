"""Bad input to SamplingParams and Engine.generate: a ValueError that says what is wrong, before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.llama import CausalLM
from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.rollout.params import check_prompts

TINY = ArchConfig(
    model_type="llama", vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, eos_token_ids=(11,),
)  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    return Engine(CausalLM(TINY).eval(), speculative="off", block_size=4)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(temperature="0.5"), "temperature must be a finite number"),
        (dict(top_p=float("nan")), "top_p must be a finite number"),
        (dict(top_k=-2), "top_k must be -1 or 0"),
        (dict(top_k=2.5), "top_k must be an int"),
        (dict(n=True), "n must be an int"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(seed=-1), r"seed must be in \[0, 2\*\*64\)"),
        (dict(seed=1 << 64), r"seed must be in \[0, 2\*\*64\)"),
        (dict(stop_token_ids=[1.0]), "stop_token_ids must hold ints, got float"),
        (dict(stop_token_ids=["5"]), "stop_token_ids must hold ints, got str"),
        (dict(stop_token_ids="5"), "stop_token_ids must be a list of ints"),
        (dict(max_tokens=10, max_new_tokens=20), "disagree"),
    ],
)
def test_sampling_params_refuses(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_sampling_params_vllm_spellings():
    assert SamplingParams(top_k=0).top_k == -1  # vLLM's "off"
    assert SamplingParams(top_k=-1).top_k == -1
    assert not SamplingParams(top_k=0, temperature=1.0).filtering
    assert SamplingParams(max_tokens=7).max_new_tokens == 7
    assert SamplingParams(stop_token_ids=5).stop_token_ids == [5]
    assert SamplingParams(stop_token_ids=(np.int64(3), torch.tensor(4))).stop_token_ids == [3, 4]
    assert SamplingParams(seed=(1 << 64) - 1).seed == (1 << 64) - 1
    # copying through __dict__ (as callers do to change one field) keeps working with the alias
    p = SamplingParams(max_tokens=9)
    assert SamplingParams(**{**p.__dict__, "return_hidden": True}).max_new_tokens == 9


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([], "got no prompts"),
        ([1, 5, 7], r"flat list of 3 ints; pass a list of prompts, e.g. \[\[1, 5, 7\]\]"),
        ("hello", "prompts is text"),
        (["hello"], "prompt 0 is text"),
        ([[1, 2], [1.0, 2]], "prompt 1, position 0: token ids must be ints, got float"),
        ([[1, "2"]], "prompt 0, position 1: token ids must be ints, got str"),
        ([[1, True]], "prompt 0, position 1: token ids must be ints, got bool"),
        ([[1, 2], []], "prompt 1 is empty"),
        ([[1, 12]], r"outside the vocabulary \[0, 12\)"),
        ([[1, -1]], r"outside the vocabulary \[0, 12\)"),
        (torch.ones(2, 2, 2, dtype=torch.long), "expected \\[num_prompts, length\\]"),
        ([None], "prompt 0 must be a list of token ids, got NoneType"),
    ],
)
def test_generate_refuses(engine, prompts, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, SamplingParams(max_new_tokens=2))


def test_impossible_stop_ids_refused(engine):
    with pytest.raises(ValueError, match=r"stop_token_ids \[12\] are outside the vocabulary \[0, 12\)"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, stop_token_ids=[3, 12]))


def test_params_type_refused(engine):
    with pytest.raises(ValueError, match="params must be a SamplingParams, got dict"):
        engine.generate([[1, 2]], {"temperature": 0})


def test_accepted_prompt_forms_agree(engine):
    params = SamplingParams(temperature=0, max_new_tokens=3)
    ref = [o.token_ids for o in engine.generate([[1, 2, 3], [4, 5]], params)]
    forms = [
        [np.array([1, 2, 3]), torch.tensor([4, 5])],
        [(np.int32(1), 2, 3), [4, torch.tensor(5)]],
    ]
    for prompts in forms:
        assert [o.token_ids for o in engine.generate(prompts, params)] == ref
    assert [o.token_ids for o in engine.generate(torch.tensor([[1, 2, 3]]), params)] == ref[:1]


def test_check_prompts_normalises():
    ids, params = check_prompts([np.array([1, 2])], None, vocab_size=5)
    assert ids == [[1, 2]] and all(type(t) is int for t in ids[0])
    assert params == SamplingParams()
    plain = [0, 4, 2]  # the fast path's case: a list of Python ints in range comes back as a copy
    ids, _ = check_prompts([plain], None, vocab_size=5)
    assert ids == [plain] and ids[0] is not plain
