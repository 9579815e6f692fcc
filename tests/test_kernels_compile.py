"""Every Triton kernel in tlt_rt compiles for sm_90 with the arguments its launchers pass, checked on CPU.

The other kernel tests run in Triton's interpreter, which checks no types; `kernel_compile_check.py`
compiles for real, in a subprocess: this process has TRITON_INTERPRET=1 and its kernels are interpreted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# a loop-carried type clash, which the interpreter lets through and the compiler refuses: `v` is a [128] fp32
# when the loop starts and a [1024] bf16 after one iteration
CLASH = """
import torch
import triton
import triton.language as tl


@triton.jit
def clash_kernel(X, Y, H, BLOCK: tl.constexpr):
    v = tl.zeros([128], dtype=tl.float32)
    tl.store(Y + tl.arange(0, 128), v)
    for start in range(0, H, BLOCK):
        v = tl.load(X + start + tl.arange(0, BLOCK))
        tl.store(Y + start + tl.arange(0, BLOCK), v)


def launch():
    x = torch.zeros(4096, dtype=torch.bfloat16)
    clash_kernel[(1,)](x, x, 4096, BLOCK=1024)
"""


def _python(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    return subprocess.run([sys.executable, *args], cwd=TESTS.parent, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90(tmp_path):
    report_path = tmp_path / "report.json"
    proc = _python([str(TESTS / "kernel_compile_check.py"), str(report_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert not report["problems"], "\n\n".join(report["problems"])
    uncovered = [name for name, n in report["compiled"].items() if n == 0]
    assert not uncovered, f"no case in tests/kernel_compile_check.py launches {uncovered}: add one"
    # the decode chain with PDL: every kernel of it checked (and the row-parallel matmul with the TP sum inside, which
    # joins the chain under TP; the 9-64-row matmul of a chain of more rows), each one-tile matmul prefetching its
    # weight before its wait
    chained = {label.split("[")[0].rsplit(".", 1)[1]: r for label, r in report["pdl"].items()}
    assert set(chained) == {
        "_norm_linear_kernel",
        "_skinny_kernel",
        "_decode_rope_attention_kernel",
        "_row_parallel_sum_kernel",
        "_rows_kernel",
    }, chained
    # every matmul gets its weight moving before its wait: loaded whole (`skinny_gemm.row_tiles`) or prefetched
    early = [r["prefetch_before_wait"] + r["early_loads_before_wait"] > 0 for label, r in report["pdl"].items()
             if "PREFETCH=True" in label or "ONE_TILE=True" in label]  # fmt: skip
    assert len(early) >= 4 and all(early), report["pdl"]
    # decode attention reads its lengths, tables and first tile of the cache before its wait
    attention = [r for label, r in report["pdl"].items() if "_decode_rope_attention_kernel" in label]
    assert attention and all(r["early_loads_before_wait"] >= 4 for r in attention), attention
    assert any("PDL=2" in label for label in report["pdl"]), list(report["pdl"])  # signalling at the end
    # no launch of the chain spills registers to local memory (ptxas -v; a sweep's register cap, named in the label,
    # may), and every one was assembled
    assert all(r["registers"] > 0 for r in report["pdl"].values()), report["pdl"]
    spilled = {label: (r["spill_stores"], r["spill_loads"]) for label, r in report["pdl"].items()
               if "maxnreg" not in label and r["spill_stores"] + r["spill_loads"]}  # fmt: skip
    assert not spilled, spilled


def _check_module(tmp_path, source: str) -> tuple[list, list]:
    """(cases that raised, results) of kernel_compile_check.run_cases over `source`'s `launch`, in a subprocess."""
    (tmp_path / "case_module.py").write_text(source)
    code = (
        f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(tmp_path)!r}]\n"
        "import json, case_module, kernel_compile_check as check\n"
        "raised, results = check.run_cases([case_module.launch])\n"
        "print(json.dumps([raised, results]))\n"
    )
    proc = _python(["-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_loop_carried_type_clash_is_reported(tmp_path):
    raised, [(label, error, _, pdl)] = _check_module(tmp_path, CLASH)
    assert not raised and label.startswith("case_module.clash_kernel[")
    assert error is not None and "Loop-carried variable v" in error, error
    assert pdl is None


# a kernel launched with PDL that reads its input before waiting for the kernel that may still be writing it
EARLY_READ = """
import torch
import triton
import triton.language as tl


@triton.jit
def early_read_kernel(X, Y):
    x = tl.load(X + tl.arange(0, 128))
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    tl.store(Y + tl.arange(0, 128), x)


def launch():
    x = torch.zeros(128, dtype=torch.bfloat16)
    early_read_kernel[(1,)](x, x, launch_pdl=True)
"""


def test_a_read_before_the_pdl_wait_is_reported(tmp_path):
    raised, [(label, error, _, report)] = _check_module(tmp_path, EARLY_READ)
    problem = report["problem"]
    assert not raised and error is None and "launch_pdl" in label
    assert report["waits"] == 1 and report["signal_after_wait"]
    assert report["global_before_wait"] and "ld.global" in report["global_before_wait"][0], report
    assert problem is not None and "before its wait" in problem


@pytest.mark.slow
def test_eager_attention_compiles_once_whatever_the_block_tables_width(tmp_path):
    """The drafter's eager catch-up and a prefill launch their attention over block tables whose width changes
    from call to call; Triton's launcher specialises an int equal to 1 or divisible by 16, so widths 1, 17 and 32
    were three compiles (one of them inside a timed speculative step). The row stride is left unspecialised: one."""
    proc = _python([str(TESTS / "kernel_compile_check.py"), "--eager-table-variants"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    variants = json.loads(proc.stdout.strip().splitlines()[-1])
    assert variants == {
        "tlt_rt.codegen.kernels.decode_attention._decode_attention_kernel": 1,
        "tlt_rt.codegen.kernels.prefill_attention._prefill_attention_kernel": 1,
    }, variants


def test_the_pdl_signal_is_checked_on_the_side_of_the_wait_its_mode_names():
    """SIGNAL_BEFORE_WAIT launches (PDL=3 in the label) must signal before their wait; every other mode after it."""
    sys.path.insert(0, str(TESTS))
    from kernel_compile_check import pdl_problem

    after = {"waits": 1, "global_before_wait": [], "signal_after_wait": True, "signal_before_wait": False}
    before = {**after, "signal_after_wait": False, "signal_before_wait": True}
    assert pdl_problem("k[PDL=1]", after) is None and pdl_problem("k[PDL=3]", before) is None
    assert "after its wait" in pdl_problem("k[PDL=1]", before)
    assert "signals before its wait" in pdl_problem("k[PDL=3]", after)


# a kernel whose register use the report must find: 4 warps, a [4096] fp32 tile live across a loop
HEAVY = """
import torch
import triton
import triton.language as tl


@triton.jit
def heavy_kernel(X, Y, N, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, 1024):
        acc += tl.load(X + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(Y + tl.arange(0, BLOCK), acc)


def launch():
    x = torch.zeros(1 << 16, dtype=torch.bfloat16)
    heavy_kernel[(1,)](x, x, 1 << 14, BLOCK=4096, num_warps=4)
    heavy_kernel[(1,)](x, x, 1 << 14, BLOCK=256, num_warps=4)
"""


def test_the_resource_report_reads_registers_and_programs_an_sm(tmp_path):
    """`kernel_compile_check.py --resources`: registers a thread from ptxas -v, and the programs an SM holds from
    registers, warps and shared memory (sm_90's limits)."""
    (tmp_path / "case_module.py").write_text(HEAVY)
    code = (
        f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(tmp_path)!r}]\n"
        "import json, case_module, kernel_compile_check as check\n"
        "assert not check.record_cases([case_module.launch])\n"
        "fits = [check.programs_per_sm(*a) for a in ((218, 4, 34816), (128, 4, 34816), (32, 4, 106496), (16, 32, 0))]\n"
        "print(json.dumps([fits, check._pool_map(check.resources_job, list(check.JOBS))]))\n"
    )
    proc = _python(["-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fits, rows = json.loads(proc.stdout.splitlines()[-1])
    assert fits == [[2, "registers"], [4, "registers"], [2, "shared"], [2, "warps"]]
    (big_label, big), (small_label, small) = rows
    assert "BLOCK=4096" in big_label and "BLOCK=256" in small_label
    # 4,096 fp32 over 128 threads: 32 registers of accumulator alone, more than the 256-wide tile's 2
    assert big["registers"] > small["registers"] >= 8, rows
    assert big["num_warps"] == 4 and 1 <= big["programs_per_sm"] <= small["programs_per_sm"] <= 16
    assert big["limit"] in ("registers", "warps", "programs", "shared") and big["spill_stores"] >= 0
