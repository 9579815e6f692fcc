import json

import pytest

from tlt_rt.compare import main, run_means, write_compare


def _write_run(folder, step_seconds, rewards):
    folder.mkdir()
    with open(folder / "metrics.jsonl", "w") as f:
        for i, (s, r) in enumerate(zip(step_seconds, rewards, strict=True)):
            f.write(json.dumps({"step": i, "step_seconds": s, "rollout_seconds": s / 2, "reward_mean": r}) + "\n")


def test_means_leave_out_step_zero_and_speedup_is_against_the_first_run(tmp_path):
    _write_run(tmp_path / "off", [30.0, 10.0, 12.0], [0.1, 0.2, 0.3])
    _write_run(tmp_path / "auto", [40.0, 5.0, 6.0], [0.1, 0.25, 0.3])
    assert run_means([{"step": 0, "step_seconds": 9.0}])["step_seconds"] == 9.0  # a single step is kept
    path = write_compare([tmp_path / "off", tmp_path / "auto"], tmp_path / "cmp")
    text = path.read_text()
    rows = {
        line.split("|")[1].strip(): line
        for line in text.splitlines()
        if line.startswith("| off") or line.startswith("| auto")
    }
    assert "| 11.00 |" in rows["off"] and rows["off"].endswith("| 1.00x |")
    assert "| 5.50 |" in rows["auto"] and rows["auto"].endswith("| 2.00x |")  # 11.0 / 5.5
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 1000


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    _write_run(tmp_path / "a", [1.0], [0.0])
    with pytest.raises(ValueError, match="at least two"):
        write_compare([tmp_path / "a"], tmp_path / "o")
    assert main([str(tmp_path / "a"), str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
