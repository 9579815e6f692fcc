"""StepProgram: builders, the verifier's failures (each naming its node), shapes and printing."""

from __future__ import annotations

import dataclasses

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
SMALL = StepProgram.speculative("3_2_5")  # CATCHUP, LEVEL 2, LEVEL 3, RERANK, VERIFY, ACCEPT, COMMIT, OUTPUT
DECODE = StepProgram.plain_decode()  # ROOT, VERIFY, ACCEPT, COMMIT, OUTPUT
DRAW = StepProgram.first_draw()
BUCKET = Bucket(4, Strategy(8, 4, 48), 64, 16, 32000, 4096)


def _nodes(program, order):
    return StepProgram(tuple(program.nodes[i] for i in order))


def test_builders():
    ops = [n.op for n in SD.nodes]
    assert ops == [Op.CATCHUP, *[Op.LEVEL] * 7, Op.RERANK, Op.VERIFY, Op.ACCEPT, Op.COMMIT, Op.OUTPUT]
    assert [n["level"] for n in SD.nodes if n.op == Op.LEVEL] == list(range(2, 9))
    assert SD.strategy == Strategy(8, 4, 48) and SD.depth == 8 and SD.rows == 9
    assert StepProgram.speculative("8_4_48", rows=11).rows == 11
    assert [n.op for n in DECODE.nodes] == [Op.ROOT, Op.VERIFY, Op.ACCEPT, Op.COMMIT, Op.OUTPUT]
    assert DECODE.strategy is None and DECODE.depth == 0 and DECODE.rows == 0 and not DECODE.is_draw
    assert DECODE.node(Op.VERIFY)["verify_tokens"] == 1
    assert [n.op for n in DRAW.nodes] == [Op.ACCEPT] and DRAW.is_draw and DRAW.nodes[0]["depth"] == 0
    assert StepProgram.speculative(Strategy(1, 3, 4)).node(Op.LEVEL) is None  # depth 1: no later level
    assert SD.node(Op.ACCEPT)["mode"] == "greedy"
    assert list(Op) == sorted(Op)


def test_node_replace_is_a_copy():
    node = SD.node(Op.ACCEPT)
    hot = node.replace(mode="sampled")
    assert node["mode"] == "greedy" and hot["mode"] == "sampled"
    assert [k for k, _ in hot.attrs] == list(ATTRS[Op.ACCEPT])  # order kept
    assert node.replace(op=Op.COMMIT).op == Op.COMMIT
    assert node == SD.node(Op.ACCEPT) and hash(node) == hash(SD.node(Op.ACCEPT))
    assert node.replace() == node
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.op = Op.VERIFY
    with pytest.raises(KeyError, match="no attribute 'nope'"):
        node["nope"]
    assert str(SD.nodes[0]).split() == ["CATCHUP", "rows=9", "topk=4"]
    assert str(SD.node(Op.RERANK)).split() == ["RERANK", "depth=8", "topk=4", "verify_tokens=48"]


@pytest.mark.parametrize(
    ("build", "where", "fragment"),
    [
        (lambda: _nodes(SMALL, [0, 1, 2, 3, 5, 4, 6, 7]), "%5 VERIFY", "out of order"),
        (lambda: _nodes(SMALL, [1, 0, 2, 3, 4, 5, 6, 7]), "%1 CATCHUP", "out of order"),
        (lambda: _nodes(SMALL, [0, 1, 2, 3, 4, 4, 5, 6, 7]), "%5 VERIFY", "duplicate VERIFY (first at %4)"),
        (lambda: _nodes(SMALL, [0, 1, 2, 3, 4, 6, 7]), "%5 COMMIT", "missing ACCEPT"),
        (lambda: _nodes(SMALL, [0, 1, 2, 3, 5, 6, 7]), "%4 ACCEPT", "missing VERIFY"),
        (lambda: _nodes(SMALL, [0, 1, 2, 4, 5, 6, 7]), "%3 VERIFY", "missing RERANK"),
        (lambda: _nodes(SMALL, [1, 2, 3, 4, 5, 6, 7]), "%0 LEVEL", "missing CATCHUP"),
        (lambda: _nodes(SMALL, [0, 1, 2, 3, 4, 5, 6]), "%6 COMMIT", "ends without OUTPUT"),
        (lambda: _nodes(SMALL, [0]), "%0 CATCHUP", "ends without RERANK"),
        (lambda: _nodes(SMALL, [0, 1, 3, 4, 5, 6, 7]), "%2 RERANK", "depth=3 needs 2 LEVEL nodes, the program has 1"),
        (lambda: _nodes(SMALL, [0, 2, 1, 3, 4, 5, 6, 7]), "%1 LEVEL", "levels run 2, 3"),
        (
            lambda: StepProgram((*SMALL.nodes[:4], DECODE.nodes[0], *SMALL.nodes[4:])),
            "%4 ROOT",
            "a ROOT tree with a draft",
        ),
        (lambda: StepProgram(()), "%0 ?", "empty"),
        (lambda: StepProgram((SD.nodes[0], "VERIFY")), "%1 ?", "not a Node"),
        (lambda: SMALL.edit(5, mode="beam"), "%5 ACCEPT", "mode must be one of"),
        (lambda: SMALL.edit(5, temperature=0.5), "%5 ACCEPT", "unknown attribute 'temperature'"),
        (lambda: SMALL.edit(4, verify_tokens=4), "%4 VERIFY", "must equal the RERANK's 5"),
        (lambda: SMALL.edit(5, depth=2), "%5 ACCEPT", "depth=2 must equal the RERANK's depth 3"),
        (lambda: SMALL.edit(6, depth=4), "%6 COMMIT", "depth=4 must equal the RERANK's depth 3"),
        (lambda: SMALL.edit(7, rows=5), "%7 OUTPUT", "rows=5 must equal the CATCHUP's 4"),
        (lambda: SMALL.edit(0, rows=3).edit(7, rows=3), "%0 CATCHUP", "rows=3 must be an int >= depth + 1 = 4"),
        (lambda: SMALL.edit(1, topk=3), "%1 LEVEL", "topk=3 must equal the RERANK's 2"),
        (lambda: SMALL.edit(3, verify_tokens=1000), "%3 RERANK", "verify_tokens must be <= 11"),
        (lambda: SMALL.edit(3, topk=True), "%3 RERANK", "topk must be an int"),
        (lambda: SMALL.edit(0, width=3), "%0 CATCHUP", "unknown attribute 'width'"),
        (lambda: StepProgram((Node.make(Op.CATCHUP, rows=4), *SMALL.nodes[1:])), "%0 CATCHUP", "missing"),
        (lambda: DECODE.edit(1, verify_tokens=2), "%1 VERIFY", "1 (plain decoding)"),
        (lambda: DECODE.edit(2, depth=1), "%2 ACCEPT", "0 (plain decoding)"),
        (lambda: DECODE.edit(3, op=Op.ACCEPT), "%3 ACCEPT", "duplicate ACCEPT"),
        (lambda: DECODE.edit(0, rows=1), "%0 ROOT", "unknown attribute 'rows' (expects none)"),
        (lambda: DRAW.edit(0, depth=2), "%0 ACCEPT", "a first draw (ACCEPT alone) has depth 0"),
        (lambda: DRAW.edit(0, mode="nucleus"), "%0 ACCEPT", "mode must be one of"),
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
    with pytest.raises(IRError, match=r"ACCEPT: mode must be one of"):
        StepProgram.plain_decode(accept="nucleus")
    with pytest.raises(IRError, match=r"^%0 CATCHUP: rows=2"):
        StepProgram.speculative("3_2_5", rows=2)
    with pytest.raises(ValueError, match="verify_tokens"):
        StepProgram.speculative("8_4_1000")


def test_shapes_follow_the_contract():
    shapes = SD.shapes(BUCKET)
    catchup, level2, level8 = SD.nodes[0], SD.nodes[1], SD.nodes[7]
    rerank, verify, accept, commit, output = SD.nodes[8:]
    assert shapes[catchup]["ctx_hidden"] == (4, 9, 4096) and shapes[catchup]["cand_tokens.1"] == (4, 4)
    assert shapes[catchup]["front_mask.1"] == (4, 4, 4)
    assert shapes[level2]["cand_tokens.2"] == (4, 16) and shapes[level2]["front_mask.2"] == (4, 4, 8)
    assert shapes[level2]["level_positions"] == (7, 4, 4) and shapes[level2]["level_cu"] == (17,)
    assert "front_tokens.8" not in shapes[level8] and shapes[level8]["front_mask.7"] == (4, 4, 28)
    assert shapes[rerank]["tree_tokens"] == (4, 48) and shapes[rerank]["cand_front.8"] == (4, 4)
    for name in ("parents", "depths", "positions", "num_children"):
        assert shapes[rerank][name] == (4, 48)
    assert shapes[rerank]["tree_mask"] == (4, 48, 48)
    assert shapes[rerank]["paths"] == (4, 48, 9) and shapes[rerank]["children"] == (4, 48, 4)
    assert shapes[verify]["logits"] == (4, 48, 32000) and shapes[verify]["hidden"] == (4, 48, 4096)
    assert shapes[verify]["tree_mask"] == (4, 48, 48)  # an input
    assert shapes[accept]["accept_len"] == (4,) and shapes[accept]["bonus"] == (4,)
    for name in ("accepted_tokens", "accepted_nodes", "logprobs"):
        assert shapes[accept][name] == (4, 9)
    assert shapes[commit]["accepted_nodes"] == (4, 9) and shapes[commit]["new_prefix_lens"] == (4,)
    assert shapes[output]["host"] == (4, 19) and shapes[output]["out_hidden"] == (4, 9, 4096)
    assert shapes[output]["window"] == (4, 9, 4096)

    sig = SD.signature(BUCKET)
    assert sig[rerank].outputs["tree_mask"].dtype == torch.bool
    assert sig[accept].outputs["logprobs"].dtype == torch.float32
    assert sig[verify].outputs["logits"].dtype is None  # model dtype
    assert sig[output].outputs["host"].dtype == torch.float64


def test_decode_and_draw_shapes():
    bucket = Bucket(8, None, 32, 16, 100, 64)
    shapes = DECODE.shapes(bucket)
    root, verify, accept, _, output = DECODE.nodes
    assert shapes[root]["tree_tokens"] == (8, 1) and shapes[root]["last_tokens"] == (8,)
    assert shapes[verify]["logits"] == (8, 1, 100)
    assert shapes[accept]["accepted_tokens"] == (8, 1) and shapes[accept]["accept_len"] == (8,)
    assert shapes[output]["host"] == (8, 3) and "window" not in shapes[output]
    draw = StepProgram.first_draw("sampled")
    assert draw.step_inputs(bucket)["logits"].shape == (8, 1, 100)
    assert list(draw.signature(bucket)[draw.nodes[0]].inputs) == ["logits", "uniforms", "temperature", "top_k", "top_p"]


def test_sampled_acceptance_reads_the_rows_settings():
    sampled = StepProgram.speculative("8_4_48", accept="sampled")
    accept = sampled.node(Op.ACCEPT)
    inputs = sampled.step_inputs(BUCKET)
    assert inputs["uniforms"].shape == (4, 9, 2)
    assert inputs["temperature"].shape == (4,) and inputs["top_k"].dtype == torch.int32
    want = ["logits", "tree_tokens", "parents", "uniforms", "temperature", "top_k", "top_p"]
    assert list(sampled.signature(BUCKET)[accept].inputs) == want
    assert not {"uniforms", "temperature"} & set(SD.step_inputs(BUCKET))
    decode = StepProgram.plain_decode(accept="filtered")
    assert decode.shapes(Bucket(2, None, 8, 16, 100, 16))[decode.nodes[2]]["uniforms"] == (2, 1, 2)


def test_bucket_must_match_program():
    with pytest.raises(ValueError, match="serves strategy decode, the program is 8_4_48"):
        SD.shapes(Bucket(4, None, 64, 16, 32000, 4096))
    with pytest.raises(ValueError, match="serves strategy 8_4_48, the program is decode"):
        DECODE.shapes(BUCKET)


@given(depth=st.integers(1, 6), topk=st.integers(1, 5), batch=st.integers(1, 9), extra=st.integers(0, 3),
       data=st.data())  # fmt: skip
def test_dataflow_and_tree_agree(depth, topk, batch, extra, data):
    strategy = Strategy(depth, topk, data.draw(st.integers(2, 1 + topk + (depth - 1) * topk * topk)))
    program = StepProgram.speculative(strategy, accept="sampled", rows=depth + 1 + extra)
    bucket = Bucket(batch, strategy, 3, 16, 50, 8, 6)
    made = set(program.step_inputs(bucket))
    sig = program.signature(bucket)
    for node in program.nodes:
        # every input comes from the engine or an earlier node, and nothing is made twice
        assert set(sig[node].inputs) <= made
        assert not set(sig[node].outputs) & made
        made |= set(sig[node].outputs)

    # the RERANK outputs are exactly what build_tree returns, shapes and dtypes included
    tree_out = sig[program.node(Op.RERANK)].outputs
    assert list(tree_out) == [f.name for f in dataclasses.fields(DraftTree)]
    n = strategy.num_candidates
    cand_width = sum(sig[program.node(Op.RERANK)].inputs[f"cand_tokens.{d}"].shape[1] for d in range(1, depth + 1))
    assert cand_width == n  # the levels' candidates are every candidate of the strategy
    cands = Candidates(
        torch.zeros(batch, n, dtype=torch.long),
        -torch.arange(n, dtype=torch.float32).expand(batch, n),
        torch.full((batch, n), -1, dtype=torch.long),
        topk,
    )
    tree = build_tree(
        cands, torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long), strategy.verify_tokens
    )
    for name, spec in tree_out.items():
        t = getattr(tree, name)
        assert tuple(t.shape) == spec.shape and t.dtype == spec.dtype, name


def test_pretty_print():
    text = SD.pretty(BUCKET)
    for fragment in (
        "%0 CATCHUP rows=9 topk=4",
        "%8 RERANK  depth=8 topk=4 verify_tokens=48",
        "tree_tokens[4,48]",
        "tree_mask[4,48,48]:bool",
        "logits[4,48,32000]",
        "%10 ACCEPT  mode=greedy depth=8",
        "accepted_tokens[4,9]:i64",
        "block_table[4,64]:i32",
        "host[4,19]:f64",
    ):
        assert fragment in text, fragment
    assert str(SD).splitlines() == [f"%{i} {n}" for i, n in enumerate(SD.nodes)]
    assert "logits[2,1,100]" in DECODE.pretty(Bucket(2, None, 8, 16, 100, 16))
