"""benchmarks/gpu_one.sh, the one-GPU pass, run with a stand-in `python` that records each call and writes the
warm-up's report: the parts run in order, each given what the one before made, and a pass whose warm-up made no
drafter stops before the runs that need one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

STUB = """#!/bin/bash
if [[ "$1" == "-" ]]; then exec python3 "$@"; fi  # the passes' own small scripts (best_warmup) run for real
echo "python $*" >> "$CALLS"
if [[ "$*" == *step_ratio.py* ]]; then echo "where $PWD $PYTHONPATH" >> "$CALLS"; fi
if [[ "$*" == *--warmup-only* && -z "$NO_DRAFTER" ]]; then
  out=$(echo "$*" | sed -E 's/.*--out ([^ ]+).*/\\1/'); mkdir -p "$out/drafter"
  after=4.0; [[ "$out" == *w05b ]] && after=5.0  # a second 0.5B warm-up does better
  [[ "$out" == */w0 && -n "$W0_WORSE" ]] && after=3.0  # the first 1.5B warm-up does worse
  printf '{"accept_length": {"1": {"after": %s, "ceiling": 7.0}}}' "$after" > "$out/drafter/warmup.json"
fi
"""


def _stubbed(tmp_path: Path, **env: str) -> tuple[dict, Path]:
    """(environment, call log): `python` on PATH is the STUB, which logs each call's arguments to the log."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python").write_text(STUB)
    (stub / "python").chmod(0o755)
    calls = tmp_path / "calls.log"
    return {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "CALLS": str(calls), **env}, calls


def _pass(tmp_path: Path, script: str = "gpu_one.sh", models=("/m/q15.gguf",), **env: str) -> tuple[list[str], str]:
    full_env, calls = _stubbed(tmp_path, **env)
    out = tmp_path / "out"
    subprocess.run(["bash", str(REPO / "benchmarks" / script), str(out), *models], cwd=REPO, env=full_env,
                   check=True, capture_output=True, timeout=30)  # fmt: skip
    main = out / "main.log"
    deadline = time.time() + 60
    while time.time() < deadline and not any(w in (main.read_text() if main.exists() else "")
                                             for w in ("all done", "no drafter", "no warm-up")):  # fmt: skip
        time.sleep(0.2)
    return calls.read_text().splitlines(), main.read_text()


def _halves(calls: list[str]) -> tuple[str, str]:
    """The two halves' `gpu` test calls (named files; every other file), asserting that every file named in the
    first is ignored by the second, and the TP test besides: each test file runs in exactly one of them."""
    halves = [c for c in calls if "-m gpu" in c and not c.endswith(" tests/test_tp_gpu.py")]
    assert len(halves) == 2
    first = next(c for c in halves if "--ignore" not in c)
    rest = next(c for c in halves if "--ignore" in c)
    named = {w for w in first.split() if w.startswith("tests/")}
    ignored = {w.split("=", 1)[1] for w in rest.split() if w.startswith("--ignore=")}
    assert named and ignored == named | {"tests/test_tp_gpu.py"}
    return first, rest


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_one_runs_its_parts_in_order_on_the_warm_drafter(tmp_path):
    calls, main = _pass(tmp_path, PROFILE="1")
    assert "all done" in main
    kinds = [next((k for k in ("convert_gguf", "learner_step.py", "-m gpu", "--warmup-only", "e2e_rl.py --config",
                               "engine_throughput", "bench_attention", "bench_linear", "step_costs") if k in c), c)
             for c in calls]  # fmt: skip
    assert kinds[:2] == ["convert_gguf", "learner_step.py"] and set(kinds[2:4]) == {"-m gpu", "--warmup-only"}
    assert kinds[4:6] == ["e2e_rl.py --config", "engine_throughput"]
    assert kinds[6:] == ["bench_attention", "bench_linear", "step_costs", "step_costs", "step_costs"]  # no learner
    drafter = str(tmp_path / "out" / "w0" / "drafter")
    assert f"--drafter {drafter}" in calls[4] and f"--drafter {drafter}" in calls[5]
    warm = calls[kinds.index("--warmup-only")]
    wanted = ("--warmup-prompts 1024", "--warmup-max-new-tokens 512", "--warmup-epochs 3", "--warmup-curve 4",
              "--warmup-arg=--also-strategies=default")  # fmt: skip
    assert all(a in warm for a in wanted)
    assert "rl.compile_layers=false" in calls[1] and "model.path=/m/q15.gguf" in calls[4]


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_one_stops_before_the_runs_when_the_warm_up_made_no_drafter(tmp_path):
    calls, main = _pass(tmp_path, NO_DRAFTER="1", LEARNER_STEP="0")
    assert "no drafter" in main and "all done" not in main
    assert not [c for c in calls if "learner_step.py" in c or "engine_throughput" in c or "--drafter" in c]


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_x2_with_the_tests_in_phase_2_and_no_killed_worker(tmp_path):
    """GPU1=tests runs the `gpu` tests beside the one-GPU comparison instead of the interleaved benchmark, and
    not again in phase 4; KILL=0 leaves the killed worker out; VARIANT0 / VARIANT1 replace the warm-ups."""
    calls, main = _pass(tmp_path, "gpu_x2.sh", GPU1="tests", KILL="0", VARIANT0="--warmup-prompts 768",
                        VARIANT1="--warmup-prompts 1024 --warmup-epochs 3")  # fmt: skip
    assert "all done" in main
    warm = sorted((c for c in calls if "--warmup-only" in c), key=lambda c: "/w1 " in c)  # they start at once
    assert len(warm) == 2 and "/w0 " in warm[0] and warm[0].endswith("--warmup-prompts 768 -- model.path=/m/q15.gguf")
    assert "/w1 " in warm[1] and "--warmup-prompts 1024 --warmup-epochs 3 --" in warm[1]
    runs = [c for c in calls if "e2e_rl.py --config" in c and "--warmup-only" not in c]
    assert [("2gpu" in c) for c in runs] == [False, True]
    assert all(f"--drafter {tmp_path / 'out' / 'w0' / 'drafter'}" in c for c in runs)
    tests = [i for i, c in enumerate(calls) if "-m gpu" in c]
    assert len(tests) == 1 and tests[0] < calls.index(runs[1])  # beside the one-GPU run, before the two-GPU one
    assert not [c for c in calls if "engine_throughput" in c or "tlt_rt.train" in c]
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(subprocess.CalledProcessError):
        _pass(bad, "gpu_x2.sh", GPU1="nope")


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_x4_warms_up_twice_beside_the_tests_then_runs_four_workers_then_tp4(tmp_path):
    """The 4-GPU run: two 1.5B warm-ups (the config's passes, five passes) beside the tests' two halves and the TP
    test; then the four-worker comparison on the better drafter, trained online with its own passes; then TP=4 on
    the 32B shape. Nothing of the optional phase 2 by default."""
    calls, main = _pass(tmp_path, "gpu_x4.sh", TP_SCALE="0.25")
    assert "all done" in main and "tests done" in main
    first, rest = _halves(calls)
    where = {k: next(i for i, c in enumerate(calls) if k in c) for k in
             ("convert_gguf", "--warmup-only", "4gpu.yaml", "tp_throughput.py")}  # fmt: skip
    tp_test = next(i for i, c in enumerate(calls) if c.endswith(" tests/test_tp_gpu.py"))
    assert max(calls.index(first), calls.index(rest), tp_test, where["--warmup-only"]) < where["4gpu.yaml"]
    assert where["4gpu.yaml"] < where["tp_throughput.py"]
    warm = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1]: c for c in calls if "--warmup-only" in c}
    assert set(warm) == {"w0", "w1"} and all(calls.index(c) > where["convert_gguf"] for c in warm.values())
    assert all("--warmup-prompts 3072" in c and "--warmup-epochs 1.5" in c and "--gen-batch=512" in c
               for c in warm.values())  # fmt: skip
    assert "--unroll" not in warm["w0"] and "--warmup-arg=--unroll=5 --" in warm["w1"]
    # the stand-in warm-ups tie: the first wins, so the runs keep the config's passes
    e2e = calls[where["4gpu.yaml"]]
    assert f"--drafter {tmp_path / 'out' / 'w0' / 'drafter'} " in e2e and "drafter.unroll" not in e2e
    assert "--steps 20 --time-limit 540" in e2e
    tp = calls[where["tp_throughput.py"]]
    assert "--shape qwen2.5-32b --tp 4 --scale 0.25 --batch 1 32" in tp and "--allreduce nccl oneshot" in tp
    assert not [c for c in calls if "engine_throughput" in c or "cluster.debug_fail" in c or "q05" in c]


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_x4_runs_online_with_the_passes_of_the_chosen_warm_up(tmp_path):
    """The second warm-up (five passes) scores higher: the four-worker runs take its drafter and train it online
    with five passes, a pair per seed with the policy held still; TESTS=0, TP=0 leave the tests and TP=4 out,
    AUTO_OFF=1 and KILL=1 add phase 2."""
    calls, main = _pass(tmp_path, "gpu_x4.sh", TESTS="0", TP="0", AUTO_OFF="1", KILL="1", W0_WORSE="1",
                        W15B_ARGS="--warmup-arg=--unroll=5 --warmup-arg=--held-out=64", E2E4_SEEDS="1 2",
                        E2E4_HOLD="1")  # fmt: skip
    assert "all done" in main and "tests done" not in main
    assert not [c for c in calls if "-m gpu" in c or "tp_throughput.py" in c]
    e2e = next(c for c in calls if "4gpu.yaml" in c)
    assert f"--drafter {tmp_path / 'out' / 'w1' / 'drafter'} " in e2e and e2e.endswith("drafter.unroll=5")
    assert "--seeds 1 2 --hold-policy --" in e2e
    timed = next(i for i, c in enumerate(calls) if "engine_throughput" in c)
    killed = next(i for i, c in enumerate(calls) if "cluster.debug_fail" in c)
    assert max(timed, killed) < calls.index(e2e)
    assert f"--drafter {tmp_path / 'out' / 'w1' / 'drafter'} " in calls[timed]


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_drafter_x4_warms_both_models_and_times_each_drafter(tmp_path):
    """The drafter pass: two 1.5B warm-ups and one 0.5B warm-up, each on its own GPU and its model's config; the
    1.5B drafter with the higher accept / ceiling (the first, on a tie) serves both 1.5B timings, the 0.5B
    drafter the 0.5B one."""
    calls, main = _pass(tmp_path, "gpu_drafter_x4.sh", models=("/m/q15.gguf", "/m/q05.gguf"))
    assert "all done" in main
    warm = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1]: c for c in calls if "--warmup-only" in c}
    assert set(warm) == {"w0", "w1", "w05"}
    assert "qwen2.5-0.5b" in warm["w05"] and warm["w05"].endswith("model.path=/m/q05.gguf")
    assert "--warmup-prompts 2048 --warmup-epochs 2 " in warm["w0"] and "--warmup-prompts 3072" in warm["w1"]
    assert all("--warmup-arg=--gen-batch=512" in c for c in warm.values())
    timed = [c for c in calls if "engine_throughput" in c and "--drafter" in c]
    assert len(timed) == 3
    out = tmp_path / "out"
    for c in timed:
        drafter = out / ("w05" if "q05" in c else "w0") / "drafter"
        assert f"--drafter {drafter} " in c and "--interleave" in c
    chains = next(c for c in timed if "chains" in c)
    assert "--batch 32 128" in chains and "4_1_5 3_1_4" in chains.split("--strategies")[1]
    assert any("-m gpu" in c for c in calls) and any("--profile 25" in c for c in calls)


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_drafter_one_warms_the_small_model_then_times_its_drafter(tmp_path):
    calls, main = _pass(tmp_path, "gpu_drafter_one.sh", models=("/m/q05.gguf",))
    assert "all done" in main
    warm = [c for c in calls if "--warmup-only" in c]
    assert len(warm) == 1 and "qwen2.5-0.5b" in warm[0] and "--warmup-prompts 5120 --warmup-epochs 1.3 " in warm[0]
    timed = [c for c in calls if "engine_throughput" in c]
    assert len(timed) == 1 and f"--drafter {tmp_path / 'out' / 'w05' / 'drafter'} " in timed[0]
    assert any("-m gpu" in c for c in calls)


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
@pytest.mark.parametrize("tp", ["1", "0"])
def test_gpu_check_x2_without_models_runs_the_tests_then_the_house_ratios_then_the_tp_rows(tmp_path, tp):
    """Every `gpu` test file in exactly one of the two halves with the TP test beside them; without the GGUFs no
    warm-up and no timing of a model, the house ratios after the tests, the TP rows last unless TP=0."""
    before = tmp_path / "before"
    (before / "benchmarks").mkdir(parents=True)
    calls, main = _pass(tmp_path, "gpu_check_x2.sh", models=(), TP=tp, HOUSE=os.path.relpath(before, REPO))
    assert "all done" in main
    # a relative HOUSE is made absolute: each run of the earlier checkout starts in it and imports from it
    where = [c.split()[1:] for c in calls if c.startswith("where ")]
    assert sorted(w[0] == str(before) and w[1].endswith(f":{before}") for w in where) == [False, False, True, True]
    first, rest = _halves(calls)
    tp_test = next(i for i, c in enumerate(calls) if c.endswith(" tests/test_tp_gpu.py"))
    assert not [c for c in calls if "--warmup-only" in c or "engine_throughput" in c or "tlt_rt.train" in c]
    ratios = [i for i, c in enumerate(calls) if "step_ratio.py" in c]
    assert len(ratios) == 4 and min(ratios) > max(tp_test, calls.index(first), calls.index(rest))
    rows = [i for i, c in enumerate(calls) if "tp_throughput.py" in c]
    if tp == "1":
        assert len(rows) == 1 and rows[0] > max(ratios) and "--shape qwen2.5-7b --tp 2" in calls[rows[0]]
    else:
        assert not rows


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_check_x2_with_models_tests_then_drafters_and_timings_then_tp(tmp_path):
    """With both GGUFs: the tests first; then the 1.5B warm-up, its auto / off timing (a lone prompt's prefill
    captured) and its prefill profile, beside the 0.5B's warm-up, timing and the house ratios; the TP rows and the
    TP=2 RL run on the 1.5B warm-up's drafter last."""
    before = tmp_path / "before"
    (before / "benchmarks").mkdir(parents=True)
    calls, main = _pass(tmp_path, "gpu_check_x2.sh", models=("/m/q15.gguf", "/m/q05.gguf"), HOUSE=str(before))
    assert "all done" in main
    out = tmp_path / "out"
    first, rest = _halves(calls)
    tests_end = max(calls.index(first), calls.index(rest),
                    next(i for i, c in enumerate(calls) if c.endswith(" tests/test_tp_gpu.py")))  # fmt: skip
    warm = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1]: c for c in calls if "--warmup-only" in c}
    assert set(warm) == {"w0", "w05"} and all(calls.index(c) > tests_end for c in warm.values())
    assert "q05" in warm["w05"] and "0.5b" in warm["w05"] and "q15" in warm["w0"]  # its rate: the config's
    timed = {("q05" if "q05" in c else "q15"): c for c in calls if "engine_throughput" in c}
    assert f"--drafter {out / 'w05' / 'drafter'} " in timed["q05"]
    assert f"--drafter {out / 'w0' / 'drafter'} " in timed["q15"]
    assert all(c.endswith("--prefill-graph-tokens 256") for c in timed.values())
    assert len([c for c in calls if "step_ratio.py" in c]) == 4
    assert calls.index(next(c for c in calls if "step_ratio.py" in c)) > calls.index(timed["q05"])
    rows = next(i for i, c in enumerate(calls) if "tp_throughput.py" in c)
    rl = next(i for i, c in enumerate(calls) if "tlt_rt.train" in c)
    assert rows > max(i for i, c in enumerate(calls) if "engine_throughput" in c or "step_ratio.py" in c)
    assert rl > rows and "cluster.tensor_parallel=2" in calls[rl]
    assert f"drafter.path={out / 'w0' / 'drafter'}" in calls[rl]
    prefill = [c for c in calls if "prefill_cost.py" in c]
    assert len(prefill) == 1 and "--graph-tokens 256" in prefill[0]


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_check_x2_with_tests_0_goes_straight_to_the_drafters(tmp_path):
    calls, main = _pass(tmp_path, "gpu_check_x2.sh", models=("/m/q15.gguf", "/m/q05.gguf"), TESTS="0", TP="0",
                        W15_ARGS="--warmup-arg=--unroll=5")  # fmt: skip
    assert "all done" in main and "tests on GPU" not in main
    assert not [c for c in calls if "-m gpu" in c]
    warm = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1]: c for c in calls if "--warmup-only" in c}
    assert set(warm) == {"w0", "w05"}
    assert "--warmup-arg=--gen-batch=512 --warmup-arg=--unroll=5 --" in warm["w0"] and "--unroll" not in warm["w05"]


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_check_x2_with_a_second_small_warm_up_and_a_fresh_drafter_under_tp(tmp_path):
    """W05B_ARGS: two 0.5B warm-ups side by side (the second with its own arguments and prompt count), each timed
    against off, no 1.5B warm-up; the TP=2 RL run then trains a fresh drafter, speculation left to the policy."""
    calls, main = _pass(tmp_path, "gpu_check_x2.sh", models=("/m/q15.gguf", "/m/q05.gguf"), TESTS="0",
                        W05B_ARGS="--warmup-arg=--unroll=5", WARMUP_PROMPTS05B="8192", TP_ROWS="0")  # fmt: skip
    assert "all done" in main
    out = tmp_path / "out"
    warm = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1]: c for c in calls if "--warmup-only" in c}
    assert set(warm) == {"w05", "w05b"} and all("q05" in c and "0.5b" in c for c in warm.values())
    assert "--warmup-arg=--unroll=5" in warm["w05b"] and "--unroll" not in warm["w05"]
    assert "--warmup-prompts 8192" in warm["w05b"] and "--warmup-prompts 6144" in warm["w05"]
    timed = [c for c in calls if "engine_throughput" in c]
    assert sorted(c.split("--drafter ")[1].split()[0] for c in timed) == [
        str(out / w / "drafter") for w in ("w05", "w05b")
    ]
    assert not [c for c in calls if "prefill_cost.py" in c or "step_ratio.py" in c or "tp_throughput.py" in c]
    rl = [c for c in calls if "tlt_rt.train" in c]
    assert len(rl) == 1 and "rollout.speculative" not in rl[0] and "drafter.path" not in rl[0]
    assert calls.index(rl[0]) > max(calls.index(c) for c in timed)


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
@pytest.mark.parametrize("tp,glue", [("1", "1"), ("0", "0"), ("1", "0")])
def test_gpu_check_x4_runs_tests_drafters_timings_and_tp_in_their_order(tmp_path, tp, glue):
    """Every `gpu` test file in one of two halves on GPUs 2 and 3 with the TP test beside them, the glue variants of
    both checkpoints' decode steps after the first half with GLUE=1; the TP rows once the halves and the TP test are
    done, then the TP=2 RL run (on the 1.5B warm-up's drafter) unless TP=0; the 0.5B timing on its warm-up's
    drafter."""
    calls, main = _pass(tmp_path, "gpu_check_x4.sh", models=("/m/q15.gguf", "/m/q05.gguf"), TP=tp, GLUE=glue)
    assert "all done" in main
    out = tmp_path / "out"
    first, rest = _halves(calls)
    assert "tests/test_qwen_gpu.py" in first and "--ignore=tests/test_qwen_gpu.py" in rest  # the real-Qwen tests: in
    # the first half; the second takes every file the first does not name
    warm = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1]: c for c in calls if "--warmup-only" in c}
    assert set(warm) == {"w0", "w05"}
    assert "--warmup-epochs 1.5 " in warm["w05"] and "q05" in warm["w05"] and "--lr" not in warm["w05"]
    timed = {("q05" if "q05" in c else "q15"): c for c in calls if "engine_throughput" in c}
    assert f"--drafter {out / 'w05' / 'drafter'} " in timed["q05"]
    assert f"--drafter {out / 'w0' / 'drafter'} " in timed["q15"]
    assert all(c.endswith("--prefill-graph-tokens 256") for c in timed.values())  # a lone prompt's prefill captured
    tp_test = next(i for i, c in enumerate(calls) if c.endswith(" tests/test_tp_gpu.py"))
    glue_calls = [i for i, c in enumerate(calls) if "step_costs.py" in c]
    if glue == "1":
        assert len(glue_calls) == 2 and all(i > calls.index(first) for i in glue_calls)
        assert "--compare base fused-norm rope-attn fused fused+skinny" in calls[glue_calls[0]]
        assert "q15" in calls[glue_calls[0]]
    else:
        assert not glue_calls
    rows = [i for i, c in enumerate(calls) if "tp_throughput.py" in c]
    rl = [i for i, c in enumerate(calls) if "tlt_rt.train" in c]
    if tp == "1":
        assert len(rows) == 1 and "--allreduce nccl oneshot" in calls[rows[0]]
        assert rows[0] > max(tp_test, calls.index(first), calls.index(rest), *glue_calls)
        assert len(rl) == 1 and "cluster.tensor_parallel=2" in calls[rl[0]] and rl[0] > rows[0]
        assert rl[0] > max(i for i, c in enumerate(calls) if "engine_throughput" in c)  # after both timings
        assert f"drafter.path={out / 'w0' / 'drafter'}" in calls[rl[0]]
    else:
        assert not rows and not rl
    prefill = [c for c in calls if "prefill_cost.py" in c]
    assert len(prefill) == 1 and "--target /m/q15.gguf" in prefill[0] and "--profile" in prefill[0]
    assert "--graph-tokens 256" in prefill[0]


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_check_x4_times_step_ratios_before_and_after_a_change_of_the_house(tmp_path):
    """HOUSE=DIR: after the first test half, SmolLM2's SD / plain step ratios from the earlier checkout DIR and from
    this one, alternated twice, on GPU 3."""
    before = tmp_path / "before"
    (before / "benchmarks").mkdir(parents=True)
    calls, main = _pass(tmp_path, "gpu_check_x4.sh", models=("/m/q15.gguf", "/m/q05.gguf"), TP="0",
                        HOUSE=str(before))  # fmt: skip
    assert "all done" in main and "step ratios before / after" in main
    ratios = [c for c in calls if "step_ratio.py" in c]
    assert len(ratios) == 4 and all("--batch 1 32 --strategies 8_4_32 6_2_12" in c for c in ratios)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("house-*.log")) == [
        "house-after-1.log", "house-after-2.log", "house-before-1.log", "house-before-2.log"]  # fmt: skip
    first, _ = _halves(calls)
    assert calls.index(ratios[0]) > calls.index(first)


def test_house_before_writes_an_earlier_commits_code_out_of_git(tmp_path):
    """tools/house_before.sh REV: REV's package, benchmark scripts and configs in .device-before, ignored by git."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    script = clone / "tools" / "house_before.sh"
    script.write_text((REPO / "tools" / "house_before.sh").read_text())  # this checkout's, committed or not
    script.chmod(0o755)
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    env = {**os.environ, "PYTHON": sys.executable}  # the clone has no .venv of its own
    done = subprocess.run([str(script), rev], cwd=clone, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    before = clone / ".device-before"
    assert (before / "tlt_rt" / "__init__.py").is_file() and (before / "benchmarks" / "step_ratio.py").is_file()
    assert not (before / "tests").exists() and not list((before / "benchmarks").glob("*.md"))
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    assert ".device-before" not in status
    # a commit whose package does not import (a module it imports left out) is refused before any upload
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "rm", "-q", "tlt_rt/rollout/stats.py"], cwd=clone, check=True)
    subprocess.run([*git, "commit", "-qm", "broken"], cwd=clone, check=True)
    broken = subprocess.run([str(script), "HEAD"], cwd=clone, capture_output=True, text=True, timeout=120, env=env)
    assert broken.returncode == 1 and "does not import" in broken.stderr
    assert "stats" in (before / "import.log").read_text()
    assert subprocess.run([str(script), "no-such-rev"], cwd=clone, capture_output=True).returncode == 2
    assert subprocess.run([str(script), rev, "/tmp/elsewhere"], cwd=clone, capture_output=True).returncode == 2


def test_overlap_pass_runs_every_gpu_test_then_the_two_timings(tmp_path):
    """benchmarks/gpu_overlap.sh: `tests` runs both halves and the two-GPU TP tests (each test file once);
    `measure` times the 0.5B with its serial twins (speculative steps queued ahead, one strategy) and TP=2 with
    plain steps queued ahead and one at a time."""
    env, calls = _stubbed(tmp_path)
    script = str(REPO / "benchmarks" / "gpu_overlap.sh")
    for args in (["tests", str(tmp_path / "t")], ["measure", str(tmp_path / "m"), "/m/q05.gguf"]):
        subprocess.run(["bash", script, *args], cwd=REPO, env=env, check=True, capture_output=True, timeout=30)
    lines = calls.read_text().splitlines()
    _halves([c for c in lines if "-k graphs" not in c and "-k fused" not in c])
    assert sorted(c.split()[-1] for c in lines if c.endswith(("-k graphs", "-k fused"))) == ["fused", "graphs"]
    q05 = next(c for c in lines if "engine_throughput.py" in c)
    assert "--target /m/q05.gguf" in q05 and "--configs off off-serial auto auto-serial" in q05
    assert "--overlap-speculative" in q05 and "--strategies 8_4_32" in q05
    tp = [c for c in lines if "tp_throughput.py" in c]  # one process a batch size, the SD step at batch 1
    assert [c.split("--batch ")[1].split()[0] for c in tp] == ["1", "32"]
    assert all("--overlap on off" in c and "--rounds 3" in c for c in tp)
    assert "--sd 8_4_32 --overlap-speculative" in tp[0] and "--sd" not in tp[1]
    bad = subprocess.run(["bash", script, "measure", str(tmp_path / "x")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert bad.returncode == 2 and "GGUF" in bad.stderr


def test_overlap_pass_warms_a_drafter_then_times_auto_against_off_with_it(tmp_path):
    """benchmarks/gpu_overlap.sh trained: the 0.5B's drafter warmed up on its RL task (accept / ceiling printed), then
    auto over the engine's default strategies against off with that drafter, interleaved."""
    env, calls = _stubbed(tmp_path)
    out = tmp_path / "t"
    script = str(REPO / "benchmarks" / "gpu_overlap.sh")
    run = subprocess.run(["bash", script, "trained", str(out), "/m/q05.gguf"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=30, check=True)  # fmt: skip
    assert "accept / ceiling x1000 = 571" in run.stdout  # the stub's warm-up: 4.0 of a 7.0 ceiling
    lines = calls.read_text().splitlines()
    warm = next(c for c in lines if "--warmup-only" in c)
    assert "configs/qwen2.5-0.5b-math-gpu.yaml" in warm and "model.path=/m/q05.gguf" in warm
    assert f"--out {out}/w05" in warm and "--warmup-prompts 1024" in warm
    timing = next(c for c in lines if "engine_throughput.py" in c)
    assert f"--drafter {out}/w05/drafter" in timing and "--target /m/q05.gguf" in timing
    assert "--configs off auto --strategies 8_4_48 8_4_32 8_4_16 8_4_8 6_2_12" in timing and "--interleave" in timing
    assert "--batch 1 32 128" in timing
    bad = subprocess.run(["bash", script, "trained", str(tmp_path / "x")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert bad.returncode == 2 and "GGUF" in bad.stderr
    # in two calls: `warm` into W05 (a folder kept on the machine), then `trained` on it without warming up again
    calls.write_text("")
    kept = tmp_path / "kept" / "w05"
    for what in ("warm", "trained"):
        subprocess.run(["bash", script, what, str(tmp_path / what), "/m/q05.gguf"], cwd=REPO,
                       env={**env, "W05": str(kept)}, capture_output=True, timeout=30, check=True)  # fmt: skip
    lines = calls.read_text().splitlines()
    assert [c for c in lines if "--warmup-only" in c][0].count(f"--out {kept}") == 1
    assert sum("--warmup-only" in c for c in lines) == 1 and sum("engine_throughput.py" in c for c in lines) == 1
    assert f"--drafter {kept}/drafter" in next(c for c in lines if "engine_throughput.py" in c)


def test_rows_pass_times_the_chain_of_more_rows_on_both_shapes(tmp_path):
    """benchmarks/gpu_rows.sh: step_costs.py on the 1.5B's and 0.5B's shapes at batch 32 and 1 with verify rows, the
    one-row chain first (the baseline) and the chain of more rows with each kernel, profiled, on the GPU asked for."""
    env, calls = _stubbed(tmp_path)
    subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_rows.sh"), str(tmp_path / "r"), "1"], cwd=REPO, env=env,
                   check=True, capture_output=True, timeout=30)  # fmt: skip
    lines = [c for c in calls.read_text().splitlines() if "step_costs.py" in c]
    assert [c.split("--model ")[1].split()[0] for c in lines] == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
    for c in lines:
        assert "--compare pdl pdl-rows2 pdl-rows2:split:t=4" in c and "--batch 32 1" in c and "--verify 16 48" in c
        assert "--profile" in c and "--table 2624" in c
    # ATTN=1: decode attention's launch (programs an SM) after them; a model's variants left empty leave it out
    calls.write_text("")
    subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_rows.sh"), str(tmp_path / "a")], cwd=REPO, check=True,
                   env={**env, "ATTN": "1", "VARIANTS05": ""}, capture_output=True, timeout=30)  # fmt: skip
    lines = [c for c in calls.read_text().splitlines() if "step_costs.py" in c]
    assert len(lines) == 3 and "qwen2.5-coder-1.5b" in lines[0] and "pdl-rows2" in lines[0]
    swept = "pdl pdl:attn:tm=1 pdl:attn:tm=1,mt=4096 pdl:attn:mt=4096,r=128 pdl:attn:sw=4,mt=4096,r=128"
    assert all(f"--compare {swept}" in c for c in lines[1:])
    assert all("--batch 32 128 1" in c for c in lines[1:])
    # TREE=1 alone (both variant lists empty): tree attention's launch on the verify rows of both shapes
    calls.write_text("")
    tree_env = {**env, "TREE": "1", "VARIANTS15": "", "VARIANTS05": ""}
    subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_rows.sh"), str(tmp_path / "t")], cwd=REPO, check=True,
                   env=tree_env, capture_output=True, timeout=30)  # fmt: skip
    lines = [c for c in calls.read_text().splitlines() if "step_costs.py" in c]
    assert [c.split("--model ")[1].split()[0] for c in lines] == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
    assert all("--compare pdl pdl:tree:mt=4096 pdl:tree:bm=64 pdl:tree:bm=64,mt=4096" in c for c in lines)
    assert all("--batch 1 " in c and "--verify 16 48" in c for c in lines)
