"""One drafter warm-up run (`warmup`): the target answers the task's prompts, a fresh drafter trains on those
answers, its accept length is measured against the perfect-drafter ceiling, and it is exported. The command
line is `python -m tlt_rt.train.drafter.warmup` (train/drafter/warmup.py)."""

from __future__ import annotations

import gc
import json
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from tlt_rt.models.default import load_tokenizer
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.eagle_export import export_eagle
from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.measure import (
    accept_and_answers,
    accept_length,
    ceiling,
    measuring_options,
    plot_curve,
    strategy_accept,
)
from tlt_rt.train.drafter.trainer import DrafterTrainer
from tlt_rt.train.drafter.warmup_data import collect_answers, gen_buckets, keep_answers
from tlt_rt.train.rl.data import ArithmeticTask, format_prompt

# share of a cosine schedule's steps its learning rate rises over
LR_WARMUP_SHARE = 0.03
# tokens of one packed training batch: the block-diagonal attention over a packed row costs its length
# squared, which a GPU hides and a CPU does not (16 prompts x 3 answers, 10 passes: 8192 tokens took 359 s
# to train to accept 1.18 at T=0.9, 1024 took ~100 s to reach 1.78, 6_2_12)
GPU_BATCH_TOKENS, CPU_BATCH_TOKENS = 8192, 1024


BASE_LR, BASE_WIDTH = 9e-4, 576  # the warm-up's learning rate at SmolLM2's width, where it was tuned


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low and middle layers beside the last: the third and the middle one of `num_layers`."""
    return tuple(sorted({min(2, num_layers - 2), num_layers // 2})) if num_layers > 2 else ()


def default_lr(hidden_size: int) -> float:
    """The warm-up's learning rate for a target `hidden_size` wide: BASE_LR up to BASE_WIDTH, falling as
    1 / width above it. Adam moves every weight by about lr a step, and a wider layer sums more of those
    moves into each output, so a fixed rate that suits a narrow model overshoots a wide one: at 9e-4 the
    drafter of Qwen2.5-1.5B (width 1,536) blew up within the first steps (loss 15 -> 96 -> 136, accept 18%
    of its ceiling after 58 steps on an H200), while the 576-wide SmolLM2's reached 80%."""
    return BASE_LR * min(1.0, BASE_WIDTH / hidden_size)


def warmup(
    target_path=None,
    out: str | Path = "runs/drafter",
    num_prompts: int = 256,
    held_out: int = 32,
    samples: int = 2,
    steps: int | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.9,
    strategy: str = "8_4_48",
    lr: float | None = None,
    batch_tokens: int | None = None,
    seed: int = 0,
    device: str | None = None,
    dtype: str = "auto",
    progress: bool = True,
    epochs: float = 10.0,
    noise_std: float = 0.0,
    token_weight: float = 1.0,
    hidden_weight: float = 1.0,
    unroll: int = 3,
    eval_temperatures: tuple[float, ...] = (0.0,),
    gen_batch: int = 256,
    unroll_context: str = "chain",
    loss_temperature: float = 1.0,
    sampled_weight: float = 0.0,
    draft_vocab: int = 0,
    fc_bias: bool = True,
    export_format: str = "sglang",
    task: ArithmeticTask | None = None,
    lr_schedule: str = "constant",
    greedy_answers: bool = True,
    curve_points: int = 0,
    feature_layers=(),
    also_strategies: tuple[str, ...] = (),
) -> dict:
    """steps=None trains for `epochs` passes over the generated tokens: a one-layer drafter over-fits a small
    set of answers (80 passes gave a held-out accept length of 1.22 on SmolLM2), so the data, not the step
    count, should grow. `unroll` passes feed the drafter its own predictions in training (drafter_loss), which
    lifts the agreement at depth 2+ (benchmarks/drafter_diagnosis.md); `token_weight` is the CE's weight
    and `hidden_weight` the feature regression's (0: the token loss alone, as EAGLE-3 trains). Accept length
    is measured at `temperature` and at each of `eval_temperatures` (greedy, 0.0, bounds the drafter alone: at
    T > 0 even a perfect drafter loses the steps where the target samples a token outside the tree). `gen_batch`
    caps the generating engine's batch.
    `unroll_context`, `loss_temperature`, `sampled_weight` and `draft_vocab` are the trainer's (drafter_loss,
    DrafterTrainer); `fc_bias=False` builds a drafter vLLM serves as is; `export_format` picks the engine layout.
    `task` makes the prompts (default: two-step two-digit word problems of `seed`). `lr_schedule="cosine"`
    rises over the first LR_WARMUP_SHARE of the steps and falls to a tenth of `lr` at the last one.
    `lr` defaults to `default_lr` of the target's width.
    `batch_tokens` (default: CPU_BATCH_TOKENS on a CPU, GPU_BATCH_TOKENS on a GPU) is one packed training row.
    `greedy_answers` adds each training prompt's greedy answer to the data, beside the sampled ones: the
    paths greedy decoding takes, which samples at T=1 visit rarely. `curve_points` > 1 measures the held-out
    accept length at `temperature` and its ceiling at that many evenly spaced points of training (the last
    is the final measure) and plots them against the training tokens seen (`curve.png` beside the drafter):
    how much warm-up a workload needs. `feature_layers` (target layers below the last) makes a drafter that
    fuses those layers' outputs with the last one's (EAGLE-3 features; "auto": `default_feature_layers`).
    `also_strategies` measures the trained drafter's held-out accept length and its ceiling at `temperature`
    with each of these strategies too (each on an engine of its own, sized for the held-out prompts), for the
    report's `accept_by_strategy` beside `strategy`'s: which tree shape comes closest to its ceiling."""
    temps = list(dict.fromkeys([temperature, *eval_temperatures]))
    if any(t < 0 for t in temps):
        raise ValueError(f"warmup: temperatures must be >= 0, got {temps}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if batch_tokens is None:
        batch_tokens = GPU_BATCH_TOKENS if torch.device(device).type == "cuda" else CPU_BATCH_TOKENS
    tok = load_tokenizer(target_path)
    task = task or ArithmeticTask(digits=2, num_ops=2, seed=seed)
    problems = task.sample(num_prompts + held_out)
    prompts = [format_prompt(p, tok) for p in problems]
    train_prompts, eval_prompts = prompts[:num_prompts], prompts[num_prompts:]
    params = SamplingParams(n=samples, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    evals = {t: SamplingParams(n=1, temperature=t, max_new_tokens=max_new_tokens, seed=seed + 1) for t in temps}

    t_start = time.perf_counter()
    # prompts admitted an eighth of the batch at a time at least (`prefill_min_samples`): admitted one a step as
    # places freed up, 1,024 prompts' answers spent 61 of their 132 s generating in prefill steps (an eager
    # forward each; H200). The batch then stays near full, so steps are captured at four sizes only (each size
    # is a capture and a compile on first use: with every default size the decode steps of 768 and of 1,024
    # prompts' answers took the same 56 s), and the block tables span the answers' length, not the model's
    plain = Engine.from_pretrained(target_path, speculative="off", dtype=dtype, device=device, max_batch=gen_batch,
                                   prefill_min_samples=max(1, gen_batch // 8), graph_batches=gen_buckets(gen_batch),
                                   max_context=max(len(p) for p in prompts) + max_new_tokens + 1)  # fmt: skip
    if feature_layers == "auto":
        feature_layers = default_feature_layers(plain.target.arch.num_hidden_layers)
    plain.target.set_feature_layers(feature_layers)  # the answers' hidden states carry the fused layers' too
    t0 = time.perf_counter()
    load_s = t0 - t_start
    gen_split: dict = {}
    ids, hidden, n_tokens = collect_answers(plain, train_prompts, params, split=gen_split)
    hidden = keep_answers(plain, hidden)
    if greedy_answers:
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=seed)
        more_ids, more_hidden, n_greedy = collect_answers(plain, train_prompts, greedy, split=gen_split)
        ids, hidden, n_tokens = ids + more_ids, keep_answers(plain, hidden + more_hidden), n_tokens + n_greedy
    data_device = hidden[0].device if hidden else torch.device("cpu")
    buffer = DrafterBuffer(max_steps=1, device=data_device)
    buffer.add(0, ids, hidden)
    del ids, hidden
    gen_split["preemptions"] = plain.stats()["preemptions"]
    gen_split["mean_decode_batch"] = gen_split["decode_rows"] / max(1, gen_split["decode_steps"])  # over both calls
    gen_s = time.perf_counter() - t0

    target = plain.target
    with torch.random.fork_rng(devices=[]):  # the drafter's initial weights follow `seed`: a warm-up repeats
        torch.manual_seed(seed)
        drafter = Drafter(target.arch, target, fc_bias=fc_bias, feature_layers=target.feature_layers).to(device)

    def measuring_engine() -> Engine:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sized for the held-out prompts, its steps captured at their batch alone
            return Engine(target, drafter=drafter, **measuring_options(strategy, eval_prompts, max_new_tokens))

    spec = measuring_engine()
    drafter.eval()
    t_before = time.perf_counter()
    before = {t: accept_length(spec, eval_prompts, p) for t, p in evals.items()}
    measure_s = time.perf_counter() - t_before

    if steps is None:
        steps = max(1, round(epochs * buffer.num_tokens / batch_tokens))
    lr = default_lr(target.arch.hidden_size) if lr is None else lr
    drafter.train()
    trainer = DrafterTrainer(
        drafter,
        buffer,
        lr=lr,
        batch_tokens=batch_tokens,
        seed=seed,
        noise_std=noise_std,
        token_weight=token_weight,
        hidden_weight=hidden_weight,
        unroll=unroll,
        unroll_context=unroll_context,
        temperature=loss_temperature,
        sampled_weight=sampled_weight,
        draft_vocab=draft_vocab,
        lr_schedule=lr_schedule,
        lr_warmup_steps=round(LR_WARMUP_SHARE * steps) if lr_schedule == "cosine" else 0,
        lr_total_steps=steps if lr_schedule == "cosine" else 0,
    )
    if trainer.refresh_vocab():  # a reduced vocabulary from the generated answers (the untrained measure used all ids)
        # and an engine of its own for every measure from here on: a captured step keeps the head it was captured
        # with (a graph never sees a later `set_draft_vocab`), so the untrained measure's engine would go on drafting
        # over the full vocabulary, not the reduced head the drafter is trained for. Until this, the main strategy
        # (and the curve) were measured so: 8_4_32 read 71-73% of its ceiling on H200 where the other strategies,
        # each on an engine built after the vocabulary, read 75-80%.
        del spec
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        spec = measuring_engine()
    bar = tqdm(range(steps), desc="drafter warm-up", disable=not progress, file=sys.stderr)
    t1 = time.perf_counter()
    metrics: dict = {}
    marks = {round(i * steps / curve_points) for i in range(1, curve_points)} if curve_points > 1 else set()
    curve, spent = [], 0.0  # spent: seconds of the curve's own measures, left out of the training time
    for i in bar:
        metrics = trainer.step()
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.3f}")
        if i + 1 in marks:
            t_eval = time.perf_counter()
            so_far = gen_s + t_eval - t1 - spent  # generation and training only, not the curve's measures
            drafter.eval()
            acc, answers = accept_and_answers(spec, eval_prompts, evals[temperature])
            curve.append(dict(steps=i + 1, train_tokens=(i + 1) * batch_tokens, accept=acc,
                              ceiling=ceiling(target, answers, temperature, strategy), seconds=so_far))  # fmt: skip
            drafter.train()
            spent += time.perf_counter() - t_eval
    train_s = time.perf_counter() - t1 - spent
    drafter.eval()
    t_after = time.perf_counter()
    measured = {t: accept_and_answers(spec, eval_prompts, p) for t, p in evals.items()}
    after = {t: acc for t, (acc, _) in measured.items()}
    ceilings = {t: ceiling(target, answers, t, strategy) for t, (_, answers) in measured.items()}
    by_strategy = {strategy: {"accept": after[temperature], "ceiling": ceilings[temperature]}}
    for other in dict.fromkeys(also_strategies):
        if other in by_strategy:
            continue
        by_strategy[other] = strategy_accept(target, drafter, other, eval_prompts, evals[temperature], temperature)
    for row in by_strategy.values():
        row["ratio"] = row["accept"] / row["ceiling"] if row["ceiling"] else float("nan")
    measure_s += spent + time.perf_counter() - t_after
    if curve_points > 1:
        acc, _ = measured[temperature]
        curve.append(dict(steps=steps, train_tokens=steps * batch_tokens, accept=acc, ceiling=ceilings[temperature],
                          seconds=gen_s + train_s))  # fmt: skip
    folder = export_eagle(drafter, out, format=export_format)
    if curve:
        plot_curve(curve, Path(folder) / "curve.png", f"{target_path or 'smollm2'}, {strategy}, T={temperature:g}")
    report = {
        "target": str(target_path or "smollm2"),
        "strategy": strategy,
        "temperature": temperature,
        "train_prompts": num_prompts,
        "held_out_prompts": held_out,
        "generated_tokens": n_tokens,
        # where the warm-up's time went: loading the target (and capturing its steps), generating the answers,
        # training, and measuring accept lengths and ceilings (before, along the curve, after)
        "load_seconds": load_s,
        "generation_seconds": gen_s,
        "generation_split": gen_split,  # prefill / decode / sd / other seconds, decode steps, mean batch, preemptions
        "answers_device": str(data_device),  # where the answers' hidden rows were kept for training
        "train_steps": steps,
        "batch_tokens": batch_tokens,
        "lr": lr,
        "lr_schedule": lr_schedule,
        "greedy_answers": greedy_answers,
        "unroll": unroll,
        "unroll_context": unroll_context,
        "loss_temperature": loss_temperature,
        "sampled_weight": sampled_weight,
        "draft_vocab": drafter.draft_vocab_size,
        "token_weight": token_weight,
        "hidden_weight": hidden_weight,
        "feature_layers": list(target.feature_layers),
        "train_seconds": train_s,
        "measure_seconds": measure_s,
        "total_seconds": time.perf_counter() - t_start,
        "final_loss": metrics.get("loss"),
        "final_top1": metrics.get("top1"),
        "accept_length_before": before[temperature],
        "accept_length_after": after[temperature],
        "accept_length": {f"{t:g}": {"before": before[t], "after": after[t], "ceiling": ceilings[t]} for t in temps},
        # at `temperature`, the trained drafter with `strategy` and each of `also_strategies`: accept, ceiling, ratio
        "accept_by_strategy": by_strategy,
        "drafter": str(folder),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "curve": curve,
    }
    (Path(folder) / "warmup.json").write_text(json.dumps(report, indent=2))
    return report
