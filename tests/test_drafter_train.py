"""Drafter training: buffer and packing, the loss, the preemptible trainer and its checkpoints."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.drafter import V, tiny_arch
from tlt_rt.config import ConfigError, DrafterConfig
from tlt_rt.models import CausalLM
from tlt_rt.models.drafter import Drafter
from tlt_rt.train.drafter.data import DrafterBatch, DrafterBuffer, _Step, collect_hidden
from tlt_rt.train.drafter.loss import TOP1_ROWS, add_noise, batch_loss, drafter_loss, full_vocab_top1, metric_rows
from tlt_rt.train.drafter.trainer import DrafterTrainer, scheduled_lr


def tiny_pair(drafter_seed: int = 0) -> tuple[CausalLM, Drafter]:
    """The same random target every time; the drafter's initial weights from `drafter_seed`."""
    torch.manual_seed(0)
    arch = tiny_arch()
    target = CausalLM(arch).eval()
    with torch.no_grad():
        for p in target.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    torch.manual_seed(drafter_seed)
    return target, Drafter(arch, target)


def sequences(n: int, lo: int, hi: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # repeated short patterns, so that there is something to learn
    pats = torch.randint(0, V, (3, 5), generator=g)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        k = int(torch.randint(0, 3, (1,), generator=g))
        out.append(pats[k].repeat(hi // 5 + 1)[:length])
    return out


def fake_samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, V, (n,), generator=g) for n in lengths]
    hid = [torch.randn(n, 8, generator=g) for n in lengths]
    return ids, hid


def test_buffer_evicts_old_steps_and_stores_tensors_only():
    buf = DrafterBuffer(max_steps=2)
    for step in range(5):
        buf.add(step, *fake_samples([5, 7, 1], seed=step))  # the 1-token sample holds no training row
    assert buf.steps == [3, 4] and buf.num_samples == 4 and buf.num_tokens == 24
    buf.add(4, *fake_samples([3]))  # more of the newest step
    assert buf.steps == [3, 4] and buf.num_samples == 5
    for s in buf._steps:
        assert isinstance(s, _Step)
        assert all(isinstance(v, torch.Tensor) for k, v in vars(s).items() if k != "step")
    small = DrafterBuffer(max_steps=10, max_tokens=20)
    for step in range(3):
        small.add(step, *fake_samples([6, 6], seed=step))
    assert small.steps == [2] and small.num_tokens == 12
    with pytest.warns(UserWarning, match="exceeds max_tokens"):
        small.add(3, *fake_samples([9, 9, 9]))
    assert small.num_tokens == 18 and small.num_samples == 2
    with pytest.raises(ValueError, match="older"):
        small.add(1, *fake_samples([4]))
    with pytest.raises(ValueError, match=r"sample 0"):
        small.add(5, [torch.zeros(4, dtype=torch.long)], [torch.zeros(3, 8)])
    with pytest.raises(RuntimeError, match="empty"):
        DrafterBuffer().next_batch(16)


def _row_check(batch: DrafterBatch, ids_list, hid_list) -> list[tuple[int, int]]:
    """Every real row is (x_{t+1}, h_t) -> h_{t+1} of some sample k at position t; returns the (k, t) in order."""
    seg, mask, found = batch.segment_ids, batch.loss_mask, []
    for r in range(seg.shape[0]):
        for j in range(seg.shape[1]):
            if not mask[r, j]:
                continue
            t = int(batch.positions[r, j])
            hits = [k for k, h in enumerate(hid_list) if t + 1 < h.shape[0] and torch.equal(h[t], batch.hidden[r, j])]
            assert hits, "row does not come from any sample"
            k = hits[0]
            assert batch.input_ids[r, j] == ids_list[k][t + 1]
            assert torch.equal(batch.target_hidden[r, j], hid_list[k][t + 1])
            found.append((k, t))
    return found


def test_packing_layout_and_one_epoch_covers_every_row():
    lengths = [4, 9, 2, 30, 6, 11]
    ids, hid = fake_samples(lengths)
    buf = DrafterBuffer(seed=3)
    buf.add(0, ids, hid)
    total_rows, seen = sum(n - 1 for n in lengths), []
    while len(seen) < total_rows:
        b = buf.next_batch(16)
        assert b.input_ids.shape[0] == 1 and b.input_ids.shape[1] <= 16 and bool(b.loss_mask.all())
        seen += _row_check(b, ids, hid)
        seg = b.segment_ids[0]
        starts = torch.nonzero(torch.diff(seg, prepend=seg[:1] - 1)).flatten()
        assert torch.equal(b.cu_seqlens[:-1].long(), starts) and int(b.cu_seqlens[-1]) == seg.numel()
        for s, e in zip(b.cu_seqlens[:-1].tolist(), b.cu_seqlens[1:].tolist(), strict=True):
            p = b.positions[0, s:e]
            assert torch.equal(p, torch.arange(int(p[0]), int(p[0]) + e - s))  # consecutive within a piece
    # one epoch visits every row exactly once (the 30-token sample in chunks), then the next epoch begins
    assert sorted(seen[:total_rows]) == [(k, t) for k, n in enumerate(lengths) for t in range(n - 1)]
    unpacked = buf.next_batch(40, packed=False)
    assert unpacked.input_ids.shape[0] * unpacked.input_ids.shape[1] <= 40
    assert unpacked.input_ids.shape[0] > 1 and not bool(unpacked.loss_mask.all())
    assert bool((unpacked.segment_ids[~unpacked.loss_mask] == -1).all())
    _row_check(unpacked, ids, hid)


def test_cursor_state_round_trip_repeats_batches():
    ids, hid = fake_samples([5, 8, 3, 12, 7, 4, 9])
    a, b = DrafterBuffer(seed=1), DrafterBuffer(seed=1)
    a.add(0, ids, hid), b.add(0, ids, hid)
    for _ in range(3):
        a.next_batch(10)
    state = a.state_dict()
    b.load_state_dict(state)
    for _ in range(6):  # crosses an epoch boundary
        x, y = a.next_batch(10), b.next_batch(10)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.hidden, y.hidden)


def test_collect_hidden_matches_each_sequence_alone():
    target, _ = tiny_pair()
    seqs = sequences(5, 3, 17, seed=1)
    got = collect_hidden(target, seqs, max_batch_tokens=40)
    for s, h in zip(seqs, got, strict=True):
        with torch.no_grad():
            torch.testing.assert_close(h, target(s[None]).hidden[0], atol=1e-4, rtol=1e-4)


def test_loss_ignores_padding_and_packing_equals_per_sample_mean():
    target, drafter = tiny_pair()
    seqs = sequences(4, 6, 15, seed=2)
    hid = collect_hidden(target, seqs)
    buf = DrafterBuffer()
    buf.add(0, seqs, hid)
    rows = [s.shape[0] - 1 for s in seqs]
    with torch.no_grad():
        pb = buf.next_batch(sum(rows))  # exactly one epoch
        ub = buf.next_batch(len(rows) * max(rows), packed=False)
        # what the batch knows on the host (no device sync to read it) is what its tensors say, moved or not
        for b, shared in ((pb, True), (ub, False)):
            seg = b.segment_ids
            looked = bool(((seg[:, 1:] != seg[:, :-1]) & (seg[:, 1:] >= 0)).any())
            assert b.tokens == int(b.loss_mask.sum()) == sum(rows) and b.shared_rows is looked is shared
            moved = b.to("cpu")
            assert (moved.tokens, moved.shared_rows) == (b.tokens, b.shared_rows)
        packed = batch_loss(drafter, pb)
        assert packed.num_tokens == sum(rows)
        unpacked = batch_loss(drafter, ub)
        assert unpacked.num_tokens == sum(rows)
        # a batch built elsewhere, without the host facts, counts and looks instead: the same loss
        bare = DrafterBatch(pb.input_ids, pb.hidden, pb.target_hidden, pb.positions, pb.segment_ids, pb.loss_mask,
                            pb.cu_seqlens)  # fmt: skip
        again = batch_loss(drafter, bare)
        assert again.num_tokens == sum(rows) and torch.equal(again.loss, packed.loss)
        torch.testing.assert_close(packed.loss, unpacked.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed.top1, unpacked.top1)
        each = []
        for s, h in zip(seqs, hid, strict=True):
            one = DrafterBuffer()
            one.add(0, [s], [h])
            each.append(batch_loss(drafter, one.next_batch(s.shape[0] - 1)))
        mean = sum(o.loss * o.num_tokens for o in each) / sum(o.num_tokens for o in each)
        torch.testing.assert_close(packed.loss, mean, atol=1e-5, rtol=1e-5)
    # the loss itself: padding rows never count, weights are applied as given
    ph, th = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    pl, tl = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    a = drafter_loss(ph, pl, th, tl, mask)
    ph2 = ph.clone()
    ph2[0, 3:] += 100.0
    b = drafter_loss(ph2, pl, th, tl, mask)
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.loss, 1.0 * a.hidden_loss + 0.1 * a.token_loss)
    want = ((pl.argmax(-1) == tl.argmax(-1)) & mask).sum() / mask.sum()
    torch.testing.assert_close(a.top1, want.float())
    same = drafter_loss(th, tl, th, tl, mask)
    assert float(same.hidden_loss) == 0.0 and float(same.top1) == 1.0
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert torch.equal(add_noise(th, 0.1, g1), add_noise(th, 0.1, g2)) and add_noise(th, 0.0) is th


def test_reduced_vocab_top1_takes_the_targets_full_argmax_at_its_loss_rows():
    target, drafter = tiny_pair()
    drafter.set_draft_vocab(torch.arange(0, V, 2))
    seqs = sequences(6, 10, 30, seed=4)
    buf = DrafterBuffer()
    buf.add(0, seqs, collect_hidden(target, seqs))
    batch = buf.next_batch(6 * 30, packed=False)  # one row a sample, padded: loss rows and others
    mask = batch.loss_mask
    with torch.no_grad():
        feat = drafter.features(batch.target_hidden)
        full = F.linear(feat, drafter.lm_head.weight).argmax(-1)  # the target's argmax over all V ids
        drafted = drafter.to_target_ids(drafter(batch.input_ids, drafter.features(batch.hidden), batch.positions,
                                                batch.segment_ids).logits.argmax(-1))  # fmt: skip
        # a batch of no more than TOP1_ROWS positions: the agreement over every loss row, exactly
        assert mask.numel() <= TOP1_ROWS and not bool(mask.all())
        want = ((drafted == full) & mask).sum() / mask.sum()
        torch.testing.assert_close(batch_loss(drafter, batch).top1, want.float())
        # more positions than rows: `rows` distinct positions, all loss rows, spread over the batch
        idx = metric_rows(mask, 7)
        assert len(set(idx.tolist())) == 7 and bool(mask.flatten()[idx].all())
        assert len({i // mask.shape[1] for i in idx.tolist()}) > 1 or mask.shape[0] == 1
        assert sorted(idx.tolist()) != list(range(7))  # not simply the first seven
        top = full_vocab_top1(drafter, feat, mask, rows=7)
        assert int((top >= 0).sum()) == 7 and torch.equal(top.view(-1)[idx], full.view(-1)[idx])
        # fewer loss rows than asked: every loss row is taken, the rest pad the count
        few = torch.zeros_like(mask)
        few.view(-1)[[3, 17, 40]] = True
        assert set(metric_rows(few, 5).tolist()) >= {3, 17, 40}
        out = drafter_loss(feat, feat @ drafter.lm_head.weight.T, feat, feat @ drafter.lm_head.weight.T, few,
                           target_top1=full_vocab_top1(drafter, feat, few, rows=5))  # fmt: skip
        assert float(out.top1) == 1.0  # the same argmax on the three rows; unchecked rows never count


def _trainer(drafter_seed=0, **kw) -> tuple[DrafterTrainer, DrafterBuffer]:
    target, drafter = tiny_pair(drafter_seed)
    seqs = sequences(12, 10, 30, seed=3)
    buf = DrafterBuffer(seed=5)
    buf.add(0, seqs, collect_hidden(target, seqs))
    return DrafterTrainer(drafter, buf, **{"lr": 5e-3, "batch_tokens": 96, **kw}), buf


def test_training_reduces_the_loss_on_fixed_data():
    trainer, buf = _trainer()
    eval_batch = DrafterBuffer(seed=9)
    eval_batch._steps = buf._steps
    eval_batch._refresh_order()
    fixed = eval_batch.next_batch(400)
    with torch.no_grad():
        before = batch_loss(trainer.drafter, fixed)
    seen = []
    summary = trainer.train(lambda: False, max_steps=12, after_step=lambda m: seen.append(m["step"]))
    with torch.no_grad():
        after = batch_loss(trainer.drafter, fixed)
    assert summary["steps"] == 12 and trainer.steps == 12 and not summary["stopped"]
    assert seen == [float(i) for i in range(1, 13)]  # after_step sees every step's metrics, in order
    # the token loss is bounded below by the target's entropy; the feature loss and agreement move a lot
    assert float(after.loss) < float(before.loss) and float(after.hidden_loss) < 0.5 * float(before.hidden_loss)
    assert float(after.top1) > float(before.top1) + 0.3
    assert summary["tokens_per_s"] > 0 and summary["tokens"] > 0


def test_stop_flag_is_honoured_between_micro_steps():
    trainer, buf = _trainer(grad_accum=3)
    stop = threading.Event()
    stop.set()
    assert trainer.train(stop)["steps"] == 0
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    cursor = buf.state_dict()
    checks = iter([False, False, True])  # stop after two of the three micro-steps
    out = trainer.train(lambda: next(checks), max_steps=5)
    assert out["steps"] == 0 and out["stopped"] and trainer.steps == 0
    assert all(torch.equal(v, trainer.drafter.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in trainer.drafter.parameters())
    after = buf.state_dict()  # the undone step's data comes again
    assert torch.equal(after.pop("perm"), cursor.pop("perm")) and after == cursor
    m = trainer.step()
    assert trainer.steps == 1 and set(m) >= {"loss", "hidden_loss", "token_loss", "top1", "tokens_per_s"}


def test_micro_batched_steps_equal_accumulated_ones_and_a_stop_keeps_the_micro_batches_done():
    """train(micro_tokens=m) draws a step's batch_tokens as m-token micro-batches: the same step as grad_accum
    whole batches of m tokens. A stop after some of them applies the step on those (the mean over their
    tokens: the same step as accumulating just those) and consumes their data; a stop before the first undoes."""

    def grads_at_step(trainer, **kw):
        seen = {}
        step = trainer.optimizer.step

        def spy(*a, **k):
            seen.update({n: p.grad.clone() for n, p in trainer.drafter.named_parameters() if p.grad is not None})
            return step(*a, **k)

        trainer.optimizer.step = spy
        out = trainer.train(**kw)
        trainer.optimizer.step = step
        return out, seen

    def same(a, b):
        return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a) and a.keys() == b.keys()

    ref, _ = _trainer(batch_tokens=32, grad_accum=3)
    want, want_g = grads_at_step(ref, stop=lambda: False, max_steps=1)
    micro, _ = _trainer(batch_tokens=96)
    got, got_g = grads_at_step(micro, stop=lambda: False, max_steps=1, micro_tokens=32)
    assert got["steps"] == 1 and not got["stopped"] and got["tokens"] == want["tokens"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and same(want_g, got_g)

    ref2, ref_buf = _trainer(batch_tokens=32, grad_accum=2)
    want, want_g = grads_at_step(ref2, stop=lambda: False, max_steps=1)
    cut, cut_buf = _trainer(batch_tokens=96)
    checks = iter([False, False, True])  # the rollout ends after two of the three micro-batches
    got, got_g = grads_at_step(cut, stop=lambda: next(checks), max_steps=5, micro_tokens=32)
    assert got["steps"] == 1 and got["stopped"] and cut.steps == 1 and got["tokens"] == want["tokens"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and same(want_g, got_g)
    a, b = cut_buf.state_dict(), ref_buf.state_dict()  # the two micro-batches' data is consumed, no more
    assert torch.equal(a.pop("perm"), b.pop("perm")) and a == b

    before = {k: v.clone() for k, v in cut.drafter.state_dict().items()}
    cursor = cut_buf.state_dict()
    out = cut.train(lambda: True, micro_tokens=32)  # stopped before the first micro-batch: nothing happens
    assert out["steps"] == 0 and out["stopped"] and cut.steps == 1
    assert all(torch.equal(v, cut.drafter.state_dict()[k]) for k, v in before.items())
    after = cut_buf.state_dict()
    assert torch.equal(after.pop("perm"), cursor.pop("perm")) and after == cursor


def test_checkpoint_round_trip_resumes_the_identical_next_step(tmp_path):
    trainer, _ = _trainer(noise_std=0.05)
    trainer.drafter.set_draft_vocab(torch.arange(0, V, 2))
    trainer.train(lambda: False, max_steps=3)
    trainer.save_checkpoint(tmp_path / "ckpt", async_=True)
    trainer.wait()
    want = trainer.step()
    fresh, _ = _trainer(drafter_seed=1, noise_std=0.05)  # other initial weights: all must come from the checkpoint
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert fresh.steps == 3 and torch.equal(fresh.drafter.d2t, trainer.drafter.d2t)
    got = fresh.step()
    for k in ("loss", "hidden_loss", "token_loss", "top1", "tokens"):
        assert got[k] == want[k], k
    for k, v in trainer.drafter.state_dict().items():
        assert torch.equal(v, fresh.drafter.state_dict()[k]), k
    with pytest.raises(FileNotFoundError):
        fresh.load_checkpoint(tmp_path / "nope")


def test_from_config():
    target, drafter = tiny_pair()
    buf = DrafterBuffer()
    t = DrafterTrainer.from_config(drafter, buf, DrafterConfig(lr=2e-4, batch_tokens=64, noise_std=0.1))
    assert t.batch_tokens == 64 and t.noise_std == 0.1 and t.optimizer.param_groups[0]["lr"] == 2e-4
    assert {id(p) for g in t.optimizer.param_groups for p in g["params"]} == {id(p) for p in drafter.parameters()}


def test_cosine_schedule_rises_falls_and_resumes(tmp_path):
    cfg = DrafterConfig(lr=1e-3, lr_schedule="cosine", lr_warmup_steps=4, lr_total_steps=15, lr_min_ratio=0.1)
    lrs = [scheduled_lr(cfg, s) for s in range(20)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # linear rise to the peak
    assert lrs[4] == pytest.approx(1e-3) and lrs[14] == pytest.approx(1e-4)  # cosine from the peak to a tenth
    assert lrs[9] == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # its midpoint
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False)) and lrs[19] == pytest.approx(1e-4)
    assert scheduled_lr(DrafterConfig(lr=3e-4), 10_000) == 3e-4  # constant: online training's open length
    for bad in (dict(lr_schedule="cosine"), dict(lr_schedule="cosine", lr_total_steps=4, lr_warmup_steps=4),
                dict(lr_min_ratio=1.5), dict(lr_warmup_steps=-1), dict(lr_schedule="linear")):  # fmt: skip
        with pytest.raises(ConfigError):
            DrafterConfig(**bad)
    # the optimizer steps with the scheduled rate, and a resumed trainer goes on where the schedule was
    kw = dict(lr=1e-3, lr_schedule="cosine", lr_warmup_steps=2, lr_total_steps=6)
    trainer, _ = _trainer(**kw)
    seen = [trainer.step()["lr"] for _ in range(3)]
    assert seen == pytest.approx([scheduled_lr(trainer.config, s) for s in range(3)])
    trainer.save_checkpoint(tmp_path / "ckpt", async_=False)
    want = trainer.step()
    fresh, _ = _trainer(**kw)
    fresh.load_checkpoint(tmp_path / "ckpt")
    got = fresh.step()
    assert got["lr"] == want["lr"] == pytest.approx(scheduled_lr(trainer.config, 3)) and got["loss"] == want["loss"]


@pytest.mark.gpu
def test_training_and_checkpoint_resume_on_cuda(tmp_path):
    """bf16 target (shared modules), fp32 drafter, fused AdamW, generator on the GPU."""

    def build(drafter_seed: int) -> DrafterTrainer:
        target, drafter = tiny_pair(drafter_seed)
        target.to("cuda", torch.bfloat16)
        drafter.to("cuda")
        seqs = sequences(12, 10, 30, seed=3)
        buf = DrafterBuffer(seed=5, device="cuda")
        buf.add(0, seqs, collect_hidden(target, seqs))
        return DrafterTrainer(drafter, buf, lr=3e-3, batch_tokens=96, noise_std=0.05)

    trainer = build(0)
    first = trainer.train(lambda: False, max_steps=20)
    assert first["steps"] == 20 and first["top1"] > 0
    trainer.save_checkpoint(tmp_path / "ckpt")
    trainer.wait()
    want = trainer.step()
    fresh = build(1)
    fresh.load_checkpoint(tmp_path / "ckpt")
    got = fresh.step()
    for k in ("loss", "hidden_loss", "token_loss", "top1", "tokens"):
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
