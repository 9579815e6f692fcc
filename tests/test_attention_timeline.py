"""benchmarks/attention_timeline.py's reading of decode attention's time stamps (the stamps themselves need a GPU:
`kernels.probe` under the sm_90 compile check, the script on the device)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from attention_timeline import layer_phases, plot_layer, step_phases  # noqa: E402


def launch(release: int, programs: int = 4, merger: int = 2) -> torch.Tensor:
    """Stamps (ns) of a launch whose programs were placed 3 us before `release`, released 100 ns apart, read q/k/v
    1 us later, attended 2 us after that, arrived 500 ns later; program `merger` merged 1.5 us after arriving."""
    rows = []
    for p in range(programs):
        rel = release + 100 * p
        rows.append([release - 3000, rel, rel + 1000, rel + 3000, rel + 3500, 0, 0, 0])
    rows[merger][5] = rows[merger][4] + 1500
    return torch.tensor(rows, dtype=torch.int64)


def test_phases_of_one_layer_and_the_rest_to_the_next():
    a, b = launch(10_000), launch(30_000)
    phases = layer_phases(a, next_release=int(b[:, 1].min()))
    assert phases["waited"] == pytest.approx(3.15)  # median of 3.0, 3.1, 3.2, 3.3
    assert phases["skew"] == pytest.approx(0.3)
    assert (phases["q/k/v"], phases["attend"], phases["arrive"], phases["merge"]) == pytest.approx((1, 2, 0.5, 1.5))
    end = 10_000 + 200 + 3500 + 1500  # the merger's merge
    assert phases["span"] == pytest.approx((end - 10_000) / 1e3)
    assert phases["rest"] == pytest.approx((30_000 - end) / 1e3)


def test_step_medians_over_layers_and_the_last_layer_has_no_rest():
    launches = [launch(10_000 + 20_000 * i, merger=i % 4) for i in range(5)]
    launches[2][:, 3] += 4000  # one slow layer: its attend 6 us, the median stays 2
    summary, per_layer = step_phases(launches)
    assert len(per_layer) == 5 and math.isnan(per_layer[-1]["rest"])
    assert per_layer[2]["attend"] == pytest.approx(6.0)
    assert summary["attend"] == pytest.approx(2.0)
    assert not math.isnan(summary["rest"])


def test_missing_stamps_are_an_error_not_zeros():
    st = launch(10_000)
    st[1, 1] = 0  # a program that never stamped its release (the buffer not zeroed / not replayed)
    with pytest.raises(ValueError, match="missing"):
        layer_phases(st)


def test_plot_of_one_layer(tmp_path):
    out = tmp_path / "t.png"
    plot_layer(launch(10_000, programs=6), str(out), "a layer")
    assert out.stat().st_size > 2000


def test_stamps_hand_out_slots_in_launch_order_and_refuse_past_the_end():
    from tlt_rt.codegen.kernels.probe import Stamps

    st = Stamps("cpu", size=40)
    assert st.take(2, 8) == 0 and st.take(3, 8) == 16  # a launch of 2 programs, then one of 3
    st.buf[16:40] = torch.arange(24)
    first, second = st.read()
    assert first.shape == (2, 8) and second.shape == (3, 8)
    assert second[2, 7].item() == 23
    with pytest.raises(ValueError, match="full"):
        st.take(1, 8)
