"""GRPO units on hand-computed cases: advantages, dropped groups, clipping at both sides, aggregation, KL."""

from __future__ import annotations

import math

import pytest
import torch

from tlt_rt.train.rl.grpo import equal_reward_groups, group_advantages, kl_k3, policy_loss, token_logprobs


def test_group_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: mean 0.75, std 0.5
    s0 = math.sqrt(1 / 3)
    want = torch.tensor([[0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0], [0.5, 0.5, 0.5, -1.5]])
    assert torch.allclose(group_advantages(r, eps=0.0), want, atol=1e-6)
    assert torch.allclose(group_advantages(r, normalize_std=False), r - r.mean(1, keepdim=True))


def test_group_advantages_equal_group_is_zero_and_finite():
    adv = group_advantages(torch.tensor([[2.0, 2.0, 2.0]]))
    assert torch.equal(adv, torch.zeros(1, 3))


def test_group_advantages_rejects_bad_shape():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.tensor([[1.0], [0.0]]))


def test_equal_reward_groups():
    r = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.5]])
    assert equal_reward_groups(r).tolist() == [True, False, True, True]


def _one_token(ratio: float, adv: float, **kw):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_unclipped_loss_and_gradient():
    loss, grad, stats = _one_token(1.1, 2.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(-2.2)
    assert grad == pytest.approx(-2.2)  # d(-r*A)/dlogp = -r*A
    assert stats.clipped_low == 0 and stats.clipped_high == 0


def test_clip_high_positive_advantage():
    # ratio 1.5 > 1 + 0.28 with A > 0: the clipped term wins, no gradient
    loss, grad, stats = _one_token(1.5, 1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(-1.28)
    assert grad == 0.0
    assert stats.clipped_high == 1 and stats.clipped_low == 0
    # the same ratio is inside a wider upper clip: plain gradient
    loss, grad, _ = _one_token(1.5, 1.0, clip_low=0.2, clip_high=0.6)
    assert loss == pytest.approx(-1.5) and grad == pytest.approx(-1.5)


def test_clip_low_negative_advantage():
    # ratio 0.5 < 1 - 0.2 with A < 0: clipped at 0.8, no gradient
    loss, grad, stats = _one_token(0.5, -1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert stats.clipped_low == 1 and stats.clipped_high == 0


def test_clipping_is_one_sided():
    # a ratio beyond the clip but moving against the advantage is not clipped (pessimistic bound)
    loss, grad, _ = _one_token(0.5, 1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(-0.5) and grad == pytest.approx(-0.5)
    loss, grad, _ = _one_token(1.5, -1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5)


def test_token_vs_sequence_aggregation():
    # on-policy (ratio 1): per-token loss is -A. Response 0 has 1 token (A=1), response 1 has 3 (A=-1).
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    tok, _ = policy_loss(logp, logp, adv, mask, agg="token")
    seq, _ = policy_loss(logp, logp, adv, mask, agg="sequence")
    assert tok.item() == pytest.approx((-1 + 3) / 4)  # long responses weigh more
    assert seq.item() == pytest.approx((-1 + 1) / 2)  # each response weighs the same


def test_global_normalisers_make_parts_sum_to_the_whole():
    torch.manual_seed(0)
    logp, old = torch.randn(4, 5), torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    mask[:, 0] = 1
    adv = torch.randn(4)
    for agg in ("token", "sequence"):
        whole, _ = policy_loss(logp, old, adv, mask, agg=agg)
        n_tok, n_seq = mask.sum().item(), 4
        parts = sum(
            policy_loss(logp[s], old[s], adv[s], mask[s], agg=agg, num_tokens=n_tok, num_seqs=n_seq)[0]
            for s in (slice(0, 1), slice(1, 4))
        )
        assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_kl_k3_properties_and_penalty():
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    assert torch.equal(kl_k3(logp, logp), torch.zeros(1, 2))
    ref = torch.log(torch.tensor([[0.25, 0.4]]))
    k3 = kl_k3(logp, ref)
    d = ref - logp
    assert torch.allclose(k3, d.exp() - d - 1) and (k3 > 0).all()
    mask, adv = torch.ones(1, 2), torch.zeros(1)
    base, _ = policy_loss(logp, logp, adv, mask)
    off, _ = policy_loss(logp, logp, adv, mask, ref_logp=ref, kl_coef=0.0)
    on, stats = policy_loss(logp, logp, adv, mask, ref_logp=ref, kl_coef=0.5)
    assert base.item() == off.item() == 0.0  # off by default
    assert on.item() == pytest.approx(0.5 * k3.mean().item())
    assert stats.kl_sum == pytest.approx(k3.sum().item())


def test_token_logprobs_temperature_and_filter():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    targets = torch.tensor([[1]])
    lp = token_logprobs(logits, targets, temperature=0.5)
    assert lp.item() == pytest.approx(torch.log_softmax(logits / 0.5, -1)[0, 0, 1].item())
    keep = torch.tensor([[[True, True, False, False]]])  # a top-2 filter
    lp = token_logprobs(logits, targets, temperature=1.0, keep=keep)
    assert lp.item() == pytest.approx(math.log(math.exp(1) / (math.exp(2) + math.exp(1))))


# ----------------------------------------------------------------------------- the learner on a tiny model
TINY = dict(
    model_type="llama", vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64, eos_token_ids=(15,),
)  # fmt: skip


def _tiny_learner(**rl):
    from tlt_rt.config import RLConfig
    from tlt_rt.models.arch import ArchConfig
    from tlt_rt.models.llama import CausalLM
    from tlt_rt.train.rl.learner import Learner, SamplingFilter

    torch.manual_seed(0)
    model = CausalLM(ArchConfig(**TINY))
    cfg = RLConfig(**{"lr": 1e-2, "micro_batch": 2, **rl})
    return model, cfg, Learner, SamplingFilter


def _samples():
    from tlt_rt.train.rl.learner import LearnSample

    return [
        LearnSample([1, 2, 3], [4, 5], [-2.0, -2.5], 1.0),
        LearnSample([1, 2], [6, 7, 8], [-2.2, -2.1, -3.0], -1.0),
        LearnSample([3], [9], [-1.9], 0.5),
    ]


def test_learner_step_changes_parameters_and_counts_tokens():
    from tlt_rt.train.rl.learner import MiniBatch

    model, cfg, Learner, SamplingFilter = _tiny_learner()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner = Learner(model, cfg, SamplingFilter(temperature=1.0))
    out = learner.update([MiniBatch(_samples(), num_tokens=6, num_seqs=3)])
    assert out.optimizer_steps == 1 and out.tokens == 6 and learner.version == 1
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "lm_head.weight" in changed


def test_learner_recompute_matches_paged_logprobs_scale():
    model, cfg, Learner, SamplingFilter = _tiny_learner()
    learner = Learner(model, cfg, SamplingFilter(temperature=0.7, top_k=4))
    samples = _samples()
    learner.recompute_logprobs(samples)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits[0, 2] / 0.7
    top = torch.topk(logits, 4)
    want = (logits[4] - torch.logsumexp(top.values, 0)).item()
    assert samples[0].old_logprobs[0] == pytest.approx(want, abs=1e-5)


def test_data_parallel_learners_equal_one_learner():
    """Two learners splitting the batch, gradients summed between them, end with the single learner's weights."""
    import threading

    from tlt_rt.train.rl.learner import MiniBatch

    samples = _samples()
    model, cfg, Learner, SamplingFilter = _tiny_learner(max_grad_norm=0.5)
    single = Learner(model, cfg, SamplingFilter(1.0))
    single.update([MiniBatch(samples, 6, 3)])

    slots: list = [None, None]
    barrier = threading.Barrier(2)

    def make_sync(rank):
        def sync(grads):
            slots[rank] = [g.clone() for g in grads]
            barrier.wait()
            for g, a, b in zip(grads, slots[0], slots[1], strict=True):
                g.copy_(a + b)
            barrier.wait()

        return sync

    models = []
    for rank, part in ((0, samples[:1]), (1, samples[1:])):
        m, *_ = _tiny_learner(max_grad_norm=0.5)
        models.append((m, Learner(m, cfg, SamplingFilter(1.0), grad_sync=make_sync(rank)), part))
    threads = [threading.Thread(target=lrn.update, args=([MiniBatch(part, 6, 3)],)) for _, lrn, part in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, want in model.state_dict().items():
        a, b = models[0][0].state_dict()[name], models[1][0].state_dict()[name]
        assert torch.equal(a, b), name
        assert torch.allclose(a, want, atol=1e-6), name


def test_learner_kl_to_reference_and_bf16_master_weights():
    import copy

    from tlt_rt.train.rl.learner import MiniBatch

    model, cfg, Learner, SamplingFilter = _tiny_learner(kl_coef=0.1)
    ref = copy.deepcopy(model).requires_grad_(False)
    learner = Learner(model, cfg, SamplingFilter(1.0), ref_model=ref)
    first = learner.update([MiniBatch(_samples(), 6, 3)])
    assert first.kl_sum == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    second = learner.update([MiniBatch(_samples(), 6, 3)])
    assert second.kl_sum > 0

    model, cfg, Learner, SamplingFilter = _tiny_learner(lr=1e-3)
    model = model.to(torch.bfloat16)
    before = model.lm_head.weight.detach().clone()
    learner = Learner(model, cfg, SamplingFilter(1.0))
    assert learner.master is not None and learner.master[0].dtype == torch.float32
    learner.update([MiniBatch(_samples(), 6, 3)])
    assert not torch.equal(model.lm_head.weight, before) and model.lm_head.weight.dtype == torch.bfloat16
    master = dict(zip([n for n, _ in model.named_parameters()], learner.master, strict=True))
    assert torch.equal(master["lm_head.weight"].to(torch.bfloat16), model.lm_head.weight)


def test_micro_batches_by_tokens_give_the_same_update():
    from tlt_rt.train.rl.learner import LearnSample, MiniBatch, _token_chunks

    samples = _samples() + [LearnSample([2, 3, 4, 5], [6, 7, 8, 9, 10], [-2.0] * 5, 0.3)]
    # sorted by length (rows = prompt + response - 1: 1, 4, 4, 8), packed while count x longest <= 8
    chunks = _token_chunks(samples, 8)
    assert [[len(s.prompt) + len(s.response) - 1 for s in c] for c in chunks] == [[1, 4], [4], [8]]
    assert _token_chunks(samples, 2) == [[samples[2]], [samples[0]], [samples[1]], [samples[3]]]  # alone if over
    states = []
    for rl in ({"micro_batch": 4}, {"micro_batch_tokens": 8}):
        model, cfg, Learner, SamplingFilter = _tiny_learner(**rl)
        learner = Learner(model, cfg, SamplingFilter(temperature=1.0))
        out = learner.update([MiniBatch([LearnSample(s.prompt, s.response, list(s.old_logprobs), s.advantage)
                                         for s in samples], num_tokens=11, num_seqs=4)])  # fmt: skip
        states.append((out.tokens, model.state_dict()))
    assert states[0][0] == states[1][0] == 11
    for k, v in states[0][1].items():
        torch.testing.assert_close(states[1][1][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_micro_batch_tokens_must_not_be_negative():
    from tlt_rt.config import ConfigError, RLConfig

    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        RLConfig(micro_batch_tokens=-1)


@pytest.mark.parametrize(
    "sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8}]
)
def test_chunked_and_checkpointed_learner_gives_the_dense_update(sampling):
    """The log-probs through the head a chunk of response rows at a time, and layers recomputed in the backward,
    change neither the loss nor the update of the dense learner (full logits, every activation kept)."""
    from tlt_rt.train.rl.learner import LearnSample, MiniBatch

    def greedy(model, prompt, n):  # tokens a filtered sampler can draw (the argmax is always kept)
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    results = []
    for rl in ({"logprob_chunk_tokens": 0}, {"logprob_chunk_tokens": 2, "activation_checkpointing": True}):
        model, cfg, Learner, SamplingFilter = _tiny_learner(micro_batch=4, **rl)
        learner = Learner(model, cfg, SamplingFilter(**sampling))
        samples = [LearnSample(s.prompt, greedy(model, s.prompt, len(s.response)), [0.0] * len(s.response),
                               s.advantage) for s in _samples()]  # fmt: skip
        learner.recompute_logprobs(samples)
        out = learner.update([MiniBatch(samples, num_tokens=6, num_seqs=3)])
        results.append(([s.old_logprobs for s in samples], out, model.state_dict()))
    (lp0, out0, state0), (lp1, out1, state1) = results
    for a, b in zip(lp0, lp1, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert out1.loss == pytest.approx(out0.loss, abs=1e-6) and out1.tokens == out0.tokens == 6
    for k, v in state0.items():
        torch.testing.assert_close(state1[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_learner_counts_forward_tokens_and_model_flops():
    from tlt_rt.models.arch import ArchConfig
    from tlt_rt.train.rl.flops import layer_matmul_params, update_flops
    from tlt_rt.train.rl.learner import MiniBatch

    model, cfg, Learner, SamplingFilter = _tiny_learner(micro_batch=4)
    out = Learner(model, cfg, SamplingFilter()).update([MiniBatch(_samples(), num_tokens=6, num_seqs=3)])
    lengths = [4, 4, 1]  # prompt + response - 1 of each sample
    assert out.forward_tokens == 9
    a = ArchConfig(**TINY)
    assert out.flops == pytest.approx(update_flops(a, lengths, 6))
    dense = 6 * a.num_hidden_layers * layer_matmul_params(a) * 9
    assert update_flops(a, lengths, 6) > dense  # attention and the head come on top
    assert update_flops(a, [8], 0) - update_flops(a, [4, 4], 0) > 0  # attention grows with the square


def test_pad_batch_finds_the_response_rows_on_the_host():
    from tlt_rt.train.rl.learner import LearnSample, pad_batch

    samples = [
        LearnSample([5, 6, 7], [8, 9], [-0.5, -0.25], 1.0),
        LearnSample([5], [4, 3, 2], [-1.0, -2.0, -3.0], -1.0),
    ]
    ids, targets, mask, old, rows = pad_batch(samples, 0, "cpu")
    assert torch.equal(rows, mask.flatten().nonzero().squeeze(1))
    assert targets.flatten()[rows].tolist() == [8, 9, 4, 3, 2]  # each response token, in order
    assert old.flatten()[rows].tolist() == [-0.5, -0.25, -1.0, -2.0, -3.0]
