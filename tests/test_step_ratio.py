"""benchmarks/step_ratio.py on a CPU: the rollout settings `--engine` hands both engines, parsed by their types,
and a bad one refused before any engine is built. The rounds themselves need a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_ratio import engine_options, main  # noqa: E402


def test_engine_options_parse_each_setting_by_its_type():
    got = engine_options(["decode_chain=true", "pdl=true", "max_batch=4", "attn_backend=torch"])
    assert got == {"decode_chain": True, "pdl": True, "max_batch": 4, "attn_backend": "torch"}
    assert engine_options([]) == {}


@pytest.mark.parametrize("pair", ["chain=true", "decode_chain", "=1"])
def test_a_bad_engine_setting_stops_before_any_engine(pair, monkeypatch):
    def no_engine(*a, **k):
        raise AssertionError("an engine was built")

    monkeypatch.setattr("step_ratio.make_engine", no_engine)
    with pytest.raises(SystemExit, match="expected KEY=VALUE with KEY a rollout setting"):
        main(["--engine", pair])


def test_an_unknown_model_stops_before_any_engine(monkeypatch, capsys):
    monkeypatch.setattr("step_ratio.make_engine", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit) as e:
        main(["--model", "no-such-model"])
    assert e.value.code == 2 and "not a shape" in capsys.readouterr().err
