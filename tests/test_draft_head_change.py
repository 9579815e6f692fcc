"""A drafter's head that becomes other tensors after the engine captured its speculative steps (a reduced vocabulary
set, resized or cleared) makes the engine capture those steps anew: a captured step reads the tensors it was
captured with, and went on drafting through the old head (the drafter warm-up's 8_4_32 figures until `527a7cc`)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import PROMPTS, TINY, make_engine, tiny_pair
from tlt_rt.rollout import Engine, SamplingParams


def test_head_version_moves_only_when_the_head_becomes_other_tensors():
    _, drafter = tiny_pair()
    v0 = drafter.head_version
    drafter.set_draft_vocab(torch.tensor([0, 3, 5, 11]))
    v1 = drafter.head_version
    assert v1 > v0  # full vocabulary -> a reduced one: new d2t and head
    head = drafter.draft_head
    drafter.set_draft_vocab(torch.tensor([1, 3, 5, 11]))  # the same size: copied in place
    assert drafter.head_version == v1 and drafter.draft_head is head
    drafter.refresh_head()  # after a policy update: in place too
    assert drafter.head_version == v1
    drafter.set_draft_vocab(torch.tensor([1, 3, 11]))  # resized
    v2 = drafter.head_version
    assert v2 > v1
    drafter.set_draft_vocab(None)
    assert drafter.head_version > v2 and drafter.draft_head is None
    v3 = drafter.head_version
    drafter.set_draft_vocab(None)  # already full: nothing became another tensor
    assert drafter.head_version == v3


class FakePool:
    """What `ModelRunner.drop_stale_steps` reads and calls of a graph pool."""

    def __init__(self, keys):
        self.graphs = dict.fromkeys(keys)
        self.dropped = []

    def drop(self, keys):
        self.dropped += keys
        for key in keys:
            del self.graphs[key]


def test_the_runner_drops_its_speculative_steps_when_the_head_changed():
    engine = make_engine(speculative="auto", strategies=("3_2_4",))
    runner = engine.runner
    keys = [("step", 1, "off", "greedy"), ("step", 1, "3_2_4", "greedy"), ("step", 4, "3_2_4", "sampled")]
    runner.pool = FakePool(keys)
    assert runner.drop_stale_steps() == []  # nothing changed since the engine was built
    runner.drafter.drafter.set_draft_vocab(torch.tensor([0, 2, 4, 11]))
    assert sorted(runner.drop_stale_steps()) == sorted(keys[1:])  # the plain step reads no drafter head
    assert list(runner.pool.graphs) == [keys[0]]
    assert runner.drop_stale_steps() == []  # once


def test_an_engine_without_graphs_drafts_with_the_new_head_and_stays_exact():
    """On CPU steps run eagerly and read the drafter's current head; greedy speculation still gives plain
    decoding's tokens after the vocabulary is set under a live engine."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    spec = make_engine(speculative="on", strategies=("3_2_4",))
    plain = make_engine(speculative="off")
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    spec.runner.drafter.drafter.set_draft_vocab(torch.tensor([0, 1, 2, 3, 4, 11]))
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    assert spec.runner.drop_stale_steps() == []  # no pool on CPU; the version is taken up all the same


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured steps need a CUDA device")
def test_captured_steps_are_captured_again_after_the_vocabulary_is_set():
    from dataclasses import replace

    from tlt_rt.models.drafter import Drafter
    from tlt_rt.models.llama import CausalLM

    arch = replace(TINY, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   intermediate_size=256)  # fmt: skip
    torch.manual_seed(0)
    target = CausalLM(arch).cuda().eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    drafter = Drafter(arch, target).cuda().eval()
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=24, stop_token_ids=[])
    engine = Engine(target, drafter=drafter, speculative="on", strategies=("3_2_4",), block_size=16)
    plain = Engine(target, speculative="off", block_size=16)
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == want
    before = {k: v.graph for k, v in engine.runner.pool.graphs.items() if k[2] != "off"}
    assert before
    drafter.set_draft_vocab(torch.tensor([0, 1, 2, 3, 4, 5, 11]))
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == want
    after = {k: v.graph for k, v in engine.runner.pool.graphs.items() if k[2] != "off"}
    assert after and all(after[k] is not before.get(k) for k in after)  # captured anew, reading the new head
