"""Lowering a StepProgram: pass order, errors, and a plain-decode program run end to end."""

from __future__ import annotations

import pytest
import torch

from tlt_rt.codegen.lower import lower
from tlt_rt.ir import Bucket, StepProgram, Strategy
from tlt_rt.ir.program import Op


def _bucket(strategy, b=2):
    return Bucket(b, strategy, 8, 4, 12, 32)


def test_calls_follow_the_program():
    s = Strategy.parse("3_2_5")
    step = lower(StepProgram.speculative(s, "sampled", 0.8, top_p=0.9), _bucket(s), "cpu")
    assert [op for op, _ in step.calls] == ["DRAFT", "VERIFY", "ACCEPT", "COMMIT"]
    assert "ACCEPT  -> accept" in str(step)


def test_bucket_of_another_strategy_is_refused():
    s = Strategy.parse("3_2_5")
    with pytest.raises(ValueError, match="serves strategy"):
        lower(StepProgram.speculative(s), _bucket(Strategy.parse("4_2_6")), "cpu")
    with pytest.raises(ValueError, match="ACCEPT"):
        bad = StepProgram.speculative(s).edit(2, temperature=0.5)  # greedy with a temperature
        lower(bad, _bucket(s), "cpu")
    assert StepProgram.speculative(s).node(Op.DRAFT)["depth"] == 3


class _Models:
    """A stand-in for the engine: verify returns fixed logits."""

    def __init__(self, logits):
        self.logits = logits

    def verify(self, tree):
        b, t = tree.tree_tokens.shape
        return self.logits.view(b, t, -1), torch.zeros(b, t, 4), torch.zeros(b, 1, dtype=torch.int32)

    def kv_layers(self):
        return []


def test_plain_decode_program_emits_the_argmax():
    logits = torch.randn(3, 12)
    step = lower(StepProgram.plain_decode(), _bucket(None, 3), "cpu")
    out = step(_Models(logits), {"last_tokens": torch.tensor([1, 2, 3]), "prefix_lens": torch.tensor([5, 6, 7])})
    assert torch.equal(out["bonus"], logits.argmax(-1))
    assert torch.equal(out["accept_len"], torch.zeros(3, dtype=torch.long))
    assert torch.equal(out["new_prefix_lens"], torch.tensor([6, 7, 8]))
