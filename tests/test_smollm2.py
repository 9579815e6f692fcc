"""The embedded default model: our implementation against transformers on SmolLM2-135M-Instruct."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tlt_rt.models import load_target
from tlt_rt.models.default import default_gguf, default_model_dir, load_tokenizer
from tlt_rt.models.generate import generate_simple


@pytest.fixture(scope="module")
def smollm2():
    return load_target(None, dtype="float32"), load_tokenizer(None)


def _chat_ids(tok, text: str) -> list[int]:
    return list(
        tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )


def test_matches_transformers(smollm2):
    model, tok = smollm2
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    ids = torch.tensor([_chat_ids(tok, "Tom has 12 apples and buys 7 more. How many apples now?")])
    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda m, i, o: captured.update(h=o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids)
    hook.remove()
    # real activations reach the hundreds, so judge by relative norm (fp32 lands near 1e-6)
    for got, want in ((ours.hidden, captured["h"]), (ours.logits, ref)):
        assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert torch.equal(ours.logits.argmax(-1), ref.argmax(-1))


def test_greedy_answers_arithmetic(smollm2):
    model, tok = smollm2
    out = generate_simple(model, [_chat_ids(tok, "What is 17*3?")], max_new_tokens=8)
    assert tok.decode(out[0]).startswith("17*3 = 51")


def test_gguf_path_loads_the_same_weights(smollm2):
    model, _ = smollm2
    direct = load_target(default_gguf(), dtype="float32")
    for (n, a), (_, b) in zip(model.state_dict().items(), direct.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
