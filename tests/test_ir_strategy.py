"""Strategy parsing and validation, Bucket, and the batch-bucket list."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tlt_rt.ir import Bucket, Strategy, batch_buckets, bucket_for, level_bounds, max_verify_tokens


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8_4_48", Strategy(8, 4, 48)),
        (" 8_4_48 ", Strategy(8, 4, 48)),
        ("1_1_2", Strategy(1, 1, 2)),
        ("6_10_60", Strategy(6, 10, 60)),
        ("8_4_117", Strategy(8, 4, 117)),
    ],
)
def test_parse_good(text, expected):
    s = Strategy.parse(text)
    assert s == expected
    assert str(s) == text.strip()


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("8-4-48", ["DEPTH_TOPK_VERIFYTOKENS"]),
        ("8_4", ["DEPTH_TOPK_VERIFYTOKENS"]),
        ("8_4_48_2", ["DEPTH_TOPK_VERIFYTOKENS"]),
        ("", ["DEPTH_TOPK_VERIFYTOKENS"]),
        ("0_4_8", ["depth", ">= 1"]),
        ("8_0_8", ["topk", ">= 1"]),
        ("8_4_1", ["verify_tokens", ">= 2"]),
        ("8_4_1000", ["verify_tokens", "117"]),
        ("8_4_118", ["verify_tokens", "117"]),
        ("1_4_6", ["verify_tokens", "5"]),
        ("a_b_c", ["depth", "'a'"]),
        ("8_x_48", ["topk", "'x'"]),
        ("8_4_-3", ["verify_tokens", "'-3'"]),
        ("8_4_4.5", ["verify_tokens"]),
    ],
)
def test_parse_bad_names_the_field(text, fragments):
    with pytest.raises(ValueError) as err:
        Strategy.parse(text)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((True, 4, 8), "depth"),
        ((2.0, 4, 8), "depth"),
        ((8, -1, 8), "topk"),
        ((8, 4, "48"), "verify_tokens"),
        ((8, 4, 0), "verify_tokens"),
    ],
)
def test_constructor_validates(args, field):
    with pytest.raises(ValueError, match=f"Strategy.{field}"):
        Strategy(*args)


@given(depth=st.integers(1, 12), topk=st.integers(1, 10), data=st.data())
def test_limit_is_the_eagle2_candidate_count(depth, topk, data):
    # count what the drafter makes level by level: K children of the root, then K*K per later level
    candidates = sum(end - start for start, end in level_bounds(depth, topk))
    limit = max_verify_tokens(depth, topk)
    assert limit == 1 + candidates
    assert Strategy(depth, topk, limit).num_candidates == candidates
    with pytest.raises(ValueError, match=f"verify_tokens must be <= {limit}"):
        Strategy(depth, topk, limit + 1)
    t = data.draw(st.integers(2, limit))
    s = Strategy(depth, topk, t)
    assert Strategy.parse(str(s)) == s


def test_bucket_fields_and_errors():
    s = Strategy(8, 4, 48)
    b = Bucket(4, s, 64, 16, 32000, 4096)
    assert b.tokens_per_seq == 48 and b.max_seq_len == 1024 and str(b) == "b4/8_4_48"
    d = Bucket(8, None, 64, 16, 32000, 4096)
    assert d.tokens_per_seq == 1 and str(d) == "b8/decode"
    assert len({b, d, Bucket(4, Strategy(8, 4, 48), 64, 16, 32000, 4096)}) == 2
    for i, field in enumerate(["batch_size", None, "max_blocks_per_seq", "block_size", "vocab_size"]):
        if field is None:
            continue
        args = [4, s, 64, 16, 32000, 4096]
        args[i] = 0
        with pytest.raises(ValueError, match=f"Bucket.{field}"):
            Bucket(*args)
    with pytest.raises(ValueError, match="Bucket.strategy"):
        Bucket(4, "8_4_48", 64, 16, 32000, 4096)


def test_batch_buckets_list():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)


@given(st.integers(1, 2000))
def test_batch_buckets_properties(max_batch):
    sizes = batch_buckets(max_batch)
    assert sizes[0] == 1 and sizes[-1] == max_batch
    assert all(a < b for a, b in zip(sizes, sizes[1:], strict=False))
    # past 16, padding a batch up never wastes more than a third of the padded batch
    assert all(b <= max(16, a * 1.5) for a, b in zip(sizes, sizes[1:], strict=False))


@given(st.integers(1, 300), st.integers(1, 300))
def test_bucket_for(max_batch, batch):
    sizes = batch_buckets(max_batch)
    if batch > max_batch:
        with pytest.raises(ValueError, match="exceeds the largest bucket"):
            bucket_for(batch, sizes)
    else:
        got = bucket_for(batch, sizes)
        assert got >= batch and got in sizes
        assert all(b < batch for b in sizes if b < got)


def test_bucket_for_errors():
    with pytest.raises(ValueError, match="batch"):
        bucket_for(0, [1, 2])
    with pytest.raises(ValueError, match="exceeds"):
        bucket_for(3, [])
