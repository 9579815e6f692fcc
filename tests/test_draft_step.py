"""The fixed-shape draft step: catch-up block, candidates, the graph program's padding, the engine's windows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers.engine import PROMPTS, TINY, make_engine, tiny_pair
from tlt_rt.codegen.backend import TritonAttention, triton_usable
from tlt_rt.codegen.draft import DraftInputs, catch_up_block, draft_tree, grow_candidates
from tlt_rt.ir.strategy import Strategy
from tlt_rt.ir.tree import TREE_FIELDS, build_tree
from tlt_rt.models.attention import TorchAttention
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.llama import CausalLM
from tlt_rt.rollout import SamplingParams
from tlt_rt.rollout.sequence import Sequence
from tlt_rt.rollout.step.drafting import DrafterRunner
from tlt_rt.rollout.step.target import table_tensor

STRATEGY = Strategy(3, 2, 5)  # R = 4 catch-up rows
BLOCKS, BLOCK_SIZE, PER_SEQ = 80, 4, 8  # sequence i owns blocks [8i, 8i+8)


def _drafter():
    target, drafter = tiny_pair(0, 4.0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.1)
    return target, drafter


def _batch(target, cases):
    """cases: (L, rows the drafter has cached) per sequence; tokens random, hidden from the dense target."""
    gen = torch.Generator().manual_seed(3)
    seqs, tables = [], []
    for i, (L, cached) in enumerate(cases):
        toks = torch.randint(0, 12, (L + 1,), generator=gen).tolist()
        with torch.no_grad():
            h = target(torch.tensor([toks[:L]])).hidden[0]
        seqs.append(Sequence(i, i, 0, toks[:1], 0, 64, output=toks[1:], num_cached=L, hidden_chunks=[h]))
        seqs[-1].draft_cached = cached
        tables.append(list(range(i * PER_SEQ, (i + 1) * PER_SEQ)))
    return seqs, tables


def _runner(drafter, seqs, tables):
    """A drafter cache holding rows [0, draft_cached) of every sequence, as earlier steps left it."""
    runner = DrafterRunner(drafter, BLOCKS, BLOCK_SIZE)
    behind = [i for i, s in enumerate(seqs) if s.draft_cached > 0]
    if behind:
        ends = [seqs[i].draft_cached for i in behind]
        for i in behind:
            seqs[i].draft_cached = 0
        runner.catch_up([seqs[i] for i in behind], [tables[i] for i in behind], ends=ends)
    return runner


def _old_draft(drafter, seqs, tables, strategy, levels=True):
    """The eager path the block replaces: rows [draft_cached, L) as one prefill, levels from its last rows."""
    runner = _runner(drafter, seqs, tables)
    logits, hidden = runner.catch_up(seqs, tables)
    if not levels:
        return runner, logits, hidden, None
    b, r = len(seqs), strategy.depth + 1
    lens = torch.tensor([s.num_cached for s in seqs])
    ins = DraftInputs(torch.zeros(b, r, dtype=torch.long), None, lens.clamp(max=r), lens, table_tensor(tables, "cpu"))
    with torch.no_grad():
        cands = grow_candidates(drafter, runner.cache, strategy, BLOCK_SIZE, ins, logits, hidden)
    return runner, logits, hidden, cands


# after steps that accepted 0, 1 and 3 tokens; two prompts shorter than R; one long sequence caught up exactly
MIXED = [(13, 12), (9, 7), (17, 13), (1, 0), (2, 0), (6, 2)]


def _copies(target, cases):
    return _batch(target, cases), _batch(target, cases)


def test_block_equals_eager_catch_up_with_mixed_accepted_lengths():
    target, drafter = _drafter()
    (old_seqs, tables), (new_seqs, _) = _copies(target, MIXED)
    old_runner, old_logits, old_hidden, _ = _old_draft(drafter, old_seqs, tables, STRATEGY, levels=False)
    new_runner = _runner(drafter, new_seqs, tables)
    ins = new_runner.inputs(new_seqs, tables, table_tensor(tables, "cpu"), STRATEGY)
    assert ins.valid.tolist() == [4, 4, 4, 1, 2, 4]
    with torch.no_grad():
        logits, hidden = catch_up_block(drafter, new_runner.cache, ins, BLOCK_SIZE)
    torch.testing.assert_close(logits, old_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, old_hidden, atol=1e-5, rtol=1e-5)
    # the same drafter rows are cached, and nothing else was written (the trash block aside)
    for new, old in ((new_runner.cache.k, old_runner.cache.k), (new_runner.cache.v, old_runner.cache.v)):
        torch.testing.assert_close(new[:, :-1], old[:, :-1], atol=1e-5, rtol=1e-5)
    assert [s.draft_cached for s in new_seqs] == [L for L, _ in MIXED]


def test_draft_gives_the_candidates_of_the_eager_path():
    # MIXED plus sequences further behind than R: speculation switched on after plain decoding
    cases = [*MIXED, (15, 0), (11, 5)]
    target, drafter = _drafter()
    (old_seqs, tables), (new_seqs, _) = _copies(target, cases)
    *_, old = _old_draft(drafter, old_seqs, tables, STRATEGY)
    new_runner = _runner(drafter, new_seqs, tables)
    new = new_runner.draft(new_seqs, tables, table_tensor(tables, "cpu"), STRATEGY)
    assert torch.equal(new.tokens, old.tokens) and torch.equal(new.parents, old.parents)
    torch.testing.assert_close(new.scores, old.scores, atol=1e-4, rtol=1e-5)


def test_shallow_step_after_a_deep_one_runs_the_deepest_block_without_eager_catch_up(monkeypatch):
    """An engine with a depth-8 strategy keeps 9-row blocks for every strategy: after a deep step accepted 8
    or 9 tokens, a depth-3 step still covers the unseen rows in its block (no eager catch-up), and drafts
    the candidates of the eager path."""
    cases = [(20, 12), (15, 6), (9, 7), (2, 0)]  # 8 and 9 rows behind, then within R = 4, then short
    target, drafter = _drafter()
    (old_seqs, tables), (new_seqs, _) = _copies(target, cases)
    *_, old = _old_draft(drafter, old_seqs, tables, STRATEGY)
    new_runner = _runner(drafter, new_seqs, tables)
    new_runner.window_rows = 9
    assert new_runner.block_rows(STRATEGY) == 9 and new_runner.block_rows(Strategy(8, 4, 16)) == 9
    eager = []
    monkeypatch.setattr(new_runner, "catch_up", lambda *a, **k: eager.append(a))
    ins = new_runner.inputs(new_seqs, tables, table_tensor(tables, "cpu"), STRATEGY)
    assert ins.tokens.shape == (4, 9) and ins.hidden.shape[:2] == (4, 9)
    assert ins.valid.tolist() == [9, 9, 9, 2] and eager == []
    with torch.no_grad():
        new = draft_tree(drafter, new_runner.cache, STRATEGY, BLOCK_SIZE, ins)
    ref = build_tree(old, torch.tensor([s.tokens[-1] for s in old_seqs]),
                     torch.tensor([s.num_cached for s in old_seqs]), STRATEGY.verify_tokens)  # fmt: skip
    for name in TREE_FIELDS:
        assert torch.equal(getattr(new, name), getattr(ref, name)), name


@pytest.mark.parametrize("speculative", ["on", "auto"])
def test_engine_windows_are_the_last_target_hidden_rows(speculative):
    """The windows the SD step moves on, on the device, equal the target hidden rows the sequence keeps: the
    last step's as they are, gathered for a batch that lost sequences, or rebuilt from the history; in auto
    mode, moved on by the plain steps in between (SD, SD, plain, plain, SD, plain, ...). Every SD step is packed
    on the host here (none queued behind another: those take their windows from the step before on the device,
    tests/test_overlap.py)."""
    eng = make_engine(speculative, ("3_3_8", "4_2_6"), overlap_speculative=False)
    runner = eng.drafter_runner
    assert runner.window_rows == 5 + (speculative == "auto")
    prepare, reused, shrunk, after_plain = runner.prepare, [], [], []
    options = []

    def checked(seqs, tables, rows):
        runner.settle_windows()  # the plain steps' rows since the last step (prepare's own settle then has none)
        recent = runner._recent
        window = prepare(seqs, tables, rows)
        reused.append(recent is not None and window is recent[1])
        # the last step's batch less those that finished: the survivors' windows gathered from the last step's
        shrunk.append(recent is not None and {s.seq_id for s in seqs} < set(recent[0]))
        after_plain.append(len(options) > 1 and options[-2] is None)
        for s, w in zip(seqs, window, strict=True):
            L = s.num_cached
            rows_ = s.hidden()[max(0, L - w.shape[0]) : L]
            assert torch.equal(w[w.shape[0] - rows_.shape[0] :], rows_)
            assert not w[: w.shape[0] - rows_.shape[0]].any()
        return window

    runner.prepare = checked
    if speculative == "auto":
        strategy, calls = eng.strategies[1], iter(range(10_000))

        def scripted(batch, behind=0):
            options.append(None if next(calls) % 5 in (2, 3) else strategy)
            return options[-1]

        eng.policy.decide = scripted
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=24, stop_token_ids=[])
    outs = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in make_engine("off").generate(PROMPTS, params)]
    assert eng.stats()["sd_steps"] == len(reused) > 0
    assert any(reused) and any(shrunk)
    if speculative == "auto":  # moved by the plain steps: after them no history is read
        assert any(after_plain)
        assert all(r or sh for r, sh, a in zip(reused, shrunk, after_plain, strict=True) if a)


@pytest.mark.parametrize("plain", [1, 3, 8])
def test_plain_steps_leave_the_window_move_to_the_next_speculative_step(plain):
    """In auto mode a plain step moves no window: it notes its hidden rows, and only the first plain step over a
    batch (after a speculative step, a finish) looks at the windows. The next speculative step moves them by
    every plain step's rows at once (stretches shorter and longer than the window), as the rows the sequences
    keep say, and reads no history where the batch stayed the same. (One step at a time: the steps are counted
    where `runner.step` runs them.)"""
    eng = make_engine("auto", ("3_3_8", "4_2_6"), overlap=False)
    runner, strategy = eng.drafter_runner, eng.strategies[1]
    assert runner.window_rows == 6
    options, batches, work = [], [], []

    def scripted(batch, behind=0):
        options.append(None if len(options) % (plain + 1) else strategy)
        return options[-1]

    eng.policy.decide = scripted
    step, current, prepare, window = eng.runner.step, runner._current_windows, runner.prepare, runner._window

    def step_(seqs, *a, **k):
        batches.append([s.seq_id for s in seqs])
        return step(seqs, *a, **k)

    def current_(*a, **k):
        work.append(len(batches) - 1)  # the step it ran in
        return current(*a, **k)

    def prepare_(seqs, tables, rows):
        w = prepare(seqs, tables, rows)
        for s, x in zip(seqs, w, strict=True):
            L = s.num_cached
            rows_ = s.hidden()[max(0, L - x.shape[0]) : L]
            assert torch.equal(x[x.shape[0] - rows_.shape[0] :], rows_) and not x[: x.shape[0] - rows_.shape[0]].any()
        return w

    history = []
    eng.runner.step, runner._current_windows, runner.prepare = step_, current_, prepare_
    runner._window = lambda *a, **k: (history.append(len(batches) - 1), window(*a, **k))[1]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=24, stop_token_ids=[])
    outs = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in make_engine("off").generate(PROMPTS, params)]
    firsts = {
        i for i in range(1, len(batches)) if options[i] is None and (options[i - 1] or batches[i] != batches[i - 1])
    }
    plain_steps = [i for i, o in enumerate(options) if o is None]
    assert len(firsts) > 0 and (plain == 1 or len(plain_steps) > len(firsts))
    assert {i for i in work if options[i] is None} <= firsts  # the other plain steps touched no window
    # a speculative step after a stretch over one batch (since the speculative step before) reads no history
    clean = [i for i in range(plain + 1, len(batches)) if options[i] and batches[i - plain - 1] == batches[i]]
    assert clean and not set(history) & set(clean)


def test_sequence_hidden_chunks_merge_and_tail_tokens():
    s = Sequence(1, 0, 0, [1, 2, 3], 0, 64)
    rows = torch.randn(100, 4)
    s.add_hidden(rows[:3])
    for i in range(3, 100):
        s.add_hidden(rows[i : i + 1])
    assert len(s.hidden_chunks) < 40
    assert torch.equal(s.hidden(), rows)
    s.output = [4, 5]
    assert s.last_tokens(3) == [3, 4, 5] and s.last_tokens(7) == [0, 0, 1, 2, 3, 4, 5] and s.last_tokens(1) == [5]


def test_triton_draft_equals_torch_draft():
    """The whole draft step with the Triton tree kernel (wide drafter windows included; interpreted without
    CUDA) gives the tree of the torch reference."""
    if not triton_usable("cpu"):
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    arch = replace(TINY, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(0)
    target = CausalLM(arch).eval()
    drafter = Drafter(arch, target).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.1)
    (a_seqs, tables), (b_seqs, _) = _copies(target, [(13, 12), (2, 0), (21, 18)])
    trees = []
    for backend, seqs in ((TorchAttention(), a_seqs), (TritonAttention(num_splits=2), b_seqs)):
        drafter.attn_backend = backend
        runner = _runner(drafter, seqs, tables)
        ins = runner.inputs(seqs, tables, table_tensor(tables, "cpu"), Strategy(4, 3, 9))
        with torch.no_grad():
            trees.append(draft_tree(drafter, runner.cache, Strategy(4, 3, 9), BLOCK_SIZE, ins))
    for name in TREE_FIELDS:
        assert torch.equal(getattr(trees[0], name), getattr(trees[1], name)), name


def test_captured_path_builds_the_same_tree():
    """The captured step's path (`compiled`: the rerank through the codegen table's build_tree kernel, one
    Triton launch on CUDA and `build_tree` here; the kernel itself is checked against `build_tree` in
    test_kernel_build_tree.py) grows the candidates of the eager path and the same tree."""
    from tlt_rt.codegen.draft import rerank

    target, drafter = _drafter()
    (seqs, tables), (seqs2, _) = _copies(target, MIXED)
    _, logits, hidden, want = _old_draft(drafter, seqs, tables, STRATEGY)
    runner = _runner(drafter, seqs2, tables)
    logits2, hidden2 = runner.catch_up(seqs2, tables)
    b, r = len(seqs2), STRATEGY.depth + 1
    lens = torch.tensor([s.num_cached for s in seqs2])
    ins = DraftInputs(torch.zeros(b, r, dtype=torch.long), None, lens.clamp(max=r), lens, table_tensor(tables, "cpu"))
    with torch.no_grad():
        got = grow_candidates(drafter, runner.cache, STRATEGY, BLOCK_SIZE, ins, logits2, hidden2, compiled=True)
        tree = rerank(got, lens, lens, STRATEGY.verify_tokens, compiled=True)
    for name in ("tokens", "parents"):
        assert torch.equal(getattr(got, name), getattr(want, name))
    torch.testing.assert_close(got.scores, want.scores)
    ref = build_tree(want, lens, lens, STRATEGY.verify_tokens)
    for name in TREE_FIELDS:
        assert torch.equal(getattr(tree, name), getattr(ref, name)), name
