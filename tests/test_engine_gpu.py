"""The engine on CUDA: Triton kernels and CUDA graphs give the same tokens as the eager torch path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.test_engine import PROMPTS, TINY
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.llama import CausalLM
from tlt_rt.rollout import Engine, SamplingParams

pytestmark = pytest.mark.gpu


# the Triton kernels want head dims of at least 16
GPU_TINY = replace(
    TINY, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256
)


def _pair():
    torch.manual_seed(0)
    target = CausalLM(GPU_TINY).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    return target.cuda(), Drafter(GPU_TINY, target).cuda().eval()


def _engines(**kw):
    out = []
    for eager, backend in ((True, "torch"), (False, "auto")):
        target, drafter = _pair()
        out.append(Engine(target, drafter=drafter, block_size=16, enforce_eager=eager, attn_backend=backend, **kw))
    return out


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_graphs_and_kernels_match_eager_torch(speculative):
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=40, stop_token_ids=[])
    eager, graphed = _engines(speculative=speculative, strategies=("3_3_8", "4_2_6"))
    a, b = eager.generate(PROMPTS, params), graphed.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert graphed.graph_memory()["graphs"] > 0
    if speculative == "on":
        assert graphed.stats()["sd_steps"] > 0


def test_capture_all_buckets_then_generate():
    _, graphed = _engines(speculative="auto", strategies=("3_3_8", "4_2_6"), max_batch=8)
    mem = graphed.capture()
    assert mem["graphs"] == len(graphed.graph_keys()[0]) + len(graphed.graph_keys()[1])
    outs = graphed.generate([[1, 2, 3]], SamplingParams(n=8, temperature=0.9, max_new_tokens=16, stop_token_ids=[]))
    assert len(outs) == 8 and all(len(o.token_ids) == 16 for o in outs)


def test_smollm2_bf16_answers():
    from tlt_rt.models.default import load_tokenizer

    tok = load_tokenizer(None)
    eng = Engine.from_pretrained(None, speculative="on", dtype="bfloat16", device="cuda", strategies=("6_4_16",))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 17*3?"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    out = eng.generate([list(ids)], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert tok.decode(out[0].token_ids).startswith("17*3 = 51")
    assert torch.cuda.is_available()
