"""benchmarks/tp_throughput.py on CPU (gloo, the tiny shape): TP=N ranks emit exactly TP=1's greedy tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("tp,sd", [(2, "3_2_4"), (4, None)])
def test_tp_ranks_give_the_unsharded_tokens(tp, sd):
    """Plain decoding at TP=N, and with --sd speculative decoding at TP=1 and TP=N (a replicated random drafter),
    all emit TP=1 plain decoding's greedy tokens; the SD rows carry their step's cost over a plain step's. Without
    --sd, plain engines with steps queued ahead and one at a time (`--overlap on off`), the same tokens; with it,
    the speculative steps queued ahead too (`--overlap-speculative`)."""
    cmd = [sys.executable, "benchmarks/tp_throughput.py", "--smoke", "--tp", str(tp)]
    cmd += ["--sd", sd, "--overlap-speculative"] if sd else ["--overlap", "on", "off"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    modes = ["plain"] + ([sd] if sd else ["plain serial"])
    assert sorted((r[0], r[1], r[2]) for r in rows) == sorted(
        (t, b, m) for t in ("1", str(tp)) for b in ("1", "4") for m in modes
    )
    head = [
        c.strip() for c in next(ln for ln in done.stdout.splitlines() if ln.startswith("| tp")).strip("|").split("|")
    ]
    equal, ratio, bare = head.index("equal"), head.index("SD/plain step"), head.index("bare step ms")
    assert all(r[equal] == ("-" if (r[0], r[2]) == ("1", "plain") else "yes") for r in rows)
    assert all(r[ratio].endswith("x") for r in rows if r[2] != "plain")
    assert all(float(r[bare]) > 0 for r in rows)  # the captured step alone, timed beside each row


def test_a_shape_the_ranks_cannot_split_fails_before_any_process():
    done = subprocess.run([sys.executable, "benchmarks/tp_throughput.py", "--shape", "qwen2.5-7b", "--tp", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "divisible by 3" in done.stderr


def test_profile_writes_one_table_per_row_from_rank_0(tmp_path):
    """--profile: after each timed row every rank runs one more generate, which rank 0 profiles into DIR; the
    table keeps the run exact and starts with the row it belongs to."""
    cmd = [sys.executable, "benchmarks/tp_throughput.py", "--smoke", "--tp", "2", "--profile", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"tp{t}-plain-b{b}.txt" for t in (1, 2) for b in (1, 4)]
    text = (tmp_path / "tp2-plain-b4.txt").read_text()
    assert text.startswith("# TP=2 plain, batch 4: one generate of 8 tokens\nwall ") and "host operators" in text
    assert all(line.rstrip().endswith("| yes |") for line in done.stdout.splitlines() if line.startswith("| 2 |"))


def test_fused_sum_settings_parse_the_flat_key():
    """`--allreduce fused:..,f=0|1` sets the TP sum's one-row product layout (tp_sum.ROW_FLAT) for that run."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tp_throughput import fused_settings

    assert fused_settings("fused") == (None, None, None)
    assert fused_settings("fused:bn=8,tail=512,f=1") == ({"block_n": 8}, 512, True)
    assert fused_settings("fused:f=0")[2] is False
    with pytest.raises(ValueError, match="f=0|1"):
        fused_settings("fused:f=yes")


@pytest.mark.slow
def test_interleaved_rounds_keep_every_engine_and_pair_each_row_with_tp1():
    """--rounds 3: every engine kept, TP=1's beside TP=2's, timed in three interleaved rounds; each row still emits
    TP=1 plain's tokens and a TP=2 row carries its tokens/s over the TP=1 row of its mode, paired by round."""
    cmd = [sys.executable, "benchmarks/tp_throughput.py", "--smoke", "--tp", "2", "--rounds", "3", "--sd", "3_2_4",
           "--overlap", "on", "off"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("over 3 rounds") == 12  # 2 TPs x 3 modes x 2 batches
    rounds = [ln for ln in done.stdout.splitlines() if ln.startswith("round ")]  # each round as it ends, rank 0's
    assert [ln.split(",")[0] for ln in rounds] == [f"round {r}/3" for _ in (1, 4) for r in (1, 2, 3)]
    assert all(ln.count("ms/step") == 1 and ln.count("TP=") == 6 for ln in rounds), rounds
    head_line = next(ln for ln in done.stdout.splitlines() if ln.startswith("| tp"))
    head = [c.strip() for c in head_line.strip("|").split("|")]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in table]
    assert sorted((r["tp"], r["batch"], r["mode"]) for r in rows) == sorted(
        (t, b, m) for t in ("1", "2") for b in ("1", "4") for m in ("plain", "plain serial", "3_2_4")
    )
    assert all(r["equal"] == ("-" if (r["tp"], r["mode"]) == ("1", "plain") else "yes") for r in rows)
    assert all((r["x TP=1"] == "-") == (r["tp"] == "1") for r in rows)
    assert all(float(r["x TP=1"].rstrip("x")) > 0 for r in rows if r["tp"] == "2")


def test_rounds_refuse_what_they_cannot_interleave(tmp_path):
    script = [sys.executable, "benchmarks/tp_throughput.py", "--smoke"]
    for extra, words in ((["--rounds", "0"], "--rounds must be >= 1"),
                         (["--rounds", "2", "--profile", str(tmp_path)], "one round"),
                         (["--chain-max-weight", "1000"], "--chain-max-weight needs --chain"),
                         (["--chain", "--chain-max-weight", "-1"], "must be >= 0")):  # fmt: skip
        done = subprocess.run(script + extra, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and words in done.stderr, done.stderr


@pytest.mark.slow
def test_chain_variants_run_beside_the_default_engines_over_models_of_their_own():
    """--chain-variants 0 1000 (with --rounds): TP=1 and TP=2 plain engines with the decode chain, all weights and
    those of at most 1,000 elements, in the same interleaved rounds as the default plain engines; each emits TP=1
    plain's tokens (fp32 on CPU), TP=2's rows are paired with TP=1's of their mode, every chain row priced against
    plain."""
    cmd = [sys.executable, "benchmarks/tp_throughput.py", "--smoke", "--rounds", "2", "--chain-variants", "0", "1000"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    head_line = next(ln for ln in done.stdout.splitlines() if ln.startswith("| tp"))
    head = [c.strip() for c in head_line.strip("|").split("|")]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in table]
    modes = ("plain", "plain chain", "plain chain<=1000")
    assert sorted((r["tp"], r["batch"], r["mode"]) for r in rows) == sorted(
        (t, b, m) for t in ("1", "2") for b in ("1", "4") for m in modes
    )
    assert all(r["equal"] == ("-" if (r["tp"], r["mode"]) == ("1", "plain") else "yes") for r in rows)
    assert all((r["x TP=1"] == "-") == (r["tp"] == "1") for r in rows)
    assert all(r["SD/plain step"].endswith("x") for r in rows if r["mode"] != "plain")
    rounds = [ln for ln in done.stdout.splitlines() if ln.startswith("round ")]
    assert all(ln.count("TP=") == 6 for ln in rounds), rounds  # 2 TPs x 3 modes in every round
    refused = subprocess.run([*cmd[:3], "--chain-variants", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--rounds 2 or more" in refused.stderr
