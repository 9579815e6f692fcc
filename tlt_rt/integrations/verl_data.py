"""The project's arithmetic word problems as verl's RL parquet files (the layout of verl's gsm8k example).

    python -m tlt_rt.integrations.verl_data OUT_DIR [--train 512] [--test 64] [--seed 0]

writes OUT_DIR/train.parquet and OUT_DIR/test.parquet, one row a problem:

    data_source   "tlt_rt/arithmetic" (verl's `data.reward_fn_key` column)
    prompt        [{"role": "user", "content": question + instruction}]  (verl's `data.prompt_key`)
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "42"}
    extra_info    {"split", "index", "question", "answer", "expression", "difficulty"}

Problems come from `ArithmeticTask` (word problems, the Qwen 0.5B config's mixed difficulty by default); the
test split holds out the problems of another seed, as `logging.eval_every` does. The instruction asks for
"The answer is N.", which `tlt_rt.train.rl.reward` reads; `tlt_rt.integrations.verl_reward` scores the
rollouts with it. Needs pyarrow only (no verl): the files can be made anywhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tlt_rt.train.heldout import HELD_OUT_SEED_OFFSET
from tlt_rt.train.rl.config import DEFAULT_INSTRUCTION
from tlt_rt.train.rl.tasks import ArithmeticTask

DATA_SOURCE = "tlt_rt/arithmetic"
# configs/qwen2.5-0.5b-math-gpu.yaml's mix: 1-2 digits, 1-3 operations a problem
DEFAULT_TASK = {"digits": 1, "max_digits": 2, "num_ops": 1, "max_ops": 3, "word_problems": True}


def task_for(split: str, seed: int = 0, **knobs: Any) -> ArithmeticTask:
    """The generator of a split: `train` draws from `seed`, `test` from the held-out seed beside it."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    kw = {**DEFAULT_TASK, **knobs}
    return ArithmeticTask(seed=seed + (HELD_OUT_SEED_OFFSET if split == "test" else 0), **kw)


def rows(
    split: str, n: int, seed: int = 0, instruction: str | None = DEFAULT_INSTRUCTION, **knobs: Any
) -> list[dict[str, Any]]:
    """`n` problems of `split` as verl rows (see the module's docstring)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    out = []
    for p in task_for(split, seed, **knobs).sample(n):
        content = f"{p.question}\n{instruction}" if instruction else p.question
        out.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": content}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": p.answer},
                "extra_info": {
                    "split": split,
                    "index": int(p.meta["index"]),
                    "question": p.question,
                    "answer": p.answer,
                    "expression": p.meta["expression"],
                    "difficulty": int(p.meta["difficulty"]),
                },
            }
        )
    return out


def write_parquet(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    import pyarrow as pa  # local: optional (tlt_rt[data]); only writing the files needs it
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(records)), path)
    return path


def build(out_dir: str | Path, train: int = 512, test: int = 64, seed: int = 0, **knobs: Any) -> dict[str, Path]:
    """Write `train.parquet` and `test.parquet` into `out_dir`; returns their paths by split."""
    out = Path(out_dir)
    return {
        split: write_parquet(rows(split, n, seed, **knobs), out / f"{split}.parquet")
        for split, n in (("train", train), ("test", test))
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=512, help="training problems (default 512)")
    ap.add_argument("--test", type=int, default=64, help="held-out problems (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--digits", type=int, default=DEFAULT_TASK["digits"])
    ap.add_argument("--max-digits", type=int, default=DEFAULT_TASK["max_digits"])
    ap.add_argument("--num-ops", type=int, default=DEFAULT_TASK["num_ops"])
    ap.add_argument("--max-ops", type=int, default=DEFAULT_TASK["max_ops"])
    a = ap.parse_args(argv)
    paths = build(a.out_dir, a.train, a.test, a.seed, digits=a.digits, max_digits=a.max_digits,
                  num_ops=a.num_ops, max_ops=a.max_ops)  # fmt: skip
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
