"""The captured step's glue that runs through torch.compile on CUDA (`codegen.table.maybe_compiled`) traces as one
graph each (no break, so Inductor can fuse all of it) and gives what the plain functions give."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import tiny_pair
from tlt_rt.codegen import draft, lower
from tlt_rt.rollout.step import graph


def _traced(fn):
    return torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)


def _same(got, want):
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _same(g, w)
    elif want is None:
        assert got is None
    else:
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def drafter():
    return tiny_pair(0, 4.0)[1]


@pytest.mark.parametrize("b, r", [(3, 5), (1, 9)])
def test_catch_up_block_inputs(drafter, b, r):
    g = torch.Generator().manual_seed(b * 10 + r)
    h = drafter.fc.weight.shape[0]
    tokens = torch.randint(0, 50, (b, r), generator=g)
    hidden = torch.randn(b, r, h, generator=g)
    prefix = torch.randint(0, 3 * r, (b,), generator=g)
    valid = prefix.clamp(max=r)
    tables = torch.randint(0, 8, (b, 3 * r // 4 + 2), generator=g).int()  # covers every row's position
    args = (tokens, hidden, valid, prefix, tables, drafter.features, 4, 99)
    _same(_traced(draft._block_meta)(*args), draft._block_meta(*args))


@pytest.mark.parametrize("k, levels", [(4, 7), (2, 5), (1, 1)])
def test_level_inputs(k, levels):
    prefix = torch.tensor([0, 5, 17])
    tables = torch.arange(48, dtype=torch.int32).view(3, 16)  # covers position 17 + 7 * 4
    valid = torch.tensor([0, 3, 9])
    args = (prefix, tables, valid, k, levels, 4, 119)
    _same(_traced(draft.level_meta)(*args), draft.level_meta(*args))


@pytest.mark.parametrize("r, dlen", [(1, 0), (9, 7)])
def test_step_unpack_and_pack(r, dlen):
    g = torch.Generator().manual_seed(r)
    b, h = 3, 8
    ints = torch.randint(0, 9, (b, 2 + r + 4), generator=g)
    floats = torch.rand(b, 2 * (dlen + 1) + 3, generator=g)
    _same(_traced(graph.unpack_inputs)(ints, floats, r, dlen), graph.unpack_inputs(ints, floats, r, dlen))
    acc = torch.randint(0, dlen + 1, (b,), generator=g)
    nodes = torch.where(torch.arange(dlen + 1) < acc[:, None], torch.arange(1, dlen + 2), -1)
    hid = torch.randn(b, 2 * dlen + 1, h, generator=g)
    toks, lps = torch.randint(0, 9, (b, dlen + 1), generator=g), torch.randn(b, dlen + 1, generator=g)
    for window in (None, torch.randn(b, r, h, generator=g)) if dlen else (None,):
        args = (acc, nodes, hid, window, toks, lps)
        _same(_traced(lower.pack_outputs)(*args), lower.pack_outputs(*args))


@pytest.mark.parametrize("q_len, write", [(12, False), (1, False), (5, True)])
def test_verify_slots(q_len, write):
    g = torch.Generator().manual_seed(q_len)
    tables = torch.randint(0, 30, (3, 8), generator=g).int()
    lens = torch.tensor([0, 3, 17]) + q_len - 2  # the first row's leading tokens have negative positions
    keep = torch.rand(3, q_len, generator=g) < 0.7 if write else None
    args = (tables, lens, q_len, 4, keep)
    _same(_traced(lower.tree_slots)(*args), lower.tree_slots(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_cat(dtype):
    """The drafter's fc input (its token's embedding beside the feature) traces as one graph and equals the
    gather and concatenation done apart."""
    from tlt_rt.models.llama import embed_cat

    torch.manual_seed(0)
    weight, ids, feature = torch.randn(50, 8), torch.randint(0, 50, (6,)), torch.randn(6, 8).to(dtype)
    got = _traced(embed_cat)(weight, ids, feature)
    _same(got, torch.cat([weight[ids].to(dtype), feature], dim=-1))
    assert torch.equal(got, embed_cat(weight, ids, feature))
