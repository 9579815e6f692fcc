"""benchmarks/eager_profile.py on a CPU: the scripted schedule (plain steps, one speculative step that catches the
drafter up, plain steps again), its phase timings and the two profiles it writes. The timings mean something on
a GPU only; here the run must complete, time every phase and say how far behind the drafter was."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tlt_rt.models import CausalLM, save_target
from tlt_rt.models.arch import ArchConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from eager_profile import main  # noqa: E402

TINY = ArchConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)  # fmt: skip


def test_the_script_runs_one_catch_up_step_after_the_plain_stretch_and_profiles_both_phases(tmp_path, capsys):
    folder = save_target(CausalLM(TINY), tmp_path / "tiny")
    out = tmp_path / "prof"
    batch, plain = 3, 5
    argv = ["--model", str(folder), "--device", "cpu", "--batch", str(batch), "--prompt-len", "6",
            "--plain-steps", str(plain), "--strategy", "3_1_4", "--out", str(out), "--rounds", "2"]  # fmt: skip
    assert main(argv) == 0
    rec = json.loads((out / "eager_profile.json").read_text())
    # on a CPU the torch backend has no prefill kernel: one variant, the reference
    assert set(rec["ms"]) == {"plain step", "prefill phase (torch)", "3_1_4 step with catch-up (torch)"}
    assert all(ms > 0 for ms in rec["ms"].values())
    # every sequence made `plain` rows in plain steps that the drafter has not seen
    assert rec["behind_rows"] >= batch * plain
    for name in ("prefill.txt", "catchup.txt"):
        assert "top host operators" in (out / name).read_text()
    assert "| 3_1_4 step with catch-up | torch |" in capsys.readouterr().out
