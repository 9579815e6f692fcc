"""Spawn a few gloo ranks on CPU, run a function in each, and fail the test if they hang.

    spawn_ranks(fn, world=2, args=(out_dir,))   # fn(rank, world, *args) runs with the default group formed

`fn` must be importable by the children (a module-level function of a test module). `run_checks` is the
usual body: run named checks, record "ok" or the traceback per check, write them as JSON per rank.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, args: tuple) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    # gloo's pairs over loopback, as the rendezvous is: without it gloo resolves the host's name for the address it
    # offers the other ranks, one more thing a sandboxed CI machine can get wrong
    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable, world: int = 2, args: tuple = (), timeout_s: float = 120.0) -> None:
    """Run `fn(rank, world, *args)` in `world` spawned processes; pytest.fail if they take over `timeout_s`.

    A rank killed by a signal (gloo aborts when its TCP rendezvous breaks, e.g. the free port was taken
    between choosing and binding it) is retried on a new port, twice; an exception raised by `fn` is not."""
    attempts = 3
    for attempt in range(attempts):
        ctx = mp.start_processes(
            _entry, args=(fn, world, free_port(), args), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    pytest.fail(f"{world} ranks running {fn.__name__} did not finish within {timeout_s:.0f} s")
            return
        except mp.ProcessExitedException as e:
            if attempt == attempts - 1 or e.signal_name is None:
                raise


def run_checks(rank: int, checks: dict[str, Callable], cases, out_dir: str | Path) -> None:
    """Call every `check(case, rank)`; write {"check[case]": "ok" or the traceback} to out_dir/rank{rank}.json."""
    results = {}
    try:
        for name, fn in checks.items():
            for case in cases:
                try:
                    fn(case, rank)
                    results[f"{name}[{case}]"] = "ok"
                except Exception:
                    results[f"{name}[{case}]"] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def read_checks(out_dir: str | Path, world: int) -> list[dict[str, str]]:
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
