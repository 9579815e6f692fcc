"""`python -m tlt_rt.export_drafter CHECKPOINT_OR_RUN OUT --format sglang|vllm`: the drafter after RL, servable.

CHECKPOINT_OR_RUN is a run folder (its latest complete checkpoint), a run checkpoint (`.../step_N`), a
drafter checkpoint (`drafter.safetensors` + `info.json`) or an EAGLE folder. OUT receives a draft-model
folder the chosen engine loads as an EAGLE draft model (layouts: tlt_rt.models.eagle_export); the command
prints the serving flags. The drafter shares embedding and LM head with the target it was trained with:
a run checkpoint's policy/ by default (the policy after RL, which is what you would serve), else --target.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from tlt_rt.ir.strategy import Strategy
from tlt_rt.models.eagle_export import FORMATS, TOKEN_MAP, ExportError, export_eagle, find_drafter, load_eagle
from tlt_rt.models.loader import DTYPES, load_target


def default_target(source: Path) -> Path | None:
    """The policy folder saved beside a run checkpoint's drafter, if there is one."""
    kind, folder = find_drafter(source)
    policy = folder.parent / "policy"
    return policy if kind == "checkpoint" and (policy / "config.json").is_file() else None


def serving_flags(fmt: str, target: str, out: Path, strategy: Strategy, token_map: bool) -> str:
    """The command line that serves `target` with the exported drafter (SGLang's tree = our strategy)."""
    if fmt == "sglang":
        cmd = [
            "python", "-m", "sglang.launch_server", "--model-path", target,
            "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(out),
            "--speculative-num-steps", str(strategy.depth), "--speculative-eagle-topk", str(strategy.topk),
            "--speculative-num-draft-tokens", str(strategy.verify_tokens),
        ]  # fmt: skip
        if token_map:
            cmd += ["--speculative-token-map", str(out / TOKEN_MAP)]
        return shlex.join(cmd)
    spec = {"method": "eagle", "model": str(out), "num_speculative_tokens": strategy.depth}
    return shlex.join(["vllm", "serve", target, "--speculative-config", json.dumps(spec)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="run folder, run checkpoint, drafter checkpoint or EAGLE folder")
    ap.add_argument("out", help="folder to write the draft model into")
    ap.add_argument("--format", choices=FORMATS, required=True, help="the serving engine that will load it")
    ap.add_argument("--target", default=None, help="the target it drafts for (default: the checkpoint's policy/)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of the written weights")
    ap.add_argument("--full-vocab", action="store_true", help="drop a reduced draft vocabulary (draft over all ids)")
    ap.add_argument("--drop-fc-bias", action="store_true", help="vLLM: drop a non-zero fc bias (drafts then differ)")
    ap.add_argument("--strategy", default="6_4_32", help="tree shown in the serving flags (depth_topk_verify)")
    a = ap.parse_args(argv)
    try:
        strategy = Strategy.parse(a.strategy)
        source = Path(a.source)
        target_path = a.target or default_target(source)
        target = load_target(target_path, dtype="float32", device="cpu")
        drafter = load_eagle(source, target, dtype=torch.float32, device="cpu")
        out = export_eagle(
            drafter,
            a.out,
            dtype=DTYPES[a.dtype],
            format=a.format,
            full_vocab=a.full_vocab,
            drop_fc_bias=a.drop_fc_bias,
        )
    except (ExportError, FileNotFoundError, ValueError) as e:
        print(f"export_drafter: {e}", file=sys.stderr)
        return 2
    vocab = (
        "full vocabulary" if a.full_vocab or drafter.d2t is None else f"{drafter.d2t.numel()}-token draft vocabulary"
    )
    print(f"wrote {a.format} EAGLE draft model ({vocab}) to {out}")
    shown = str(target_path or getattr(target, "source_path", "TARGET"))
    print(serving_flags(a.format, shown, out, strategy, (out / TOKEN_MAP).is_file()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
