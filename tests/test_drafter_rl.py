"""The drafter's RL-temperature training: training-time test, losses at the sampling temperature, reduced draft
vocabulary from rollout counts, the draft-vocab logits path, and the perfect-drafter ceiling with the engine's tree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.drafter import Pager, V, rows, tiny_pair
from tlt_rt.config import ConfigError, DrafterConfig
from tlt_rt.ir.tree import Candidates, build_tree
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.drafter_unrolled import chain_attention, longest_sample
from tlt_rt.train.drafter.data import DrafterBuffer, collect_hidden
from tlt_rt.train.drafter.eval import oracle_steps, oracle_tree_steps, tree_accepts, walk_steps
from tlt_rt.train.drafter.loss import UNROLL_DECAY, batch_loss, drafter_loss, sampled_next
from tlt_rt.train.drafter.trainer import DrafterTrainer
from tlt_rt.train.drafter.vocab import DraftVocab

TOL = dict(atol=1e-9, rtol=1e-9)  # float64


def packed_input(target, drafter, lengths=(5, 7), seed=1):
    """A packed row of two samples: ids [1, T], features [1, T, H], positions, segment ids."""
    g = torch.Generator().manual_seed(seed)
    ids, feats, pos, seg = [], [], [], []
    for k, n in enumerate(lengths):
        i, f = rows(target, drafter, n, g)
        ids.append(i), feats.append(f), pos.append(torch.arange(n)), seg.append(torch.full((n,), k))
    return torch.cat(ids)[None], torch.cat(feats)[None], torch.cat(pos)[None], torch.cat(seg)[None]


@pytest.mark.parametrize("model_type,block", [("llama", 0), ("qwen2", 0), ("llama", 4), ("qwen2", 3)])
def test_unrolled_passes_are_the_engines_chain_drafts(model_type, block):
    """Pass k at row t equals drafting k steps from root t-k the engine's way: true rows up to the root,
    then the chain of the drafter's own features (a plain causal run over that sequence); with one dense mask
    (block 0) and in bands of a few queries."""
    target, drafter = tiny_pair(model_type)
    target.double(), drafter.double()
    ids, feats, pos, seg = packed_input(target, drafter)
    with torch.no_grad():
        outs = drafter.forward_unrolled(ids, feats, pos, seg, 3, block=block)
        torch.testing.assert_close(outs[0][0].hidden, drafter(ids, feats, pos, seg).hidden, **TOL)
        checked = 0
        for k in (1, 2):
            out, valid = outs[k]
            for t in range(ids.shape[1]):
                start = 0 if seg[0, t] == 0 else 5
                assert bool(valid[0, t]) == (t - k >= start)
                if not valid[0, t]:
                    continue
                r = t - k
                cur_ids, cur_f = ids[:, start : r + 1], feats[:, start : r + 1]
                for j in range(k):  # feed the chain its own predictions
                    h = drafter(cur_ids, cur_f).hidden[:, -1:]
                    cur_ids, cur_f = torch.cat([cur_ids, ids[:, r + 1 + j : r + 2 + j]], 1), torch.cat([cur_f, h], 1)
                want = drafter(cur_ids, cur_f).hidden[0, -1]
                torch.testing.assert_close(out.hidden[0, t], want, **TOL)
                checked += 1
    assert checked == 10 + 8  # rows whose root lies in their own sample: pass 1, pass 2


def buffer_of(target, n=3, length=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, V, (length + i,), generator=g) for i in range(n)]
    buf = DrafterBuffer(max_steps=2)
    buf.add(0, seqs, collect_hidden(target, seqs))
    return buf, seqs


def test_unroll_1_is_the_plain_loss_and_more_passes_average_with_decay():
    target, drafter = tiny_pair()
    buf, _ = buffer_of(target)
    batch = buf.next_batch(64)
    with torch.no_grad():
        plain = batch_loss(drafter, batch)
        for ctx in ("chain", "shifted"):
            assert torch.equal(batch_loss(drafter, batch, unroll=1, unroll_context=ctx).loss, plain.loss)
        two = batch_loss(drafter, batch, unroll=2)
        assert torch.equal(two.top1, plain.top1)  # metrics are pass 1's
        inp = drafter.features(batch.hidden)
        outs = drafter.forward_unrolled(batch.input_ids, inp, batch.positions, batch.segment_ids, 2)
        tgt = drafter.features(batch.target_hidden)
        second = drafter_loss(
            outs[1][0].hidden, outs[1][0].logits, tgt, drafter.logits(tgt), batch.loss_mask & outs[1][1], 1.0, 0.1
        )
    torch.testing.assert_close(two.loss, (plain.loss + UNROLL_DECAY * second.loss) / (1 + UNROLL_DECAY))
    with pytest.raises(ValueError, match="unroll_context"):
        batch_loss(drafter, batch, unroll=2, unroll_context="diagonal")


def test_banded_attention_is_the_dense_one():
    """The training-time test's attention in bands of `block` queries gives the dense mask's outputs and
    gradients on every row that counts: several samples a row, padding, two rows, up to five passes."""
    target, drafter = tiny_pair("qwen2")
    target.double(), drafter.double()
    rows_ = [packed_input(target, drafter, lengths, seed) for seed, lengths in ((2, (9, 3, 6, 4)), (3, (2, 11, 5, 4)))]
    ids, feats, pos, seg = (torch.cat(x, 0) for x in zip(*rows_, strict=True))
    feats.requires_grad_()
    seg[0, -3:] = -1  # padding at a row's end
    assert longest_sample(seg) == 11
    assert longest_sample(torch.tensor([[0, 0, -1, -1, -1], [1, 1, 1, -1, 2]])) == 3
    for block in (2, 5, 8):
        want, got = (drafter.forward_unrolled(ids, feats, pos, seg, 5, block=b) for b in (0, block))
        dense_grads = torch.autograd.grad(sum((o.logits * v[..., None]).sum() for o, v in want), feats)
        for (w, valid), (g, same_valid) in zip(want, got, strict=True):
            assert torch.equal(valid, same_valid)
            torch.testing.assert_close(g.hidden[valid], w.hidden[valid], **TOL)
            torch.testing.assert_close(g.logits[valid], w.logits[valid], **TOL)
        banded_grads = torch.autograd.grad(sum((o.logits * v[..., None]).sum() for o, v in got), feats)
        # the rotary runs in float32 (its frequencies are never rounded), so sums of many rows' gradients differ
        # at float32's rounding
        torch.testing.assert_close(banded_grads[0], dense_grads[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["MATH", "FLASH_ATTENTION"])
def test_banded_attention_runs_on_every_sdpa_kernel(backend):
    """The banded output is regrouped into rows whatever memory layout the attention kernel returns (the math
    kernel's is heads-major: a view of it failed)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(4)
    q, ks, vs = torch.randn(1, 40, 4, 8, generator=g), [], []
    for _ in range(3):
        ks.append(torch.randn(1, 40, 2, 8, generator=g)), vs.append(torch.randn(1, 40, 2, 8, generator=g))
    seg = torch.repeat_interleave(torch.arange(5), 8)[None]
    with sdpa_kernel(getattr(SDPBackend, backend)):
        dense, banded = (chain_attention(q, ks, vs, seg, 0.3, block) for block in (0, 4))
    torch.testing.assert_close(banded, dense, atol=1e-5, rtol=1e-5)


def test_gradient_flows_through_the_unroll():
    target, drafter = tiny_pair()
    ids, feats, pos, seg = packed_input(target, drafter)
    outs = drafter.forward_unrolled(ids, feats, pos, seg, 2)
    first = outs[0][0].hidden
    (g,) = torch.autograd.grad(outs[1][0].logits.logsumexp(-1).sum(), first, retain_graph=True)
    assert g[0, :-1].abs().sum() > 0  # every row but the last feeds a pass-2 row
    buf, _ = buffer_of(target)
    batch = buf.next_batch(64)
    for unroll in (1, 2):
        drafter.zero_grad()
        batch_loss(drafter, batch, unroll=unroll).loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
        assert all(p.grad is None for p in target.parameters())


def test_token_loss_at_the_sampling_temperature():
    g = torch.Generator().manual_seed(0)
    pred, tgt = torch.randn(6, V, generator=g), torch.randn(6, V, generator=g) * 3
    h = torch.zeros(6, 4)
    mask = torch.ones(6, dtype=torch.bool)

    def token(temp, **kw):
        return drafter_loss(h, pred, h, tgt, mask, 0.0, 1.0, temperature=temp, **kw).token_loss

    soft = -(torch.softmax(tgt, -1) * torch.log_softmax(pred, -1)).sum(-1).mean()
    torch.testing.assert_close(token(1.0), soft)
    torch.testing.assert_close(token(0.0), F.cross_entropy(pred, tgt.argmax(-1)))
    torch.testing.assert_close(token(1e-4), token(0.0), atol=1e-3, rtol=1e-3)  # cold targets tend to greedy ones
    hot = -(torch.softmax(tgt / 2, -1) * torch.log_softmax(pred, -1)).sum(-1).mean()
    torch.testing.assert_close(token(2.0), hot)
    # the sampled-token term: a cross-entropy on the drawn ids, rows without one (-1) left out
    labels = torch.tensor([3, -1, 5, 7, -1, 0])
    base = drafter_loss(h, pred, h, tgt, mask, 0.0, 1.0)
    extra = drafter_loss(h, pred, h, tgt, mask, 0.0, 1.0, sampled_labels=labels, sampled_weight=0.5)
    keep = labels >= 0
    torch.testing.assert_close(extra.loss - base.loss, 0.5 * F.cross_entropy(pred[keep], labels[keep]))


def test_sampled_next_is_the_same_samples_next_token():
    target, drafter = tiny_pair()
    buf, seqs = buffer_of(target, n=2, length=6)
    for packed in (True, False):
        buf.load_state_dict({**buf.state_dict(), "pos": 0, "offset": 0})
        batch = buf.next_batch(64, packed=packed)
        nxt = sampled_next(batch)
        for r in range(batch.input_ids.shape[0]):
            for t in range(batch.input_ids.shape[1]):
                same = t + 1 < batch.input_ids.shape[1] and batch.segment_ids[r, t + 1] == batch.segment_ids[r, t]
                want = int(batch.input_ids[r, t + 1]) if same and batch.segment_ids[r, t] >= 0 else -1
                assert int(nxt[r, t]) == want
    drafter.set_draft_vocab(torch.arange(0, V, 2))
    mapped = sampled_next(batch, drafter.t2d())
    assert torch.equal(mapped, torch.where((nxt >= 0) & (nxt % 2 == 0), nxt // 2, -1))
    with torch.no_grad():  # the loss with the sampled term runs on a reduced vocabulary too
        assert torch.isfinite(batch_loss(drafter, batch, sampled_weight=0.5, temperature=0.0).loss)


def test_top_k_over_draft_logits_mapped_by_d2t_is_the_full_vocab_top_k():
    target, drafter = tiny_pair()
    g = torch.Generator().manual_seed(3)
    d2t = torch.randperm(V, generator=g)[:30]
    drafter.set_draft_vocab(d2t)
    ids, feats = rows(target, drafter, 7, g)
    pager = Pager(1, 16, 4, g)
    p = torch.arange(7)
    meta = pager.meta([7], [7], [pager.slots(0, p)], "prefill")
    with torch.no_grad():
        full = drafter.forward_paged(ids, feats, p, drafter.make_cache(pager.num_blocks, 4), meta)
        small = drafter.forward_paged(ids, feats, p, drafter.make_cache(pager.num_blocks, 4), meta, full_vocab=False)
    assert small.logits.shape == (7, 30) and torch.equal(small.hidden, full.hidden)
    for k in (1, 4, 30):
        want = full.logits.topk(k, -1)
        got = small.logits.topk(k, -1)
        assert torch.equal(drafter.to_target_ids(got.indices), want.indices)
        assert torch.equal(got.values, want.values)
    assert torch.equal(drafter.t2d()[d2t], torch.arange(30))


def test_load_state_dict_carries_the_draft_vocabulary():
    target, trained = tiny_pair()
    serving = Drafter(target.arch, target)
    trained.set_draft_vocab(torch.arange(10, 50))
    serving.load_state_dict(trained.state_dict())
    assert torch.equal(serving.d2t, trained.d2t) and torch.equal(serving.draft_head, trained.draft_head)
    ptrs = serving.d2t.data_ptr(), serving.draft_head.data_ptr()
    trained.set_draft_vocab(torch.arange(50, 90))  # rebuilt, same size: copied in place (captured graphs stay valid)
    serving.load_state_dict(trained.state_dict())
    assert torch.equal(serving.d2t, trained.d2t) and torch.equal(serving.draft_head, trained.draft_head)
    assert (serving.d2t.data_ptr(), serving.draft_head.data_ptr()) == ptrs
    trained.set_draft_vocab(torch.arange(5, 25))  # rebuilt with another size
    serving.load_state_dict(trained.state_dict())
    assert serving.draft_vocab_size == 20
    trained.set_draft_vocab(None)
    serving.load_state_dict(trained.state_dict())
    assert serving.d2t is None and serving.draft_head is None


def test_draft_vocab_builder():
    dv = DraftVocab(10, 4, keep=[9])
    dv.update(torch.tensor([1, 1, 1, 2, 2, 3, 4, 4, 4, 4]))
    assert dv.build().tolist() == [9, 4, 1, 2]
    assert dv.coverage(dv.build()) == pytest.approx(9 / 10)
    decaying = DraftVocab(10, 2, decay=0.1)
    decaying.update(torch.tensor([5] * 10))
    decaying.update([torch.tensor([6, 6]), torch.tensor([7])])  # the policy moved: the new tokens win
    assert decaying.build().tolist() == [6, 5]
    other = DraftVocab(10, 2, decay=0.1)
    other.load_state_dict(decaying.state_dict())
    assert torch.equal(other.build(), decaying.build())
    for bad in (dict(size=0), dict(size=11), dict(size=2, keep=[1, 2, 3]), dict(size=2, decay=0.0)):
        with pytest.raises(ValueError):
            DraftVocab(10, **bad)


def test_trainer_rebuilds_the_draft_vocabulary_from_its_buffer():
    target, drafter = tiny_pair()
    g = torch.Generator().manual_seed(0)
    low = [torch.randint(0, 20, (12,), generator=g) for _ in range(3)]
    buf = DrafterBuffer(max_steps=1)
    buf.add(0, low, collect_hidden(target, low))
    trainer = DrafterTrainer(drafter, buf, batch_tokens=32, draft_vocab=24)
    trainer.step()
    assert drafter.draft_vocab_size == 24 and set(torch.cat(low).tolist()) <= set(drafter.d2t.tolist())
    first = drafter.d2t.clone()
    assert not trainer.refresh_vocab()  # nothing new in the buffer
    high = [torch.randint(70, 90, (12,), generator=g) for _ in range(3)]
    buf.add(1, high, collect_hidden(target, high))  # max_steps=1: the old step is evicted
    trainer.step()
    assert set(torch.cat(high).tolist()) <= set(drafter.d2t.tolist()) and not torch.equal(first, drafter.d2t)
    cfg = DrafterConfig(draft_vocab=16, unroll=2, loss_temperature=0.0, sampled_token_weight=0.3)
    t2 = DrafterTrainer.from_config(drafter, buf, cfg)
    assert (t2.vocab.size, t2.unroll, t2.temperature, t2.sampled_weight) == (16, 2, 0.0, 0.3)
    for bad in (dict(unroll=0), dict(loss_temperature=-1.0), dict(draft_vocab=-1)):
        with pytest.raises((ConfigError, ValueError)):
            DrafterConfig(**bad)


# ---- the perfect-drafter ceiling with the engine's own tree -----------------------------------------------


@pytest.fixture(scope="module")
def sharp_target():
    target, _ = tiny_pair("qwen2")
    target.double()
    with torch.no_grad():
        target.lm_head.weight.mul_(3)  # peaked enough that a top-2 tree hits often
    return target


def own_answers(target, temperature, lengths, prompt_len=5, seed=0):
    out = []
    for i, n in enumerate(lengths):
        g = torch.Generator().manual_seed(seed + i)
        ids = torch.randint(0, V, (prompt_len,), generator=g)
        with torch.no_grad():
            while ids.shape[0] < n:
                lg = target(ids[None]).logits[0, -1]
                if temperature == 0:
                    nxt = lg.argmax()
                else:
                    nxt = torch.multinomial(torch.softmax(lg / temperature, -1), 1, generator=g)[0]
                ids = torch.cat([ids, nxt.view(1)])
            out.append({"ids": ids, "hidden": target(ids[None]).hidden[0], "prompt_len": prompt_len})
    return out


def brute_accepts(target, s, temperature, depth, k, verify, vocab=None):
    """The same ceiling with every tree node's distribution from a dense forward over its whole path (over
    the ids of `vocab` only, when given)."""
    ids, n, out = s["ids"], s["ids"].shape[0] - 1, []
    scale = temperature if temperature > 0 else 1.0
    outside = torch.ones(V, dtype=torch.bool)
    if vocab is not None:
        outside[vocab] = False

    def logprobs(seq):
        lg = target(seq[None]).logits[0, -1].float()
        if vocab is not None:
            lg = lg.masked_fill(outside, float("-inf"))
        return torch.log_softmax(lg / scale, -1)

    for r in range(s["prompt_len"] - 1, n):
        c = Candidates.start(logprobs(ids[: r + 1])[None], k)
        for _ in range(depth - 1):
            front, dists = c.frontier(), []
            for j in range(k):
                path, node = [], int(front[0, j])
                while node >= 0:
                    path.append(int(c.tokens[0, node]))
                    node = int(c.parents[0, node])
                dists.append(logprobs(torch.cat([ids[: r + 1], torch.tensor(path[::-1])])))
            c = c.grow(front, torch.stack(dists)[None])
        tree = build_tree(c, ids[r : r + 1], torch.tensor([r + 1]), verify)
        node = a = 0
        while a < depth and r + 1 + a <= n:
            kids = [int(x) for x in tree.children[0, node] if x >= 0]
            hit = [x for x in kids if int(tree.tree_tokens[0, x]) == int(ids[r + 1 + a])]
            if not hit:
                break
            node, a = hit[0], a + 1
        out.append(a)
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_tree_ceiling_equals_a_brute_force_tree_and_the_chain_ceiling(sharp_target, temperature):
    samples = own_answers(sharp_target, temperature, (18, 23))
    with torch.no_grad():
        for s in samples:
            got = tree_accepts(sharp_target, s, temperature, 3, 2, 6, chunk=7)
            assert got == brute_accepts(sharp_target, s, temperature, 3, 2, 6)
            assert sum(got) > 0
    chain = oracle_tree_steps(sharp_target, samples, temperature, 4, 1, 5)
    assert chain == pytest.approx(oracle_steps(sharp_target, samples, temperature, 1, 4))
    assert oracle_tree_steps(sharp_target, samples, temperature, 4, 1, 5, chunk=3) == chain  # batching only
    # a smaller verify budget can only cut the tree: never more accepted at any root
    for s in samples:
        full, cut = (tree_accepts(sharp_target, s, temperature, 3, 2, v) for v in (7, 3))
        assert all(c <= f for c, f in zip(cut, full, strict=True)) and sum(cut) < sum(full)
    assert walk_steps([2, 0, 0, 1, 0]) == (3 + 2, 2)  # roots 0 and 3


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_tree_ceiling_over_a_reduced_vocabulary(sharp_target, temperature):
    samples = own_answers(sharp_target, temperature, (18, 23))
    used = torch.unique(torch.cat([s["ids"] for s in samples]))
    g = torch.Generator().manual_seed(3)
    # half the answers' ids and a few others: some drafted tokens are now out of reach, others rank higher
    vocab = torch.cat([used[torch.randperm(used.numel(), generator=g)[: used.numel() // 2]], torch.arange(4)])
    vocab = torch.unique(vocab)
    with torch.no_grad():
        for s in samples:
            got = tree_accepts(sharp_target, s, temperature, 3, 2, 6, chunk=7, vocab=vocab)
            assert got == brute_accepts(sharp_target, s, temperature, 3, 2, 6, vocab)
            assert tree_accepts(sharp_target, s, temperature, 3, 2, 6, vocab=torch.arange(V)) == tree_accepts(
                sharp_target, s, temperature, 3, 2, 6
            )
    full = oracle_tree_steps(sharp_target, samples, temperature, 3, 2, 6)
    cut = oracle_tree_steps(sharp_target, samples, temperature, 3, 2, 6, vocab=vocab)
    assert 1.0 <= cut < full
    # the chain ceiling likewise: nothing the vocabulary leaves out is ever accepted
    unused = torch.tensor([i for i in range(V) if i not in set(used.tolist())])
    assert oracle_steps(sharp_target, samples, temperature, 2, 4, vocab=unused) == 1.0
    assert oracle_steps(sharp_target, samples, temperature, 2, 4, vocab=torch.arange(V)) == oracle_steps(
        sharp_target, samples, temperature, 2, 4
    )
