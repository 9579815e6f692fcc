"""tools/check_imports.py, which `make lint` runs: import circles, and the packages' layers."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import check_imports as ci  # noqa: E402


def test_the_package_today_has_no_circle_and_no_import_upwards(capsys):
    assert ci.main([]) == 0
    assert "no package imports one above it" in capsys.readouterr().out


def test_an_import_upwards_or_sideways_fails_and_a_known_one_must_still_exist():
    graph = {
        "tlt_rt.rollout.engine": {"tlt_rt.codegen.backend", "tlt_rt.train.loop"},  # down: fine; up: not
        "tlt_rt.ir.program": {"tlt_rt.models.llama"},  # two packages of one layer
        "tlt_rt.models.llama": {"tlt_rt.codegen.kernels.rope_cache"},  # known
        "tlt_rt.report": {"tlt_rt.compare", "tlt_rt.train.loop"},
        "tlt_rt.newpkg.x": set(),
    }
    errors = ci.layer_errors(graph, {("tlt_rt.models.llama", "tlt_rt.codegen.kernels.rope_cache"): "why",
                                     ("tlt_rt.models.llama", "tlt_rt.codegen.gone"): "why"})  # fmt: skip
    assert any(e.startswith("tlt_rt.rollout.engine imports tlt_rt.train.loop: train is in a higher") for e in errors)
    assert any(e.startswith("tlt_rt.ir.program imports tlt_rt.models.llama: models is in its own") for e in errors)
    assert any("no longer imports tlt_rt.codegen.gone" in e for e in errors)
    assert any("'newpkg' has no place in LAYERS" in e for e in errors)
    assert len(errors) == 4, errors


def test_circles_are_found_with_a_path_through_them():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    found = ci.cycles(graph)
    assert found == [["a", "b", "c"], ["e"]]
    assert ci.path_through(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
