"""Print a decode step as the program the engine lowers and captures: `python -m tlt_rt program OPTION`.

    python -m tlt_rt program 8_4_32                               # a speculative step, Qwen2.5-Coder-1.5B's shapes
    python -m tlt_rt program 6_2_12 --mode sampled --batch 8 --shape smollm2-135m
    python -m tlt_rt program plain                                # plain decoding; `draw`: a first token

Each node with the tensors it reads (<-) and makes (->), their shapes and dtypes ("act": the model's compute
dtype), then the function the lowering emits for it (codegen/lower.py). OPTION is a strategy
DEPTH_TOPK_VERIFYTOKENS, `plain` (plain decoding) or `draw` (a sample's first token after its prefill).
"""

from __future__ import annotations

import argparse
import sys

from tlt_rt.codegen.lower import lower
from tlt_rt.ir.program import ACCEPT_MODES, IRError, StepProgram
from tlt_rt.ir.strategy import Bucket, Strategy
from tlt_rt.models.shapes import KNOWN_SHAPES


def program_for(option: str, mode: str, rows: int | None) -> StepProgram:
    """The program of `option`: a strategy's speculative step, `plain` decoding or a first `draw`."""
    if option == "plain":
        return StepProgram.plain_decode(mode)
    if option == "draw":
        return StepProgram.first_draw(mode)
    return StepProgram.speculative(Strategy.parse(option), mode, rows)


def main(argv: list[str] | None = None) -> int:
    head, rest = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(prog="python -m tlt_rt program", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("option", help="a strategy (e.g. 8_4_32), plain or draw")
    ap.add_argument("--mode", choices=ACCEPT_MODES, default="greedy", help="the acceptance walk (default greedy)")
    ap.add_argument("--batch", type=int, default=4, help="the batch bucket B (default 4)")
    ap.add_argument("--shape", choices=sorted(KNOWN_SHAPES), default="qwen2.5-coder-1.5b",
                    help="whose vocabulary and hidden sizes (default qwen2.5-coder-1.5b)")  # fmt: skip
    ap.add_argument("--rows", type=int, default=None, help="the drafter's catch-up rows R (default depth + 1)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=4096, help="sizes the block table (default 4096)")
    args = ap.parse_args(argv)
    shape = KNOWN_SHAPES[args.shape]
    try:
        program = program_for(args.option, args.mode, args.rows)
        blocks = -(-args.max_context // args.block_size)
        bucket = Bucket(args.batch, program.strategy, blocks, args.block_size, shape["vocab_size"],
                        shape["hidden_size"])  # fmt: skip
        text = program.pretty(bucket)
        lowered = lower(program, bucket, "cpu")
    except (IRError, ValueError) as err:
        print(f"tlt_rt program: {err}", file=sys.stderr)
        return 2
    print(f"{args.option} ({args.mode}), {args.shape}")
    print(text)
    print(str(lowered).replace("on cpu", "(the same calls on CUDA, with its Triton kernels)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
