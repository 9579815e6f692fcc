"""Does online drafter training follow a policy that has moved? A CPU experiment on SmolLM2.

    python benchmarks/drafter_shift.py [--train 24] [--held-out 8] [--steps 120] [--shift-steps 30]
                                       [--online-steps 60] [--out FILE]

1. Policy A is SmolLM2-135M-Instruct. A drafter trains on A's greedy answers to arithmetic prompts (the
   warm-up's data, engine-generated with hidden states).
2. The policy moves: A is fine-tuned in place for --shift-steps steps on terse answers ("17 * 3 = 51.") to
   the training prompts, a synthetic stand-in for RL moving the policy (its answers change in style and
   length). B's own greedy answers and hidden states are then generated with the moved weights.
3. The drafter, unchanged, is measured on B's held-out answers (teacher-forced chain agreement with B's
   features and B's head, `tlt_rt.train.drafter.eval`); then the same trainer (its optimizer state kept,
   as the spot trainer keeps it across RL steps) trains on B's training answers for --online-steps, and the
   drafter is measured again, on B and, for forgetting, on A's held-out answers as A's features gave them.

Chain agreement is engine-independent; `tests/test_drafter_eval.py` checks that the engine's chain accept
length equals it. Reduced draft vocabulary (--draft-vocab) keeps the CPU run to minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_diagnosis import agreement_report, reduced_vocab, sample_answers  # noqa: E402

from tlt_rt.models.default import load_tokenizer  # noqa: E402
from tlt_rt.models.drafter import Drafter  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402
from tlt_rt.train.drafter.data import DrafterBuffer  # noqa: E402
from tlt_rt.train.drafter.trainer import DrafterTrainer  # noqa: E402
from tlt_rt.train.rl.data import ArithmeticTask, format_prompt  # noqa: E402


def terse_answer(problem) -> str:
    """The moved policy's answer style: the expression and its value, nothing else."""
    expr = problem.meta.get("expression")
    return f"{expr} = {problem.answer}." if expr else f"The answer is {problem.answer}."


def shift_policy(target, tok, problems, prompts, steps: int, lr: float, batch: int, seed: int) -> list[float]:
    """Fine-tune `target` in place on terse answers (loss on the answer tokens only); returns the losses."""
    gen = torch.Generator().manual_seed(seed)
    eos = tok.eos_token_id
    rows = [
        (p, tok.encode(terse_answer(q), add_special_tokens=False) + [eos])
        for q, p in zip(problems, prompts, strict=True)
    ]
    opt = torch.optim.AdamW([p for p in target.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    target.train()
    losses = []
    for _ in range(steps):
        pick = torch.randperm(len(rows), generator=gen)[:batch].tolist()
        seqs = [rows[i][0] + rows[i][1] for i in pick]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), eos, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for j, i in enumerate(pick):
            p, a = rows[i]
            ids[j, : len(p) + len(a)] = torch.tensor(p + a)
            labels[j, len(p) - 1 : len(p) + len(a) - 1] = torch.tensor(a)  # position t predicts token t+1
        logits = target(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    target.eval()
    return losses


def train_steps(trainer: DrafterTrainer, steps: int) -> dict:
    t0, m = time.perf_counter(), {}
    for _ in range(steps):
        m = trainer.step()
    return {"seconds": round(time.perf_counter() - t0, 1), "loss": round(m["loss"], 4), "top1": round(m["top1"], 3)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=24, help="training prompts")
    ap.add_argument("--held-out", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=120, help="drafter training steps on policy A")
    ap.add_argument("--shift-steps", type=int, default=30, help="fine-tuning steps that move the policy")
    ap.add_argument("--shift-lr", type=float, default=3e-5)
    ap.add_argument("--online-steps", type=int, default=60, help="drafter steps on the moved policy's answers")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--draft-vocab", type=int, default=2048, help="reduced draft vocabulary (0: full)")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="append the report as one JSON line")
    a = ap.parse_args(argv)
    for name in ("train", "held_out", "steps", "shift_steps", "online_steps", "depth"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    warnings.simplefilter("ignore")
    torch.manual_seed(a.seed)
    torch.set_grad_enabled(True)
    tok = load_tokenizer(None)
    problems = ArithmeticTask(digits=2, num_ops=2, seed=a.seed).sample(a.train + a.held_out)
    prompts = [format_prompt(p, tok) for p in problems]
    train_prompts, eval_prompts = prompts[: a.train], prompts[a.train :]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=a.max_new_tokens)
    plain = Engine.from_pretrained(None, speculative="off", dtype="float32", device="cpu")
    target = plain.target
    rep: dict = {"args": vars(a)}

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.perf_counter()
    a_train, a_eval = sample_answers(plain, train_prompts, greedy), sample_answers(plain, eval_prompts, greedy)
    rep["generate_a_seconds"] = round(time.perf_counter() - t0, 1)
    drafter = Drafter(target.arch, target, draft_vocab=reduced_vocab(a_train, target.arch.vocab_size, a.draft_vocab))
    buf = DrafterBuffer(max_steps=1, seed=a.seed)
    buf.add(0, [s["ids"] for s in a_train], [s["hidden"] for s in a_train])
    trainer = DrafterTrainer(drafter, buf, lr=a.lr, batch_tokens=a.batch_tokens, seed=a.seed)
    rep["train_on_a"] = train_steps(trainer, a.steps)
    drafter.eval()
    rep["a_held_out_before_shift"] = agreement_report(drafter, a_eval, a.depth)
    log(json.dumps({k: rep[k] for k in ("train_on_a", "a_held_out_before_shift")}))

    # the policy moves in place, as the learner's update reaches the engine's target; the drafter shares its
    # embedding, norm and head, so its reduced head is re-sliced from the new one
    rep["shift_losses"] = [round(x, 3) for x in shift_policy(target, tok, problems[: a.train], train_prompts,
                                                                a.shift_steps, a.shift_lr, 8, a.seed)]  # fmt: skip
    drafter.bind(target)
    for p in target.parameters():
        p.requires_grad_(False)
    moved = Engine(target, speculative="off")
    b_train, b_eval = sample_answers(moved, train_prompts, greedy), sample_answers(moved, eval_prompts, greedy)
    rep["answer_tokens"] = {
        "a": sum(s["ids"].numel() - s["prompt_len"] for s in a_eval) / len(a_eval),
        "b": sum(s["ids"].numel() - s["prompt_len"] for s in b_eval) / len(b_eval),
    }
    rep["b_example"] = tok.decode(b_eval[0]["ids"][b_eval[0]["prompt_len"] :].tolist())
    drafter.eval()
    rep["b_held_out_before_online"] = agreement_report(drafter, b_eval, a.depth)
    log(json.dumps({k: rep[k] for k in ("shift_losses", "answer_tokens", "b_example", "b_held_out_before_online")}))

    drafter.train()
    buf.add(1, [s["ids"] for s in b_train], [s["hidden"] for s in b_train])  # the buffer keeps the last step
    rep["online_on_b"] = train_steps(trainer, a.online_steps)
    drafter.eval()
    rep["b_held_out_after_online"] = agreement_report(drafter, b_eval, a.depth)
    log(json.dumps({k: rep[k] for k in ("online_on_b", "b_held_out_after_online")}))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(rep) + "\n")
    return rep


if __name__ == "__main__":
    main()
