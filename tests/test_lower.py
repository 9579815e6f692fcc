"""Lowering a StepProgram: pass order, errors, a plain-decode program and a first draw run end to end, and a
speculative program lowered node by node drafting what the whole-draft functions draft."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import make_engine
from tlt_rt.codegen.lower import StepModels, lower
from tlt_rt.ir import Bucket, StepProgram, Strategy
from tlt_rt.ir.program import Op
from tlt_rt.ir.tree import TREE_FIELDS


def _bucket(strategy, b=2):
    return Bucket(b, strategy, 8, 4, 12, 32)


def test_calls_follow_the_program():
    s = Strategy.parse("3_2_5")
    step = lower(StepProgram.speculative(s, "sampled"), _bucket(s), "cpu")
    assert [op for op, _ in step.calls] == ["CATCHUP", "LEVEL", "LEVEL", "RERANK", "VERIFY", "ACCEPT", "COMMIT",
                                            "OUTPUT"]  # fmt: skip
    assert "ACCEPT  -> accept" in str(step) and "LEVEL   -> level" in str(step)
    plain = lower(StepProgram.plain_decode(), _bucket(None), "cpu")
    assert [op for op, _ in plain.calls] == ["ROOT", "VERIFY", "ACCEPT", "COMMIT", "OUTPUT"]


def test_bucket_of_another_strategy_is_refused():
    s = Strategy.parse("3_2_5")
    with pytest.raises(ValueError, match="serves strategy"):
        lower(StepProgram.speculative(s), _bucket(Strategy.parse("4_2_6")), "cpu")
    with pytest.raises(ValueError, match="ACCEPT"):
        bad = StepProgram.speculative(s).edit(5, temperature=0.5)  # settings are the rows' inputs, not the node's
        lower(bad, _bucket(s), "cpu")
    assert StepProgram.speculative(s).node(Op.RERANK)["depth"] == 3


class _Target:
    """A stand-in target whose forward returns fixed logits."""

    def __init__(self, logits):
        self.logits = logits

    def forward_paged(self, tokens, positions, cache, meta):
        n = tokens.shape[0]
        return type("Out", (), {"logits": self.logits.view(n, -1), "hidden": torch.zeros(n, 4)})()


def test_plain_decode_program_emits_the_argmax_and_packs_the_host_tensor():
    logits = torch.randn(3, 12)
    step = lower(StepProgram.plain_decode(), _bucket(None, 3), "cpu")
    ins = {"last_tokens": torch.tensor([1, 2, 3]), "prefix_lens": torch.tensor([5, 6, 7]),
           "block_table": torch.zeros(3, 8, dtype=torch.int32)}  # fmt: skip
    out = step(StepModels(target=_Target(logits), block_size=4), ins)
    assert torch.equal(out["bonus"], logits.argmax(-1))
    assert torch.equal(out["accept_len"], torch.zeros(3, dtype=torch.long))
    assert torch.equal(out["new_prefix_lens"], torch.tensor([6, 7, 8]))
    assert torch.equal(out["host"][:, 1], logits.argmax(-1).double()) and out["out_hidden"].shape == (3, 1, 4)
    assert "window" not in out


def test_a_sampled_step_without_the_rows_settings_is_refused():
    step = lower(StepProgram.first_draw("sampled"), _bucket(None), "cpu")
    with pytest.raises(ValueError, match="temperature, top_k, top_p, uniforms: missing"):
        step(StepModels(), {"logits": torch.randn(2, 1, 12)})


def test_a_first_draw_at_temperature_one_follows_the_logits():
    """The first-draw program (ACCEPT alone) samples each row's bonus from softmax(logits / T): with one
    uniform pair per row, the drawn tokens' frequencies over many rows match the distribution."""
    torch.manual_seed(0)
    n, v = 20000, 5
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(n, v)[:, None].contiguous()
    step = lower(StepProgram.first_draw("sampled"), _bucket(None), "cpu")
    ins = {"logits": logits, "uniforms": torch.rand(n, 1, 2), "temperature": torch.ones(n),
           "top_k": torch.full((n,), -1, dtype=torch.int32), "top_p": torch.ones(n)}  # fmt: skip
    out = step(StepModels(), ins)
    freq = torch.bincount(out["bonus"], minlength=v).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.015), freq
    torch.testing.assert_close(out["logprobs"][:, 0], probs.log()[out["bonus"]])


@pytest.mark.parametrize("strategy", ["3_2_5", "1_3_4", "4_3_9"])
def test_the_lowered_draft_nodes_build_the_whole_drafts_tree(strategy):
    """CATCHUP, the LEVELs and RERANK run one by one give `codegen.draft.draft_tree`'s tree, field for field."""
    from tlt_rt.codegen.draft import DraftInputs, draft_tree

    s = Strategy.parse(strategy)
    eng = make_engine(speculative="on", strategies=(strategy,))
    run = eng.runner
    d = run.drafter
    b, r = 3, s.depth + 1
    g = torch.Generator().manual_seed(len(strategy))
    lens = torch.tensor([0, 5, 9]) + r
    ins = {"ctx_tokens": torch.randint(0, 12, (b, r), generator=g), "ctx_len": lens.clamp(max=r),
           "ctx_hidden": torch.randn(b, r, eng.target.feature_size, generator=g), "prefix_lens": lens,
           "block_table": torch.arange(b * 8, dtype=torch.int32).view(b, 8)}  # fmt: skip
    ins["last_tokens"] = ins["ctx_tokens"][:, -1]
    program = StepProgram.speculative(s)
    nodes = [n for n in program.nodes if n.op <= Op.RERANK]
    a = eng.target.arch
    bucket = Bucket(b, s, 8, run.block_size, a.vocab_size, eng.target.feature_size, a.hidden_size)
    draft_only = lower(program, bucket, "cpu")
    models = StepModels(eng.target, run.target.cache, d.drafter, d.cache, run.block_size)
    values = dict(ins)
    whole = DraftInputs(ins["ctx_tokens"], ins["ctx_hidden"], ins["ctx_len"], lens, ins["block_table"])
    with torch.no_grad():
        for (_, fn), node in zip(draft_only.calls, program.nodes, strict=True):
            if node in nodes:
                fn(models, values)
        want = draft_tree(d.drafter, d.cache, s, run.block_size, whole)
    for name in TREE_FIELDS:
        assert torch.equal(values[name], getattr(want, name)), name


def test_the_kernel_table_picks_the_reference_off_cuda_and_names_what_it_has():
    from tlt_rt.codegen.kernels.accept_reference import accept_tree_reference
    from tlt_rt.codegen.kernels.kv_commit import kv_commit, kv_commit_reference
    from tlt_rt.codegen.table import KERNELS, kernel, runs_triton

    assert not runs_triton("cpu") and runs_triton("cuda") and runs_triton(torch.device("cuda", 1))
    assert kernel("kv_commit", "cpu") is kv_commit_reference and kernel("kv_commit", "cuda") is kv_commit
    assert kernel("accept", "cpu").keywords == {"backend": "torch"}  # accept_tree's torch path: the reference
    assert kernel("accept", "cuda").keywords == {"backend": "triton"}
    assert accept_tree_reference.__module__.endswith("accept_reference")
    with pytest.raises(KeyError, match="no kernel 'nope' in the codegen table .*accept, kv_commit"):
        kernel("nope", "cpu")
    assert set(KERNELS) == {"accept", "kv_commit", "topk_logprobs", "draft_level", "build_tree"}
