"""Exactness on Qwen2.5's shape on CUDA: a 151,936-id vocabulary with q/k/v biases and tied embeddings.

The random-weight model checks the graphed engine (Triton kernels, captured steps) against the eager one and
checks sampling against the exact distribution; the real checkpoint (when fetched, or named by
`TLT_QWEN_GGUF`) checks that greedy speculation gives plain decoding's tokens on chain-of-thought answers.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
from scipy.stats import chisquare

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.llama import CausalLM
from tlt_rt.rollout import Engine, SamplingParams

pytestmark = pytest.mark.gpu

QWEN_SHAPE = ArchConfig(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    qkv_bias=True,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
    eos_token_ids=(151645,),
)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 1], [3], [151935, 2, 151000, 2, 2]]


def _pair(scale: float = 4.0):
    torch.manual_seed(0)
    target = CausalLM(QWEN_SHAPE).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(scale)  # tied: the head too; peaked answers give accepted drafts
        for layer in target.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
            layer.self_attn.k_proj.bias.normal_(0, 0.5)
    return target.cuda(), Drafter(QWEN_SHAPE, target).cuda().eval()


def _engine(speculative: str, eager: bool, **kw):
    target, drafter = _pair(kw.pop("scale", 4.0))
    return Engine(target, drafter=drafter if speculative != "off" else None, speculative=speculative, block_size=16,
                  enforce_eager=eager, attn_backend="torch" if eager else "auto", **kw)  # fmt: skip


def test_qwen_shape_greedy_graphed_speculation_equals_eager_plain():
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=[])
    strategies = ("3_3_8", "4_2_6")
    plain = _engine("off", eager=True, strategies=strategies).generate(PROMPTS, params)
    graphed = _engine("on", eager=False, strategies=strategies, max_batch=16)
    got = graphed.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert graphed.stats()["sd_steps"] > 0 and graphed.graph_memory()["graphs"] > 0


def test_qwen_shape_sampling_with_top_k_is_exact():
    """The first two sampled tokens under top-k 6 (36 pairs) against their exact joint distribution."""
    n, temperature, k = 3000, 1.0, 6
    # embeddings of std 0.05 (tied head): the top-6 sets hold 14-21% each, so all 36 pairs are seen often
    eng = _engine("on", eager=False, strategies=("3_3_8",), max_batch=512, scale=0.05)
    prompt = [1, 2, 3]
    outs = eng.generate(
        [prompt], SamplingParams(n=n, temperature=temperature, top_k=k, max_new_tokens=2, stop_token_ids=[], seed=7)
    )
    with torch.no_grad():
        t = eng.target
        first = t(torch.tensor([prompt], device="cuda")).logits[0, -1].float() / temperature
        v1, i1 = first.topk(k)
        seqs = torch.tensor([prompt + [int(a)] for a in i1], device="cuda")
        second = t(seqs).logits[:, -1].float() / temperature
        v2, i2 = second.topk(k, dim=-1)
    p = (torch.softmax(v1, -1)[:, None] * torch.softmax(v2, -1)).flatten().cpu()
    index = {(int(a), int(b)): i * k + j for i, a in enumerate(i1) for j, b in enumerate(i2[i])}
    counts = torch.zeros(k * k)
    for o in outs:
        pair = (o.token_ids[0], o.token_ids[1])
        assert pair in index, f"{pair} lies outside the top-{k} sets"
        counts[index[pair]] += 1
    keep = p * n >= 5  # cells with too small an expectation are merged into one, if there are any
    obs, exp = counts[keep], p[keep] * n
    if not keep.all():
        obs = torch.cat([obs, counts[~keep].sum(0, keepdim=True)])
        exp = torch.cat([exp, p[~keep].sum(0, keepdim=True) * n])
    assert len(obs) >= 10, f"only {len(obs)} cells with an expectation of 5 or more"
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-4
    assert eng.stats()["sd_steps"] > 0


def _real_qwen() -> str | None:
    path = os.environ.get("TLT_QWEN_GGUF")
    if path:
        return path
    from tlt_rt.models.default import resolve_model_path

    for name in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"):
        try:
            return str(resolve_model_path(name))
        except (FileNotFoundError, ValueError, KeyError):
            continue
    return None


def test_real_qwen_greedy_speculation_gives_plain_tokens():
    """fp32 on the GPU: speculation's verify (a tree through the Triton kernels) and plain decoding pick the
    same argmax at every position of answers of up to 192 tokens to arithmetic word problems."""
    path = _real_qwen()
    if path is None:
        pytest.skip(
            "no Qwen2.5 checkpoint: python -m tlt_rt.models.fetch qwen2.5-coder-0.5b-instruct, or TLT_QWEN_GGUF"
        )
    from tlt_rt.models import load_target
    from tlt_rt.models.default import load_tokenizer
    from tlt_rt.train.rl.data import ArithmeticTask, format_prompt

    tok = load_tokenizer(path)
    prompts = [format_prompt(p, tok) for p in ArithmeticTask(digits=2, num_ops=2, seed=3).sample(4)]
    params = SamplingParams(temperature=0.0, max_new_tokens=192)
    outs = {}
    for mode in ("off", "on"):
        target = load_target(path, dtype="float32", device="cuda")
        torch.manual_seed(0)
        drafter = Drafter(target.arch, target).cuda().eval() if mode == "on" else None
        eng = Engine(target, drafter=drafter, speculative=mode, strategies=("4_4_16",), max_batch=8)
        outs[mode] = [o.token_ids for o in eng.generate(prompts, params)]
        if mode == "on":
            assert eng.stats()["sd_steps"] > 0
        del eng, target, drafter
        torch.cuda.empty_cache()
    assert outs["on"] == outs["off"]
    text = tok.decode(outs["off"][0])
    # an answer in words and numbers, not noise (the 1.5B model works the steps; the 0.5B may state the result)
    assert len(re.findall(r"[A-Za-z]{2,}", text)) >= 3 and any(c.isdigit() for c in text), text


def test_learner_attention_stays_off_cudnn_and_matches_the_math_kernel():
    """The learner's dense causal attention (GQA, Qwen's 6:1 heads) launches no cuDNN kernel, whose per-shape
    plan building cost an RL update most of its time, and agrees with the math backend, gradients included."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tlt_rt.models.attention import causal_attention

    torch.manual_seed(0)
    q = torch.randn(3, 37, 12, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(3, 37, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(3, 37, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = causal_attention(q, k, v, 128**-0.5)
        out.float().square().sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names and not [n for n in names if "cudnn" in n.lower()], names
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = torch.nn.functional.scaled_dot_product_attention(
            qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), is_causal=True, scale=128**-0.5,
            enable_gqa=True,
        ).transpose(1, 2)  # fmt: skip
        ref.square().sum().backward()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, (qf.grad, kf.grad, vf.grad), strict=True):
        torch.testing.assert_close(got.float(), want, atol=5e-2 * want.abs().max().item(), rtol=5e-2)


def test_learner_compiled_layers_update_as_eager_with_no_cudnn_and_no_compile_after_warm_up():
    """The learner's default on a GPU (`rl.compile_layers`): its layers through torch.compile beside the engine's
    compiled glue, on Qwen's shape (GQA, qkv bias) in bf16. The warm-up compiles, the updates of new shapes do
    not; the loss and the updated weights match an eager learner's; no cuDNN attention kernel runs inside."""
    from tlt_rt.config import RLConfig
    from tlt_rt.train.rl.learner import Learner, LearnSample, MiniBatch, SamplingFilter

    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        # the real model's attention heads (128 wide, 6 query heads a key head) on a small width
        arch = dataclasses.replace(QWEN_SHAPE, hidden_size=768, intermediate_size=1024, num_attention_heads=6,
                                   num_key_value_heads=1, head_dim=128)  # fmt: skip
        models = [CausalLM(arch).to("cuda", torch.bfloat16) for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        for m in models:
            m.compile_glue()
        cfg = [RLConfig(micro_batch_tokens=2048, lr=1e-4, compile_layers=c) for c in (False, True)]
        learners = [Learner(m, c, SamplingFilter()) for m, c in zip(models, cfg, strict=True)]
        assert models[1].compile_layers and not models[0].compile_layers
        assert learners[1].warm_up(max_len=512) > 0
        for lengths in ([300, 310, 401], [40, 57], [500], [90, 100]):  # 400 and 56 rows: multiples of 8
            batch = [LearnSample([1, 2, 3], [(7 * i + n) % 5000 for i in range(n - 3)], [-1.0] * (n - 3), 1.0)
                     for n in lengths]  # fmt: skip
            mb = [MiniBatch(batch, num_tokens=sum(lengths), num_seqs=len(lengths))]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                outs = [learner.update(mb) for learner in learners]
                torch.cuda.synchronize()
            names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            assert not [n for n in names if "cudnn" in n.lower()]
            assert outs[1].compiles == 0, lengths
            assert outs[1].loss == pytest.approx(outs[0].loss, rel=2e-2, abs=1e-3)
        for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=name)
    finally:
        torch._dynamo.reset()
