"""tlt_rt.compile on CPU: profiles every (bucket, option), writes the cost table, engines pick it up."""

from __future__ import annotations

import json

import tlt_rt
from tlt_rt.compile import cost_path, engine_cost_key, profile
from tlt_rt.rollout.policy.costs import CostTable


def test_profile_and_cost_table_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE", str(tmp_path))
    from tests.helpers.engine import make_engine

    eng = make_engine("auto", ("3_3_8", "4_2_6"), max_batch=4)
    table, rows = profile(eng, ctx=16, iters=1, progress=False)
    assert {(r["bucket"], r["option"]) for r in rows} == {
        (b, o) for b in eng.buckets for o in ("off", "3_3_8", "4_2_6")
    }
    assert all(r["ms"] > 0 for r in rows)
    path = cost_path(engine_cost_key(eng))
    path.parent.mkdir(parents=True)
    table.save(path)
    assert json.loads(path.read_text())["key"]["model"]["hidden_size"] == 32
    # a new engine for the same model finds and uses the measured costs
    again = make_engine("auto", ("3_3_8", "4_2_6"), max_batch=4)
    loaded = again.policy.costs
    assert isinstance(loaded, CostTable)
    assert loaded.get(1, None) == table.get(1, None)
    assert callable(tlt_rt.compile)


def test_cli_help_and_config_errors(capsys):
    from tlt_rt.compile import main

    assert main(["--help"]) == 0
    assert "python -m tlt_rt.compile CONFIG" in capsys.readouterr().out
    assert main(["configs/smollm2-arith.yaml", "rollout.max_bach=4"]) == 2
    assert "rollout.max_batch" in capsys.readouterr().err


def test_engine_profiles_missing_costs_and_decides_from_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE", str(tmp_path))
    from tests.helpers.engine import PROMPTS, make_engine
    from tlt_rt.rollout import SamplingParams

    eng = make_engine("auto", ("3_3_8",), max_batch=4)
    assert len(eng.policy.costs) == 0
    eng.profile_costs(save=True, iters=1)
    assert len(eng.policy.costs) == 2 * len(eng.buckets)  # plain decoding and 3_3_8 in every bucket
    eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[]))
    assert eng.stats()["policy"]["measure_steps"] == 0  # nothing had to be tried just to learn its cost
    again = make_engine("auto", ("3_3_8",), max_batch=4)
    assert len(again.policy.costs) == 2 * len(eng.buckets)  # saved under the model's key and found
