"""StepProgram: builders, the verifier's failures (each naming its node), shapes and printing."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tlt_rt.ir import (
    ATTRS,
    Bucket,
    Candidates,
    DraftTree,
    IRError,
    Node,
    Op,
    StepProgram,
    Strategy,
    build_tree,
)

SD = StepProgram.speculative("8_4_48")
DECODE = StepProgram.plain_decode()
BUCKET = Bucket(4, Strategy(8, 4, 48), 64, 16, 32000, 4096)


def _nodes(program, order):
    return StepProgram(tuple(program.nodes[i] for i in order))


def test_builders():
    assert [n.op for n in SD.nodes] == [Op.DRAFT, Op.VERIFY, Op.ACCEPT, Op.COMMIT]
    assert SD.strategy == Strategy(8, 4, 48) and SD.depth == 8
    assert [n.op for n in DECODE.nodes] == [Op.VERIFY, Op.ACCEPT, Op.COMMIT]
    assert DECODE.strategy is None and DECODE.depth == 0
    assert DECODE.node(Op.VERIFY)["verify_tokens"] == 1
    sampled = StepProgram.speculative(Strategy(4, 2, 10), accept="sampled", top_k=50, top_p=0.9)
    acc = sampled.node(Op.ACCEPT)
    assert (acc["mode"], acc["temperature"], acc["top_k"], acc["top_p"]) == ("sampled", 1.0, 50, 0.9)
    assert SD.node(Op.ACCEPT)["temperature"] == 0.0
    assert Op.DRAFT < Op.VERIFY < Op.ACCEPT < Op.COMMIT


def test_node_replace_is_a_copy():
    node = SD.nodes[2]
    hot = node.replace(temperature=0.7, mode="sampled")
    assert node["temperature"] == 0.0 and hot["temperature"] == 0.7 and hot["mode"] == "sampled"
    assert [k for k, _ in hot.attrs] == list(ATTRS[Op.ACCEPT])  # order kept
    assert node.replace(op=Op.COMMIT).op == Op.COMMIT
    assert node == SD.nodes[2] and hash(node) == hash(SD.nodes[2])
    assert node.replace() == node
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.op = Op.DRAFT
    with pytest.raises(KeyError, match="no attribute 'nope'"):
        node["nope"]
    assert str(SD.nodes[0]).split() == ["DRAFT", "depth=8", "topk=4", "verify_tokens=48"]


@pytest.mark.parametrize(
    ("build", "where", "fragment"),
    [
        (lambda: _nodes(SD, [0, 2, 1, 3]), "%2 VERIFY", "out of order"),
        (lambda: _nodes(SD, [1, 0, 2, 3]), "%1 DRAFT", "out of order"),
        (lambda: _nodes(SD, [0, 1, 1, 2, 3]), "%2 VERIFY", "duplicate VERIFY (first at %1)"),
        (lambda: _nodes(SD, [0, 1, 3]), "%2 COMMIT", "missing ACCEPT"),
        (lambda: _nodes(SD, [0, 2, 3]), "%1 ACCEPT", "missing VERIFY"),
        (lambda: _nodes(SD, [0, 1, 2]), "%2 ACCEPT", "without a COMMIT"),
        (lambda: _nodes(SD, [0]), "%0 DRAFT", "without a VERIFY"),
        (lambda: StepProgram(()), "%0 ?", "empty"),
        (lambda: StepProgram((SD.nodes[0], "VERIFY")), "%1 ?", "not a Node"),
        (lambda: SD.edit(2, mode="sampled"), "%2 ACCEPT", "temperature > 0"),
        (lambda: SD.edit(2, temperature=0.5), "%2 ACCEPT", "greedy acceptance needs temperature=0"),
        (lambda: SD.edit(2, mode="beam"), "%2 ACCEPT", "mode must be one of"),
        (lambda: SD.edit(2, mode="sampled", temperature=-1.0), "%2 ACCEPT", "temperature"),
        (lambda: SD.edit(2, mode="sampled", temperature=math.inf), "%2 ACCEPT", "temperature"),
        (lambda: SD.edit(2, top_p=0.0), "%2 ACCEPT", "top_p must be in (0, 1]"),
        (lambda: SD.edit(2, top_p=1.5), "%2 ACCEPT", "top_p"),
        (lambda: SD.edit(2, top_p=math.nan), "%2 ACCEPT", "top_p"),
        (lambda: SD.edit(2, top_k=0), "%2 ACCEPT", "top_k must be -1 (off) or >= 1"),
        (lambda: SD.edit(2, top_k=-2), "%2 ACCEPT", "top_k"),
        (lambda: SD.edit(2, top_k=2.5), "%2 ACCEPT", "top_k must be an int"),
        (lambda: SD.edit(1, verify_tokens=47), "%1 VERIFY", "must equal the DRAFT strategy's 48"),
        (lambda: SD.edit(2, depth=7), "%2 ACCEPT", "depth=7 must equal the DRAFT depth 8"),
        (lambda: SD.edit(3, depth=9), "%3 COMMIT", "depth=9 must equal the DRAFT depth 8"),
        (lambda: SD.edit(0, verify_tokens=1000), "%0 DRAFT", "verify_tokens must be <= 117"),
        (lambda: SD.edit(0, depth=0), "%0 DRAFT", "Strategy.depth"),
        (lambda: SD.edit(0, topk=True), "%0 DRAFT", "topk must be an int"),
        (lambda: SD.edit(0, width=3), "%0 DRAFT", "unknown attribute 'width'"),
        (lambda: StepProgram((Node.make(Op.DRAFT, depth=8, topk=4), *SD.nodes[1:])), "%0 DRAFT", "missing"),
        (lambda: DECODE.edit(0, verify_tokens=2), "%0 VERIFY", "1 without a DRAFT"),
        (lambda: DECODE.edit(1, depth=1), "%1 ACCEPT", "0 without a DRAFT"),
        (lambda: DECODE.edit(2, op=Op.ACCEPT), "%2 ACCEPT", "duplicate ACCEPT"),
    ],
)
def test_verifier_names_the_node(build, where, fragment):
    with pytest.raises(IRError) as err:
        build().verify()
    message = str(err.value)
    assert message.startswith(where + ":"), message
    assert fragment in message
    assert isinstance(err.value, ValueError)
    assert err.value.index == int(where.split()[0][1:])


def test_builders_verify():
    with pytest.raises(IRError, match=r"^%2 ACCEPT: sampled acceptance needs temperature > 0"):
        StepProgram.speculative("8_4_48", accept="sampled", temperature=0.0)
    with pytest.raises(IRError, match=r"^%1 ACCEPT: top_p"):
        StepProgram.plain_decode(accept="sampled", top_p=2.0)
    with pytest.raises(ValueError, match="verify_tokens"):
        StepProgram.speculative("8_4_1000")


def test_shapes_follow_the_contract():
    shapes = SD.shapes(BUCKET)
    draft, verify, accept, commit = SD.nodes
    assert shapes[draft]["tree_tokens"] == (4, 48)
    for name in ("parents", "depths", "positions", "num_children"):
        assert shapes[draft][name] == (4, 48)
    assert shapes[draft]["tree_mask"] == (4, 48, 48)
    assert shapes[draft]["paths"] == (4, 48, 9) and shapes[draft]["children"] == (4, 48, 4)
    assert shapes[verify]["logits"] == (4, 48, 32000) and shapes[verify]["hidden"] == (4, 48, 4096)
    assert shapes[verify]["tree_mask"] == (4, 48, 48)  # an input
    assert shapes[accept]["accept_len"] == (4,) and shapes[accept]["bonus"] == (4,)
    for name in ("accepted_tokens", "accepted_nodes", "logprobs"):
        assert shapes[accept][name] == (4, 9)
    assert shapes[commit]["accepted_nodes"] == (4, 9) and shapes[commit]["new_prefix_lens"] == (4,)

    sig = SD.signature(BUCKET)
    assert sig[draft].outputs["tree_mask"].dtype == torch.bool
    assert sig[accept].outputs["logprobs"].dtype == torch.float32
    assert sig[verify].outputs["logits"].dtype is None  # model dtype


def test_decode_shapes():
    bucket = Bucket(8, None, 32, 16, 100, 64)
    shapes = DECODE.shapes(bucket)
    verify, accept, _ = DECODE.nodes
    assert shapes[verify]["logits"] == (8, 1, 100) and shapes[verify]["last_tokens"] == (8,)
    assert shapes[accept]["accepted_tokens"] == (8, 1) and shapes[accept]["accept_len"] == (8,)


def test_sampled_acceptance_reads_uniforms():
    sampled = StepProgram.speculative("8_4_48", accept="sampled", temperature=0.8)
    accept = sampled.node(Op.ACCEPT)
    assert sampled.step_inputs(BUCKET)["uniforms"].shape == (4, 9, 2)
    assert list(sampled.signature(BUCKET)[accept].inputs) == ["logits", "tree_tokens", "parents", "uniforms"]
    assert "uniforms" not in SD.step_inputs(BUCKET)
    decode = StepProgram.plain_decode(accept="sampled")
    assert decode.shapes(Bucket(2, None, 8, 16, 100, 16))[decode.nodes[1]]["uniforms"] == (2, 1, 2)


def test_bucket_must_match_program():
    with pytest.raises(ValueError, match="serves strategy decode, the program is 8_4_48"):
        SD.shapes(Bucket(4, None, 64, 16, 32000, 4096))
    with pytest.raises(ValueError, match="serves strategy 8_4_48, the program is decode"):
        DECODE.shapes(BUCKET)


@given(depth=st.integers(1, 6), topk=st.integers(1, 5), batch=st.integers(1, 9), data=st.data())
def test_dataflow_and_tree_agree(depth, topk, batch, data):
    strategy = Strategy(depth, topk, data.draw(st.integers(2, 1 + topk + (depth - 1) * topk * topk)))
    program = StepProgram.speculative(strategy, accept="sampled", temperature=0.5)
    bucket = Bucket(batch, strategy, 3, 16, 50, 8)
    made = set(program.step_inputs(bucket))
    sig = program.signature(bucket)
    for node in program.nodes:
        # every input comes from the engine or an earlier node, and nothing is made twice
        assert set(sig[node].inputs) <= made
        assert not set(sig[node].outputs) & made
        made |= set(sig[node].outputs)

    # the DRAFT outputs are exactly what build_tree returns, shapes and dtypes included
    draft_out = sig[program.nodes[0]].outputs
    assert list(draft_out) == [f.name for f in dataclasses.fields(DraftTree)]
    n = strategy.num_candidates
    cands = Candidates(
        torch.zeros(batch, n, dtype=torch.long),
        -torch.arange(n, dtype=torch.float32).expand(batch, n),
        torch.full((batch, n), -1, dtype=torch.long),
        topk,
    )
    tree = build_tree(
        cands, torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long), strategy.verify_tokens
    )
    for name, spec in draft_out.items():
        t = getattr(tree, name)
        assert tuple(t.shape) == spec.shape and t.dtype == spec.dtype, name


def test_pretty_print():
    text = SD.pretty(BUCKET)
    for fragment in (
        "%0 DRAFT   depth=8 topk=4 verify_tokens=48",
        "tree_tokens[4,48]",
        "tree_mask[4,48,48]:bool",
        "logits[4,48,32000]",
        "%2 ACCEPT  mode=greedy depth=8",
        "accepted_tokens[4,9]:i64",
        "block_table[4,64]:i32",
    ):
        assert fragment in text, fragment
    assert str(SD).splitlines() == [f"%{i} {n}" for i, n in enumerate(SD.nodes)]
    assert "logits[2,1,100]" in DECODE.pretty(Bucket(2, None, 8, 16, 100, 16))


def test_a_filtered_program_filters_and_draws_uniforms_as_a_sampled_one():
    """The filtered acceptance mode: the top-k / top-p walk whatever the node's own settings (the rows bring
    theirs), temperature > 0 like sampled, and the same uniforms among its inputs."""
    filtered = StepProgram.speculative("4_2_10", accept="filtered")
    acc = filtered.node(Op.ACCEPT)
    assert (acc["mode"], acc["temperature"], acc["top_k"], acc["top_p"]) == ("filtered", 1.0, -1, 1.0)
    with pytest.raises(IRError, match=r"^%2 ACCEPT: filtered acceptance needs temperature > 0"):
        StepProgram.speculative("4_2_10", accept="filtered", temperature=0.0)
    with pytest.raises(IRError, match="mode must be one of"):
        StepProgram.plain_decode(accept="nucleus")
    bucket = Bucket(4, Strategy.parse("4_2_10"), 64, 16, 100, 64)
    assert "uniforms" in filtered.step_inputs(bucket)
    assert "uniforms" in StepProgram.speculative("4_2_10", accept="sampled").step_inputs(bucket)
    assert "uniforms" not in StepProgram.speculative("4_2_10").step_inputs(bucket)
