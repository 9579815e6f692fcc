"""tlt_rt.train.profile: the summary of a profiled block (host side on a CPU; kernel rows from made-up events)."""

from types import SimpleNamespace

import torch

from tlt_rt.train.profile import caller_rows, exposed_by, kernel_kinds, kernel_rows, profiled, summary


def test_profiled_writes_the_host_operators_of_the_block(tmp_path):
    x = torch.randn(64, 64)
    out = tmp_path / "p" / "step.txt"
    with profiled(out, "a matmul", torch.device("cpu")):
        for _ in range(3):
            x = x @ x
    text = out.read_text()
    assert text.startswith("# a matmul") and "aten::mm" in text
    assert "kernels 0.000 s in 0 launches" in text  # no device on a CPU
    with profiled(None, "nothing", torch.device("cpu")):  # no path: nothing profiled, nothing written
        pass
    assert sorted(p.name for p in out.parent.iterdir()) == ["step.txt"]


def test_kernel_rows_sum_by_name_and_kinds_group_them():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = [SimpleNamespace(name=n, device_type=d, device_time=t, self_cpu_time_total=c) for n, d, t, c in [
        ("sm90_xmma_gemm_bf16", cuda, 300.0, 0.0), ("sm90_xmma_gemm_bf16", cuda, 200.0, 0.0),
        ("flash_fwd_kernel", cuda, 100.0, 0.0), ("triton_poi_fused_add", cuda, 50.0, 0.0),
        ("multi_tensor_apply_kernel<Adam>", cuda, 40.0, 0.0), ("weird", cuda, 10.0, 0.0),
        ("aten::mm", cpu, 0.0, 70.0),
    ]]  # fmt: skip
    rows = kernel_rows(ev)
    assert rows[0] == ("sm90_xmma_gemm_bf16", 500.0, 2) and len(rows) == 5
    assert kernel_rows(ev, device=False) == [("aten::mm", 70.0, 1)]
    kinds = kernel_kinds(rows)
    assert list(kinds) == ["matmul", "attention", "triton (fused glue)", "optimizer", "other"]
    assert kinds["matmul"] == 500.0 and kinds["other"] == 10.0
    text = summary("t", 0.002, rows, kernel_rows(ev, device=False))
    assert "kernels 0.001 s in 6 launches (35% of the wall time busy)" in text and "aten::mm" in text


def test_exposed_time_counts_overlapping_kernels_once():
    """Kernels placed while the one before runs (PDL) add only what reaches past it; a gap before a kernel is not
    its time; host events are left out."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start, end, device=cuda):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [
        ev("matmul", 0.0, 10.0),
        ev("attention", 6.0, 13.0),  # placed early: 3 of its 7 us exposed
        ev("matmul", 20.0, 30.0),  # after a 7 us gap: its 10 us
        ev("tiny", 22.0, 25.0),  # wholly inside the matmul: nothing exposed
        ev("aten::mm", 0.0, 100.0, cpu),
    ]
    rows = exposed_by(events, lambda name, _: name)  # a row a kernel name
    assert rows == [("matmul", 20.0, 20.0, 2), ("attention", 3.0, 7.0, 1), ("tiny", 0.0, 3.0, 1)]
    assert sum(r[1] for r in rows) == 23.0  # the device's busy span, the gap left out
    # told apart by their place: the k-th matmul of the step
    placed = exposed_by(events, lambda name, k: f"{name}{k}" if name == "matmul" else name)
    assert placed == [("matmul0", 10.0, 10.0, 1), ("matmul1", 10.0, 10.0, 1), ("attention", 3.0, 7.0, 1),
                      ("tiny", 0.0, 3.0, 1)]  # fmt: skip


def _three_cats(x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = torch.cat([x, x])
    return x


def test_profiled_lists_where_the_named_operators_were_called(tmp_path):
    path = tmp_path / "callers.txt"
    with profiled(path, "three concatenations", torch.device("cpu"), callers=("aten::cat",)):
        _three_cats(torch.ones(2))
    text = path.read_text()
    listed = text.split("where they were called")[1].splitlines()[1:]
    assert len(listed) == 1 and "aten::cat" in listed[0] and listed[0].split()[1] == "3"


def test_caller_rows_group_by_the_innermost_frame_under_the_root():
    frame = SimpleNamespace
    cpu = torch.autograd.DeviceType.CPU
    events = [
        frame(name="aten::cat", device_type=cpu, cpu_time_total=5.0,
              stack=["<built-in method cat>", "pkg/a.py(3): f", "pkg/b.py(9): g", "main.py(1): <module>"]),
        frame(name="aten::cat", device_type=cpu, cpu_time_total=7.0, stack=["<built-in method cat>", "pkg/a.py(3): f"]),
        frame(name="aten::item", device_type=cpu, cpu_time_total=1.0, stack=["pkg/b.py(9): g"]),
        frame(name="aten::mm", device_type=cpu, cpu_time_total=50.0, stack=["pkg/a.py(4): f"]),
        frame(name="aten::cat", device_type=cpu, cpu_time_total=2.0, stack=[]),
    ]  # fmt: skip
    rows = caller_rows(events, {"aten::cat", "aten::item"}, root="pkg")
    assert rows == [("aten::cat", "pkg/a.py(3): f", 12.0, 2), ("aten::cat", "?", 2.0, 1),
                    ("aten::item", "pkg/b.py(9): g", 1.0, 1)]  # fmt: skip
