"""`python -m tlt_rt COMMAND`: one entry point that hands each command's arguments to its module."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

import tlt_rt.__main__ as front


def test_help_lists_every_command_and_each_module_has_a_main(capsys):
    assert front.main([]) == 0 and front.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (module, what) in front.COMMANDS.items():
        assert f"  {name}" in out and what in out
        assert callable(importlib.import_module(module).main), module
    assert front.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "no command 'nope'" in err and "drafter-warmup" in err


def test_a_command_gets_its_arguments_and_its_exit_status(capsys):
    assert front.main(["config", "configs/smollm2-arith.yaml", "rl.steps=3", "rollout.max_batch=7"]) == 0
    out = capsys.readouterr().out
    assert "steps: 3" in out and "max_batch: 7" in out
    assert front.main(["config", "configs/smollm2-arith.yaml", "rl.nope=1"]) == 2  # the module's own error status
    assert "nope" in capsys.readouterr().err
    assert front.main(["fetch", "--help"]) == 0  # argparse's exit, passed on
    assert "--find-links" in capsys.readouterr().out


def test_a_message_exit_is_printed_and_fails(monkeypatch, capsys):
    def main(argv):
        raise SystemExit(f"cannot do {argv}")

    monkeypatch.setitem(front.COMMANDS, "x", ("fake_cmd", "a fake"))
    monkeypatch.setitem(sys.modules, "fake_cmd", types.SimpleNamespace(main=main))
    assert front.main(["x", "a"]) == 1 and "cannot do ['a']" in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m_runs_it():
    done = subprocess.run([sys.executable, "-m", "tlt_rt", "config", "--help-config"], capture_output=True, text=True)
    assert done.returncode == 0 and "rollout" in done.stdout


def test_program_prints_each_node_with_its_tensors_and_the_lowering(capsys):
    assert front.main(["program", "3_2_5", "--batch", "2", "--shape", "smollm2-135m", "--mode", "sampled"]) == 0
    out = capsys.readouterr().out
    nodes = [line.split()[1] for line in out.splitlines() if line.startswith("%")]
    assert nodes == ["CATCHUP", "LEVEL", "LEVEL", "RERANK", "VERIFY", "ACCEPT", "COMMIT", "OUTPUT"]
    assert "logits[2,5,49152]:act" in out and "temperature[2]:f32" in out and "window[2,4,576]:act" in out
    assert "  LEVEL   -> level" in out
    assert front.main(["program", "plain", "--shape", "qwen2.5-coder-0.5b"]) == 0
    plain = capsys.readouterr().out
    assert [line.split()[1] for line in plain.splitlines() if line.startswith("%")] == [
        "ROOT", "VERIFY", "ACCEPT", "COMMIT", "OUTPUT"]  # fmt: skip
    assert "logits[4,1,151936]" in plain
    assert front.main(["program", "3_2_99"]) == 2  # an impossible strategy: the reason, no trace
    assert "verify_tokens must be <= 11" in capsys.readouterr().err
    assert front.main(["program", "3_2_5", "--rows", "2"]) == 2
    assert "rows=2" in capsys.readouterr().err
