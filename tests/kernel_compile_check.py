"""Compile every Triton kernel in tlt_rt for sm_90 (H100/H200) on a machine without a GPU.

Triton's interpreter, which the CPU tests run under, checks no types: a kernel can pass them all and still
fail to compile. Here the package's launchers run on small CPU tensors while `JITFunction.run` is replaced by
a recorder that specializes each launch as Triton's own launcher does (its binder with the CUDA backend:
dtypes, int widths, ints equal to 1 as constexprs, 16-byte alignment), compiles it for Hopper, checks its
shared memory against the card's and launches nothing. Launches with programmatic dependent launch (the decode
chain's kernels, `tlt_rt/codegen/kernels/pdl.py`) have their PTX checked against the PDL contract too
(`pdl_report`): no global load, store or atomic before `griddepcontrol.wait`, the signal after it. Needs
TRITON_INTERPRET unset, so that @triton.jit gives real JITFunctions; `test_kernels_compile.py` runs it in a subprocess.

    python tests/kernel_compile_check.py [report.json]
    python tests/kernel_compile_check.py --resources [PATTERN]   (registers, spills, programs an SM; ptxas -v)
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler.code_generator import CodeGenerator
from triton.runtime.jit import JITFunction, KernelInterface, create_function_from_signature

ROOT = Path(__file__).resolve().parents[1]
TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
SM90_SHARED_MEMORY = 232448  # bytes a block may opt in to on an H100 / H200
BF16 = torch.bfloat16


# ------------------------------------------------------------------------------------------ the recorder
def kernel_name(fn: JITFunction) -> str:
    return f"{fn.fn.__module__}.{fn.fn.__qualname__}"


def discover() -> dict[str, JITFunction]:
    """Every @triton.jit function defined in tlt_rt, so that a kernel no case launches shows up uncovered."""
    found = {}
    for path in sorted((ROOT / "tlt_rt").rglob("*.py")):
        if not re.search(r"^\s*@(triton\.)?jit\b", path.read_text(), re.MULTILINE):
            continue
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for obj in vars(module).values():
            while isinstance(obj, KernelInterface) and not isinstance(obj, JITFunction):
                obj = obj.fn  # autotune / heuristics wrappers: listed, so that they fail until a case covers them
            if isinstance(obj, JITFunction) and obj.fn.__module__ == module.__name__:
                found[kernel_name(obj)] = obj
    return found


JOBS: dict[str, tuple] = {}  # one per distinct specialization, in launch order
# a global-memory access in PTX (an L2 prefetch is none: it reads nothing into the kernel and writes nothing), and
# the loads a PDL kernel may issue before its wait (`kernels.pdl.load_early`, of weights and step inputs: evict-first)
GLOBAL_ACCESS = re.compile(r"\b(ld|st|atom|red)\.global\b|\bcp\.async\.(?!bulk\.prefetch)")
EARLY_LOAD = re.compile(r"\bld\.global\.L1::evict_first\b")
_binders: dict[JITFunction, Callable] = {}


def record(fn: JITFunction, *args, grid, warmup, **kwargs) -> None:
    """Stands in for `JITFunction.run`: queues the specialization a CUDA launch would compile; no launch."""
    if fn not in _binders:
        _binders[fn] = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound, specialization, extra = _binders[fn](*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(BACKEND, kwargs, bound, specialization, extra)
    key = f"{kernel_name(fn)} {specialization} {sorted(extra.items())}"
    if key not in JOBS:
        shown = [f"{fn.arg_names[path[0]]}={value}" for path, value in constexprs.items()]
        shown += [f"num_warps={options.num_warps}", f"num_stages={options.num_stages}"]
        shown += ["launch_pdl"] if options.launch_pdl else []
        shown += [f"maxnreg={options.maxnreg}"] if getattr(options, "maxnreg", None) else []
        JOBS[key] = (fn, signature, constexprs, attrs, options.__dict__, f"{kernel_name(fn)}[{', '.join(shown)}]")


def _describe(e: BaseException) -> str:
    """The error and its causes: an error inside a called @triton.jit helper is the cause of the caller's."""
    parts = []
    while e is not None:
        parts.append(f"{type(e).__name__}: {e}".strip())
        e = e.__cause__
    return "\n".join(parts)


def pdl_report(ptx: str) -> dict:
    """What the PDL contract asks of a kernel's PTX: `griddepcontrol.wait` present, no global store or atomic and
    no load but early loads (`kernels.pdl.load_early`) before the first one in the text (code before the wait in
    any path comes before it there), the signal (`launch_dependents`) after it (before it: `signal_before_wait`);
    and the L2 prefetches and early loads before it."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    waits = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
    signals = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents")]
    first = waits[0] if waits else len(lines)
    return {
        "waits": len(waits),
        "signal_after_wait": bool(waits and signals) and min(signals) > first,
        "signal_before_wait": bool(waits and signals) and max(signals) < first,
        "global_before_wait": [ln for ln in lines[:first] if GLOBAL_ACCESS.search(ln) and not EARLY_LOAD.search(ln)][
            :5
        ],
        "prefetch_before_wait": sum(ln.startswith("prefetch.global.L2") for ln in lines[:first]),
        "early_loads_before_wait": sum(bool(EARLY_LOAD.search(ln)) for ln in lines[:first]),
    }


def pdl_problem(label: str, report: dict) -> str | None:
    """Why a PDL launch's PTX breaks the contract, or None."""
    if report["waits"] == 0:
        return f"{label} is launched with PDL but never waits for the kernel before (griddepcontrol.wait)"
    if report["global_before_wait"]:
        return f"{label} touches global memory before its wait: {report['global_before_wait']}"
    if "PDL=3" in label:  # kernels.pdl.SIGNAL_BEFORE_WAIT
        if not report["signal_before_wait"]:
            return f"{label} signals before its wait, but its PTX does not (griddepcontrol.launch_dependents)"
    elif not report["signal_after_wait"]:
        return f"{label} does not signal its dependents after its wait (griddepcontrol.launch_dependents)"
    return None


def compile_job(key: str) -> tuple[str, str | None, list[str], dict | None]:
    """Compile one queued specialization -> (label, error or None, the jit functions it generated code for, the
    PDL report of a launch with PDL, its "problem" the contract's breach or None; else None)."""
    fn, signature, constexprs, attrs, options, label = JOBS[key]
    generated = {kernel_name(fn)}
    call = CodeGenerator.call_JitFunction

    def noting_callee(self, callee, *args, **kwargs):
        generated.add(kernel_name(callee))
        return call(self, callee, *args, **kwargs)

    CodeGenerator.call_JitFunction = noting_callee
    pdl = None
    try:
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options)
        error = None
        if kernel.metadata.shared > SM90_SHARED_MEMORY:  # else refused only when a GPU loads it
            error = f"OutOfResources: {kernel.metadata.shared} bytes of shared memory, sm_90 has {SM90_SHARED_MEMORY}"
        if options.get("launch_pdl"):
            pdl = pdl_report(kernel.asm["ptx"])
            pdl["problem"] = pdl_problem(label, pdl)
            pdl["registers"], pdl["spill_stores"], pdl["spill_loads"] = ptxas_usage(kernel.asm["ptx"])
    except Exception as e:
        error = _describe(e)
    finally:
        CodeGenerator.call_JitFunction = call
    return label, error, sorted(generated), pdl


def record_cases(cases) -> list[str]:
    """Run each case's launches under the recorder (queuing JOBS); returns the cases that raised."""
    JOBS.clear()
    run, JITFunction.run = JITFunction.run, record
    raised = []
    try:
        for case in cases:
            try:
                case()
            except Exception:  # its later launches are lost: name it rather than pass with less covered
                raised.append(f"{case.__name__} raised:\n{traceback.format_exc(limit=-3)}")
    finally:
        JITFunction.run = run
    return raised


def _pool_map(job: Callable, keys: list[str]) -> list:
    """job over keys in forked processes (they inherit JOBS): compiling is CPU-bound in MLIR passes and ptxas."""
    workers = max(1, min(len(os.sched_getaffinity(0)), len(keys)))
    with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
        return list(pool.map(job, keys))


def run_cases(cases) -> tuple[list[str], list[tuple[str, str | None, list[str], dict | None]]]:
    """Run each case's launches under the recorder, then compile what they queued, in parallel.

    Returns (the cases that raised, one (label, error, generated, PDL report) per distinct specialization)."""
    raised = record_cases(cases)
    return raised, _pool_map(compile_job, list(JOBS))


# What one sm_90 SM holds: registers, warps, resident programs, shared memory (each program reserving 1 KB more)
SM90_REGISTERS, SM90_WARPS, SM90_PROGRAMS, SM90_SM_SHARED = 65536, 64, 32, 233472
PTXAS_USED = re.compile(r"Used (\d+) registers")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def programs_per_sm(registers: int, num_warps: int, shared: int) -> tuple[int, str]:
    """(programs of a kernel one sm_90 SM holds at once, what limits it: "registers", "warps", "programs" or
    "shared"), from its registers a thread (a warp's allocated 256 at a time), warps and shared memory a program."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    limits = {
        "registers": SM90_REGISTERS // (per_warp * num_warps),
        "warps": SM90_WARPS // num_warps,
        "programs": SM90_PROGRAMS,
        "shared": SM90_SM_SHARED // (shared + 1024),
    }
    which = min(limits, key=limits.get)
    return limits[which], which


def ptxas_usage(ptx: str) -> tuple[int, int, int]:
    """(registers a thread, spill stores, spill loads in bytes) of PTX for sm_90a, from Triton's own ptxas, verbose.
    The counts are this machine's ptxas's: the GPU's Triton may bundle another release, whose allocation can
    differ."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory(prefix="tlt-ptxas-") as tmp:
        src, out = Path(tmp, "kernel.ptx"), Path(tmp, "kernel.cubin")
        src.write_text(ptx)
        cmd = [get_ptxas(TARGET.arch).path, "-v", f"--gpu-name=sm_{TARGET.arch}a", str(src), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    text = done.stdout + done.stderr
    stores, loads = map(int, PTXAS_SPILLS.search(text).groups())
    return int(PTXAS_USED.search(text).group(1)), stores, loads


def resources_job(key: str) -> tuple[str, dict | str]:
    """Compile one queued specialization and assemble it (`ptxas_usage`) -> (label, {registers, spill_stores,
    spill_loads, shared, num_warps, num_stages, programs_per_sm, limit}) or (label, the error)."""
    fn, signature, constexprs, attrs, options, label = JOBS[key]
    try:
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options)
        registers, stores, loads = ptxas_usage(kernel.asm["ptx"])
    except Exception as e:
        return label, _describe(e)
    warps, shared = options["num_warps"], kernel.metadata.shared
    fit, limit = programs_per_sm(registers, warps, shared)
    return label, {
        "registers": registers, "spill_stores": stores, "spill_loads": loads, "shared": shared, "num_warps": warps,
        "num_stages": options["num_stages"], "programs_per_sm": fit, "limit": limit,
    }  # fmt: skip


def resources(pattern: str = "") -> list[tuple[str, dict | str]]:
    """`resources_job` for every specialization the cases launch whose label contains `pattern`."""
    raised = record_cases(CASES)
    if raised:
        raise RuntimeError("\n".join(raised))
    return _pool_map(resources_job, [key for key, job in JOBS.items() if pattern in job[-1]])


def print_resources(rows: list[tuple[str, dict | str]]) -> None:
    """A line a specialization: registers, spills, shared memory, warps / stages, programs an SM and what limits it."""
    print(f"{'regs':>5} {'spill st/ld':>11} {'shared':>7} {'w/s':>5} {'per SM':>6}  {'limit':<9} specialization")
    for label, r in rows:
        if isinstance(r, str):
            print(f"{'-':>5} {'-':>11} {'-':>7} {'-':>5} {'-':>6}  {'error':<9} {label}: {r.splitlines()[0]}")
            continue
        spills = f"{r['spill_stores']}/{r['spill_loads']}"
        print(f"{r['registers']:>5} {spills:>11} {r['shared']:>7} {r['num_warps']:>2}/{r['num_stages']:<2} "
              f"{r['programs_per_sm']:>6}  {r['limit']:<9} {label}")  # fmt: skip


# --------------------------------------------------------------------------------------------- the cases
# Shapes are the engine's where a constexpr or an int specialization depends on them (head_dim, GQA group,
# vocab and hidden sizes, strategies), small elsewhere. Inputs are zeros: no launcher reads a kernel's output.
def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


def _unguard(mod, sms: bool = True) -> None:
    """Let `mod`'s paged-attention launcher take CPU tensors for a compiled kernel (its one CPU-specific check
    refuses them, as a launch would crash; every other check stays) and, with sms, choose its split-K as on an
    H100 (132 SMs). Idempotent."""
    from tlt_rt.codegen.kernels import paged

    mod.check_paged_inputs = lambda kernel, *a: paged.check_paged_inputs(None, *a)
    if sms:
        mod.num_sms = lambda device: 132


def _paged(b, n_kv, head_dim, page=16, max_blocks=64):
    kv = _t(2, b * max_blocks, page, n_kv, head_dim, dtype=BF16)
    tables = torch.arange(b * max_blocks, dtype=torch.int32).view(b, max_blocks)
    return kv[0], kv[1], tables, torch.full((b,), 700, dtype=torch.int32)


def attention_cases():
    from tlt_rt.codegen.kernels import decode_attention as dec
    from tlt_rt.codegen.kernels import tree_attention as tree

    for mod in (dec, tree):
        _unguard(mod)
    for n_heads, n_kv, head_dim in ((28, 4, 128), (9, 3, 64)):  # Qwen2.5-7B, SmolLM2
        k, v, tables, lens = _paged(2, n_kv, head_dim)
        dec.paged_decode_attention(_t(2, n_heads, head_dim, dtype=BF16), k, v, tables, lens, 0.1)
        for t, w in ((48, 48), (4, 12)):  # a verify tree; a drafter level that also sees its ancestors
            q = _t(2 * t, n_heads, head_dim, dtype=BF16)
            tree.paged_tree_attention(q, k, v, tables, lens, torch.zeros(2, t, w, dtype=torch.bool), 0.1)
    # a sweep's tree launch (`step_costs.py pdl:tree:bm=64,mt=4096`) on a 33-token verify of Qwen2.5-Coder-1.5B's heads
    default_tree = tree.TREE_META
    tree.TREE_META = {**default_tree, "block_m": 64, "merge_tile": 4096}
    try:
        k, v, tables, lens = _paged(1, 2, 128, max_blocks=164)
        mask = torch.zeros(1, 33, 33, dtype=torch.bool)
        tree.paged_tree_attention(_t(33, 12, 128, dtype=BF16), k, v, tables, lens, mask, 0.1)
    finally:
        tree.TREE_META = default_tree
    k, v, tables, lens = _paged(2, 4, 128)
    q = _t(2, 28, 128, dtype=BF16)
    dec.paged_decode_attention(q, k, v, tables, lens, 0.1, num_splits=1)
    mask = torch.zeros(2, 48, 48, dtype=torch.bool)
    tree.paged_tree_attention(_t(96, 28, 128, dtype=BF16), k, v, tables, lens, mask, 0.1, num_splits=1)
    counters = dec.split_counters
    dec.split_counters = lambda device, n: None  # as under graph capture: the splits merge in a second kernel
    try:
        dec.paged_decode_attention(q, k, v, tables, lens, 0.1)
    finally:
        dec.split_counters = counters
    from tlt_rt.codegen.kernels import prefill_attention as pre

    _unguard(pre, sms=False)
    for n_heads, n_kv, head_dim, dtype in ((12, 2, 128, BF16), (9, 3, 64, BF16), (28, 4, 128, torch.float32)):
        k, v, tables, lens = _paged(2, n_kv, head_dim)  # Qwen2.5-Coder-1.5B, SmolLM2; fp32 as the tests run it
        cu = torch.tensor([0, 80, 200], dtype=torch.int32)
        pre.paged_prefill_attention(_t(200, n_heads, head_dim, dtype=dtype), k.to(dtype), v.to(dtype), tables, lens,
                                    cu, 120, 0.1)  # fmt: skip


def accept_cases():
    from tlt_rt.codegen.kernels import accept

    accept._is_interpreted = lambda: True  # lifts the CPU guard; block_v is then given as the GPU's default
    for b, t, d in ((2, 48, 8), (2, 1, 0)):  # a verified tree; the runner's first token after a prefill
        logits, u = _t(b, t, 32768, dtype=BF16), _t(b, d + 1, 2)
        tokens, parents = torch.zeros(b, t, dtype=torch.int64), torch.full((b, t), -1)
        for greedy, filtering in ((True, False), (False, False), (False, True)):
            top_k = torch.full((b,), 20 if filtering else 0, dtype=torch.int32)
            top_p = torch.full((b,), 0.9 if filtering else 1.0)
            accept.accept_tree(logits, tokens, parents, torch.ones(b), top_k, top_p, u, d, all_greedy=greedy,
                               filtering=filtering, backend="triton", block_v=accept.DEFAULT_BLOCK_V)  # fmt: skip


def commit_cases():
    from tlt_rt.codegen.kernels import kv_commit as commit

    class Unguarded:
        """The kernel behind an object that is not a JITFunction, which is what the CPU guard looks for."""

        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return self.fn[grid]

    commit._kv_commit_kernel = Unguarded(commit._kv_commit_kernel)
    for n_kv, head_dim in ((4, 128), (3, 64)):
        store = _t(2, 2, 32, 16, n_kv, head_dim, dtype=BF16)  # [L, 2, ...]: one launch for every layer
        layers = [(store[i, 0], store[i, 1]) for i in range(2)]
        tables = torch.arange(8, dtype=torch.int32).view(2, 4)
        commit.kv_commit(layers, tables, torch.full((2,), 20), torch.full((2, 9), -1), torch.zeros(2, dtype=torch.long))


def draft_cases():
    from tlt_rt.codegen.kernels import build_tree, draft_level, topk_lse
    from tlt_rt.ir.tree import Candidates

    b, d2t = 2, torch.arange(8192)  # SmolLM2's drafter: 576 hidden, an 8,192-id head
    for depth, k, verify in ((8, 4, 48), (6, 1, 7)):  # a tree and a chain
        n = k + (depth - 1) * k * k
        cands = Candidates(_t(b, n, dtype=torch.int64), _t(b, n), torch.full((b, n), -1), k)
        roots = _t(b, 5, dtype=torch.int64)[:, -1]  # a column of the catch-up block's tokens, as drafting passes
        build_tree.build_tree_triton(cands, roots, torch.full((b,), 30), verify)
        hidden = _t(b * k, 576, dtype=BF16)
        for level in (1, 2):  # a chain's level 1 has mask width 1 and offset 1, both specialized as constexprs
            front, mask = _t(b, k), torch.zeros(b, k, level * k, dtype=torch.bool)
            offset = k + (level - 1) * k * k
            lp, tok = topk_lse.topk_logprobs(_t(b * k, 8192, dtype=BF16), k, id_map=d2t)
            draft_level.draft_level(front, lp, tok, hidden, mask, offset)
    topk_lse.topk_logprobs(_t(8, 151936, dtype=BF16), 4)  # Qwen's full vocabulary: 38 chunks a row


def layer_cases():
    from tlt_rt.codegen.kernels import norm_linear, rope_cache, skinny_gemm

    for n_heads, n_kv, head_dim in ((28, 4, 128), (9, 3, 64)):
        qkv = _t(2, n_heads + 2 * n_kv, head_dim, dtype=BF16)  # q, k and v: views of one fused projection
        q, k, v = qkv.split([n_heads, n_kv, n_kv], dim=1)
        cache = _t(2, 8, 16, n_kv, head_dim, dtype=BF16)
        positions = slots = torch.tensor([5, 9])
        rope_cache.rope_write_kv(q, k, v, positions, _t(head_dim // 2), cache[0], cache[1], slots)
    skinny_gemm.interpreting = lambda: True  # lifts `supported`'s CPU guard
    for rows, swiglu, bias in ((1, False, False), (1, True, False), (8, True, False), (3, False, True)):
        x, w = _t(rows, 4096, dtype=BF16), _t(256, 4096, dtype=BF16)
        skinny_gemm.skinny_linear_triton(x, w, _t(256, dtype=BF16) if bias else None, swiglu=swiglu)
    # Qwen2.5-Coder-1.5B's q/k/v (with bias, after a residual) and gate/up (layer 0: no residual), 1 and 8 rows
    for rows, swiglu, res in ((1, False, True), (1, True, False), (8, True, True)):
        x, nw = _t(rows, 1536, dtype=BF16), _t(1536, dtype=BF16)
        w = _t(2 * 256 if swiglu else 2048, 1536, dtype=BF16)
        bias = None if swiglu else _t(2048, dtype=BF16)
        norm_linear.norm_linear(x, _t(rows, 1536, dtype=BF16) if res else None, nw, 1e-6, w, bias, swiglu=swiglu)
    # decode attention with the rotary and K/V write fused in: Qwen2.5-Coder-1.5B's heads (split) and 0.5B's (one)
    from tlt_rt.codegen.kernels import decode_rope_attention as rope_dec

    _unguard(rope_dec)
    for b, n_heads, head_dim, splits in ((1, 12, 128, None), (4, 14, 64, 1)):
        qkv = _t(b, n_heads + 4, head_dim, dtype=BF16)
        q, k, v = qkv.split([n_heads, 2, 2], dim=1)
        cache = _t(2, 8, 16, 2, head_dim, dtype=BF16)
        tables = torch.zeros(b, 64 if splits is None else 4, dtype=torch.int32)  # 1,024 positions: split-K
        rope_dec.decode_rope_attention(
            q, k, v, torch.arange(b), _t(head_dim // 2), cache[0], cache[1], torch.arange(b), tables,
            torch.full((b,), 30, dtype=torch.int32), 0.1, num_splits=splits,
        )  # fmt: skip


def pdl_cases():
    """A one-row decode step's chain with PDL and prefetch on (`rollout.pdl`), on Qwen2.5-Coder-1.5B's shapes: the
    add + norm + q/k/v and + gate/up, the skinny o / down matmuls, the rotary decode attention."""
    from tlt_rt.codegen.kernels import decode_rope_attention as rope_dec
    from tlt_rt.codegen.kernels import norm_linear, pdl, skinny_gemm

    pdl.pdl_supported = lambda device: True  # as on an sm_90 GPU
    skinny_gemm.interpreting = lambda: True  # lifts `supported`'s CPU guard
    _unguard(rope_dec)
    x, r, nw = _t(1, 1536, dtype=BF16), _t(1, 1536, dtype=BF16), _t(1536, dtype=BF16)
    norm_linear.norm_linear(x, r, nw, 1e-6, _t(2048, 1536, dtype=BF16), _t(2048, dtype=BF16), pdl=True, prefetch=True)
    norm_linear.norm_linear(x, r, nw, 1e-6, _t(2 * 8960, 1536, dtype=BF16), swiglu=True, pdl=True, prefetch=True)
    skinny_gemm.skinny_linear_triton(x, _t(1536, 1536, dtype=BF16), pdl=True, prefetch=True)  # o
    skinny_gemm.skinny_linear_triton(_t(1, 8960, dtype=BF16), _t(1536, 8960, dtype=BF16), pdl=True, prefetch=True)
    skinny_gemm.skinny_linear_triton(x, _t(2 * 256, 1536, dtype=BF16), swiglu=True, pdl=True, prefetch=True)
    skinny_gemm.skinny_linear_triton(x, _t(1536, 1536, dtype=BF16), pdl=pdl.SIGNAL_AT_END)  # signalling at its end
    # rows streamed in tiles (too wide to load whole: the 7B shape's down, or "whole" 0), their slabs prefetched
    streamed = {**skinny_gemm.ONE_ROW_NARROW, "whole": 0}
    skinny_gemm.skinny_linear_triton(_t(1, 8960, dtype=BF16), _t(1536, 8960, dtype=BF16), meta=streamed, pdl=True,
                                     prefetch=True)  # fmt: skip
    pieces = {**skinny_gemm.ONE_ROW_WIDE, "pieces": 1}  # rows within one tile in pieces (1,536 as 1,024 + 512)
    norm_linear.norm_linear(x, r, nw, 1e-6, _t(2 * 8960, 1536, dtype=BF16), swiglu=True, pdl=True, meta=pieces)
    x7 = _t(1, 3584, dtype=BF16)
    norm_linear.norm_linear(x7, x7, _t(3584, dtype=BF16), 1e-6, _t(2 * 18944, 3584, dtype=BF16), swiglu=True,
                            pdl=True, prefetch=True)  # fmt: skip
    flat, skinny_gemm.ROW_FLAT = skinny_gemm.ROW_FLAT, not skinny_gemm.ROW_FLAT  # one row's products the other way
    try:
        norm_linear.norm_linear(x, r, nw, 1e-6, _t(2 * 8960, 1536, dtype=BF16), swiglu=True, pdl=True)
        skinny_gemm.skinny_linear_triton(_t(1, 8960, dtype=BF16), _t(1536, 8960, dtype=BF16), pdl=True)
        skinny_gemm.skinny_linear_triton(
            _t(1, 8960, dtype=BF16),
            _t(1536, 8960, dtype=BF16),
            meta={**skinny_gemm.ONE_ROW_NARROW, "whole": 0},
            pdl=True,
        )  # streamed in tiles
    finally:
        skinny_gemm.ROW_FLAT = flat
    qkv = _t(1, 16, 128, dtype=BF16)
    q, k, v = qkv.split([12, 2, 2], dim=1)
    cache = _t(2, 8, 16, 2, 128, dtype=BF16)

    def attend():  # one row of Qwen2.5-Coder-1.5B's heads over a 1,024-position table, split
        rope_dec.decode_rope_attention(
            q, k, v, torch.arange(1), _t(64), cache[0], cache[1], torch.arange(1),
            torch.zeros(1, 64, dtype=torch.int32), torch.full((1,), 30, dtype=torch.int32), 0.1, pdl=True,
        )  # fmt: skip

    for first in (frozenset(), frozenset({"attention", "norm", "narrow", "long"})):  # pdl.SIGNAL_FIRST
        pdl.SIGNAL_FIRST = first
        attend()
    pdl.SIGNAL_FIRST = frozenset()
    # the launch settings a sweep may set (`step_costs.py pdl:attn:tm=1,mt=4096,r=128`): the merge over the group's
    # rows, a smaller merge tile, a register cap
    default_meta = rope_dec.DECODE_META
    rope_dec.DECODE_META = {**default_meta, "tight_merge": 1, "merge_tile": 4096, "maxnreg": 128}
    try:
        attend()
    finally:
        rope_dec.DECODE_META = default_meta
    from tlt_rt.codegen.kernels.probe import Stamps

    rope_dec.PROBE = Stamps("cpu", 1 << 12)  # time stamps of each program (benchmarks/attention_timeline.py)
    try:
        attend()
    finally:
        rope_dec.PROBE = None
    norm_linear.norm_linear(x, r, nw, 1e-6, _t(2048, 1536, dtype=BF16), _t(2048, dtype=BF16), pdl=True)
    skinny_gemm.skinny_linear_triton(x, _t(1536, 1536, dtype=BF16), pdl=True)  # o
    skinny_gemm.skinny_linear_triton(_t(1, 8960, dtype=BF16), _t(1536, 8960, dtype=BF16), pdl=True)  # down
    pdl.SIGNAL_FIRST = frozenset()
    # a decode chain of 32 rows (rollout.decode_chain_rows): tensor-core products, tiles streamed
    x32, r32 = _t(32, 1536, dtype=BF16), _t(32, 1536, dtype=BF16)
    norm_linear.norm_linear(x32, r32, nw, 1e-6, _t(2048, 1536, dtype=BF16), _t(2048, dtype=BF16), pdl=True)
    norm_linear.norm_linear(x32, r32, nw, 1e-6, _t(2 * 8960, 1536, dtype=BF16), swiglu=True, pdl=True)
    skinny_gemm.skinny_linear_triton(x32, _t(1536, 1536, dtype=BF16), pdl=True)  # o
    skinny_gemm.skinny_linear_triton(_t(32, 8960, dtype=BF16), _t(1536, 8960, dtype=BF16), pdl=True)  # down
    skinny_gemm.skinny_linear_triton(_t(16, 8960, dtype=BF16), _t(1536, 8960, dtype=BF16), pdl=True)
    skinny_gemm.skinny_linear_triton(_t(64, 1536, dtype=BF16), _t(4096, 1536, dtype=BF16), pdl=True)
    # the same rows through kernels.rows_gemm (skinny_gemm.DOT_KERNEL "split"): o and down split over K, gate/up
    # with SwiGLU, a verify's 33 rows against q/k/v with its bias; with and without PDL
    from tlt_rt.codegen.kernels import rows_gemm

    rows_gemm.interpreting = lambda: True  # lifts `supported`'s CPU guard
    split = {"programs": 264}  # an H200's two waves (num_sms is 1 on CPU)
    rows_gemm.rows_linear(x32, _t(1536, 1536, dtype=BF16), pdl=True, meta=split)
    rows_gemm.rows_linear(_t(32, 8960, dtype=BF16), _t(1536, 8960, dtype=BF16), pdl=True, meta=split)
    rows_gemm.rows_linear(x32, _t(2 * 8960, 1536, dtype=BF16), swiglu=True, pdl=True, meta=split)
    rows_gemm.rows_linear(_t(33, 1536, dtype=BF16), _t(2048, 1536, dtype=BF16), _t(2048, dtype=BF16), meta=split)


def tp_sum_cases():
    """The row-parallel matmul summing over two ranks inside (`kernels.tp_sum`) on Qwen2.5-7B's TP=2 shapes: o and
    down at one row (down with PDL, as `use_fused_sums(model, pdl=True)` launches it) and down at 8 rows."""
    from tlt_rt.codegen.kernels import pdl, tp_sum

    pdl.pdl_supported = lambda device: True  # as on an sm_90 GPU
    tp_sum.interpreting = lambda: True  # lifts `sum_supported`'s CPU guard
    bufs = tp_sum.SumBuffers(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), 8 * 3584, 1, 2)
    tp_sum.row_parallel_sum(_t(1, 1792, dtype=BF16), _t(3584, 1792, dtype=BF16), bufs, 0)  # o
    tp_sum.row_parallel_sum(_t(1, 9472, dtype=BF16), _t(3584, 9472, dtype=BF16), bufs, 1, pdl=True)  # down
    tp_sum.row_parallel_sum(_t(8, 9472, dtype=BF16), _t(3584, 9472, dtype=BF16), bufs, 1)
    flat, tp_sum.ROW_FLAT = tp_sum.ROW_FLAT, not tp_sum.ROW_FLAT  # one row's products the other way
    try:
        tp_sum.row_parallel_sum(_t(1, 1792, dtype=BF16), _t(3584, 1792, dtype=BF16), bufs, 0)
        tp_sum.row_parallel_sum(_t(1, 9472, dtype=BF16), _t(3584, 9472, dtype=BF16), bufs, 1, pdl=True)
    finally:
        tp_sum.ROW_FLAT = flat


CASES = (attention_cases, accept_cases, commit_cases, draft_cases, layer_cases, pdl_cases, tp_sum_cases)


# -------------------------------------------------------------------------------------------------- main
def check() -> dict:
    """{"compiled": {kernel: successful compiles, helpers counted in their callers}, "specializations": labels,
    "pdl": {label: PDL report} of the launches with PDL, "problems": what raised, failed to compile or broke the
    PDL contract}."""
    kernels = discover()
    problems, results = run_cases(CASES)
    compiled = dict.fromkeys(kernels, 0)
    pdl = {}
    for label, error, generated, report in results:
        if error is not None:
            problems.append(f"{label} does not compile for sm_90:\n{error}")
        for name in generated:
            if name in compiled:
                compiled[name] += error is None
        if report is not None:
            pdl[label] = report
            if report["problem"]:
                problems.append(report["problem"])
    labels = [label for label, *_ in results]
    return {"compiled": compiled, "specializations": labels, "pdl": pdl, "problems": problems}


def eager_table_variants() -> dict[str, int]:
    """Specializations Triton's launcher would compile for the attention kernels that run eagerly (the drafter's
    catch-up: decode attention with one split; a prefill), over one sequence's block tables of 1, 17 and 32
    blocks: the table's row stride is 1, neither 1 nor a multiple of 16, then a multiple of 16. Each launch is
    one variant when that stride is left unspecialised, else a first catch-up on a longer table compiles mid-rollout
    (0.6 s in an H200 step). Nothing is compiled here: the launches are only recorded."""
    from tlt_rt.codegen.kernels import decode_attention as dec
    from tlt_rt.codegen.kernels import prefill_attention as pre

    for mod in (dec, pre):
        _unguard(mod, sms=False)
    JOBS.clear()
    run, JITFunction.run = JITFunction.run, record
    try:
        for width in (1, 17, 32):
            k, v, _, _ = _paged(1, 2, 128, max_blocks=32)
            tables = torch.zeros(1, width, dtype=torch.int32)
            lens = torch.full((1,), 9, dtype=torch.int32)
            dec.paged_decode_attention(_t(1, 12, 128, dtype=BF16), k, v, tables, lens, 0.1, num_splits=1)
            cu = torch.tensor([0, 3], dtype=torch.int32)
            pre.paged_prefill_attention(_t(3, 12, 128, dtype=BF16), k, v, tables, lens, cu, 3, 0.1)
    finally:
        JITFunction.run = run
    counts: dict[str, int] = {}
    for key in JOBS:
        name = key.split(" ", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: under the interpreter @triton.jit gives no compilable kernels")
    if sys.argv[1:] == ["--eager-table-variants"]:
        print(json.dumps(eager_table_variants()))
        sys.exit(0)
    if sys.argv[1:2] == ["--resources"]:  # [PATTERN]: only specializations whose label contains it
        print_resources(resources(sys.argv[2] if len(sys.argv) > 2 else ""))
        sys.exit(0)
    # an empty cache: a cached kernel skips code generation, and with it the note of the helpers it calls
    with tempfile.TemporaryDirectory(prefix="tlt-kernel-compile-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        report = check()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(report, indent=1))
    else:
        print(*report["specializations"], *report["problems"], sep="\n")
        print(f"{sum(n > 0 for n in report['compiled'].values())} of {len(report['compiled'])} kernels compiled")
