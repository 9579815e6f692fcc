"""Drafter warm-up: train a drafter from nothing on the target's own generations for the task's prompts.

    python -m tlt_rt.train.drafter.warmup --out runs/drafter-smollm2 [--target PATH] [--prompts 256] [--steps 2000]

1. the target generates `--samples` answers to each training prompt (plain decoding at the RL temperature,
   hidden states returned as tensors) and its greedy answer (unless --no-greedy-answers), so no external
   data is needed;
2. a fresh drafter trains on those (token, hidden) sequences with a progress bar;
3. accept length with strategy `--strategy` is measured on held-out prompts before and after training,
   then the drafter is exported as an EAGLE draft-model folder (`tlt_rt.models.eagle_export`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from tlt_rt.ir.strategy import Strategy
from tlt_rt.models.default import load_tokenizer
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.eagle_export import export_eagle
from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.rollout.config import DEFAULT_STRATEGIES
from tlt_rt.rollout.speculative import scratch_tokens
from tlt_rt.rollout.stats import timeline_split
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.eval import oracle_tree_steps
from tlt_rt.train.drafter.trainer import DrafterTrainer
from tlt_rt.train.rl.data import ArithmeticTask, format_prompt

# share of a cosine schedule's steps its learning rate rises over
LR_WARMUP_SHARE = 0.03
# tokens of one packed training batch: the block-diagonal attention over a packed row costs its length
# squared, which a GPU hides and a CPU does not (16 prompts x 3 answers, 10 passes: 8192 tokens took 359 s
# to train to accept 1.18 at T=0.9, 1024 took ~100 s to reach 1.78, 6_2_12)
GPU_BATCH_TOKENS, CPU_BATCH_TOKENS = 8192, 1024


def generate_data(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    buffer: DrafterBuffer,
    step: int = 0,
    also: tuple[DrafterBuffer, ...] = (),
    split: dict | None = None,
) -> int:
    """Generate with the target and add (tokens, hidden) of every whole sequence to the buffer (and to each
    buffer of `also`); returns the answer tokens generated. `split`, a dict, receives where the generation's
    time went, summed over calls (rollout.stats.timeline_split)."""
    first, t0 = len(engine.timeline), time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(**{**params.__dict__, "return_hidden": True}))
    if split is not None:
        for k, v in timeline_split(engine.timeline[first:], time.perf_counter() - t0).items():
            split[k] = split.get(k, 0) + v
    ids, hidden = [], []
    for o in outs:
        seq = torch.tensor(prompts[o.prompt_index] + o.token_ids)
        # hidden covers every position but the last token's
        ids.append(seq[:-1])
        hidden.append(o.hidden.float().cpu())
    for b in (buffer, *also):
        b.add(step, ids, hidden)
    return sum(len(o.token_ids) for o in outs)


def accept_length(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Mean tokens emitted per speculative step on `prompts` (the engine must speculate on every step)."""
    return accept_and_answers(engine, prompts, params)[0]


def accept_and_answers(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[dict]]:
    """`accept_length`, and the answers it counted as `drafter_eval` samples ({"ids": prompt + answer on the
    target's device, "prompt_len"}), on which the perfect-drafter ceiling of the same steps is computed."""
    before = engine.stats()["accept_length_hist"]
    outs = engine.generate(prompts, params)
    hist = {k: v - before.get(k, 0) for k, v in engine.stats()["accept_length_hist"].items()}
    n = sum(hist.values())
    acc = sum(k * v for k, v in hist.items()) / n if n else float("nan")
    dev = engine.target.lm_head.weight.device
    answers = [
        {
            "ids": torch.tensor(prompts[o.prompt_index] + o.token_ids, device=dev),
            "prompt_len": len(prompts[o.prompt_index]),
        }
        for o in outs
    ]
    return acc, answers


def ceiling(target, answers: list[dict], temperature: float, strategy: str) -> float:
    """The perfect-drafter ceiling of `strategy`'s tree and verify budget on `answers` (oracle_tree_steps)."""
    st = Strategy.parse(strategy)
    chunk = 512 if target.lm_head.weight.device.type == "cuda" else 64  # root rows per batched walk
    return oracle_tree_steps(target, answers, temperature, st.depth, st.topk, st.verify_tokens, chunk)


BLOCK_SIZE = 16  # the KV-cache blocks of `strategy_accept`'s engines


def gen_buckets(gen_batch: int) -> list[int]:
    """The batch sizes the data-generating engine captures: quarters of `gen_batch` (the batch is near full
    but for the last answers of a call, which run padded up to a quarter)."""
    return sorted({max(1, gen_batch * k // 4) for k in range(1, 5)})


def strategy_accept(target, drafter, strategy: str, prompts: list[list[int]], params: SamplingParams,
                    temperature: float) -> dict:  # fmt: skip
    """{"accept", "ceiling"} of `drafter` with `strategy` on `prompts` (an engine of its own, its KV cache sized
    for these prompts rather than half the free memory, released after)."""
    st = Strategy.parse(strategy)
    longest = max(len(p) for p in prompts) + params.max_new_tokens + scratch_tokens(st) + 1
    blocks = 2 * len(prompts) * params.n * -(-longest // BLOCK_SIZE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(target, drafter=drafter, speculative="on", strategies=(strategy,), num_blocks=blocks,
                        block_size=BLOCK_SIZE, max_batch=max(1, len(prompts) * params.n))  # fmt: skip
    acc, answers = accept_and_answers(engine, prompts, params)
    out = {"accept": acc, "ceiling": ceiling(target, answers, temperature, strategy)}
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


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
    buffer = DrafterBuffer(max_steps=1)
    gen_split: dict = {}
    n_tokens = generate_data(plain, train_prompts, params, buffer, split=gen_split)
    if greedy_answers:
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=seed)
        n_tokens += generate_data(plain, train_prompts, greedy, buffer, split=gen_split)
    gen_split["preemptions"] = plain.stats()["preemptions"]
    gen_split["mean_decode_batch"] = gen_split["decode_rows"] / max(1, gen_split["decode_steps"])  # over both calls
    gen_s = time.perf_counter() - t0

    target = plain.target
    with torch.random.fork_rng(devices=[]):  # the drafter's initial weights follow `seed`: a warm-up repeats
        torch.manual_seed(seed)
        drafter = Drafter(target.arch, target, fc_bias=fc_bias, feature_layers=target.feature_layers).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sized for the held-out prompts: no step captured at a batch never run
        longest = max(len(p) for p in eval_prompts) + max_new_tokens + scratch_tokens(Strategy.parse(strategy)) + 1
        spec = Engine(target, drafter=drafter, speculative="on", strategies=(strategy,), max_batch=len(eval_prompts),
                      max_context=longest)  # fmt: skip
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
    trainer.refresh_vocab()  # a reduced vocabulary from the generated answers (the untrained measure used all ids)
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


def plot_curve(curve: list[dict], path: Path, title: str) -> Path:
    """Accept length and its ceiling against the training tokens seen, with the ratio on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [c["train_tokens"] / 1e6 for c in curve]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(x, [c["accept"] for c in curve], "o-", label="drafter")
    ax.plot(x, [c["ceiling"] for c in curve], "s--", label="perfect drafter (ceiling)")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("accept length (tokens a step)")
    ax.set_ylim(bottom=1.0)
    ratio = ax.twinx()
    ratio.plot(x, [c["accept"] / c["ceiling"] for c in curve], ":", color="grey", label="drafter / ceiling")
    ratio.set_ylabel("drafter / ceiling")
    ratio.set_ylim(0, 1)
    lines = ax.get_legend_handles_labels()
    more = ratio.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    ax.set_title(f"drafter warm-up: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--out", default="runs/drafter")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--held-out", type=int, default=32)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="default: --epochs passes over the generated data")
    ap.add_argument("--epochs", type=float, default=10.0)
    ap.add_argument("--noise-std", type=float, default=0.0, help="Gaussian noise on input features")
    ap.add_argument("--token-weight", type=float, default=1.0, help="CE weight of the next-token loss")
    ap.add_argument("--hidden-weight", type=float, default=1.0,
                    help="weight of the feature regression (0 = the token loss alone)")  # fmt: skip
    ap.add_argument("--unroll", type=int, default=3, help="training passes fed the drafter's own predictions")
    ap.add_argument("--unroll-context", choices=("chain", "shifted"), default="chain",
                    help="attention context of unrolled passes (drafter_loss)")  # fmt: skip
    ap.add_argument("--loss-temperature", type=float, default=1.0, help="temperature of the soft targets (0: argmax)")
    ap.add_argument("--sampled-weight", type=float, default=0.0, help="CE weight on the sampled next token")
    ap.add_argument("--draft-vocab", type=int, default=0, help="reduced draft vocabulary size (0 = full)")
    ap.add_argument("--feature-layers", nargs="*", default=[],
                    help="target layers whose outputs the drafter fuses with the last one's (EAGLE-3), or 'auto' "
                    "(the third and the middle layer); none = the last layer's feature alone")  # fmt: skip
    ap.add_argument("--no-fc-bias", action="store_true", help="a drafter without fc bias (vLLM serves it as is)")
    ap.add_argument("--format", default="sglang", choices=("sglang", "vllm"), help="layout of the exported drafter")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.9, help="sampling temperature of the training data")
    ap.add_argument("--eval-temperatures", type=float, nargs="*", default=[0.0],
                    help="accept length is also measured at these (0 = greedy)")  # fmt: skip
    ap.add_argument("--gen-batch", type=int, default=256, help="batch of the engine that generates the data")
    ap.add_argument("--strategy", default="8_4_48")
    ap.add_argument("--also-strategies", nargs="*", default=[],
                    help="measure the trained drafter with these strategies too ('default': the engine's default "
                    "set): accept and ceiling of each on the held-out answers")  # fmt: skip
    ap.add_argument("--lr", type=float, default=None,
                    help=f"peak rate (default: {BASE_LR:g} up to width {BASE_WIDTH}, then as 1/width)")  # fmt: skip
    ap.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant")
    ap.add_argument("--no-greedy-answers", dest="greedy_answers", action="store_false",
                    help="train on the sampled answers only (default: each prompt's greedy answer too)")  # fmt: skip
    ap.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="tokens per training batch (default: 8192 on a GPU, 1024 on a CPU)",
    )
    ap.add_argument("--curve", type=int, default=0, help="points of the accept-vs-training-tokens curve (0 = none)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0,
                    help="fixes the answers, the drafter's initial weights and the data order")  # fmt: skip
    ap.add_argument(
        "--config",
        default=None,
        help="an RL config whose arithmetic task makes the prompts (the "
        "workload the drafter will serve); default: two-step two-digit word problems",
    )
    a = ap.parse_args(argv)
    task = None
    if a.config:
        try:
            task = ArithmeticTask.from_config_file(a.config)
        except ValueError as e:
            ap.error(f"--config {e}")
    rep = warmup(
        a.target,
        a.out,
        a.prompts,
        a.held_out,
        a.samples,
        a.steps,
        a.max_new_tokens,
        a.temperature,
        a.strategy,
        a.lr,
        a.batch_tokens,
        seed=a.seed,
        device=a.device,
        epochs=a.epochs,
        noise_std=a.noise_std,
        token_weight=a.token_weight,
        hidden_weight=a.hidden_weight,
        unroll=a.unroll,
        eval_temperatures=tuple(a.eval_temperatures),
        gen_batch=a.gen_batch,
        unroll_context=a.unroll_context,
        loss_temperature=a.loss_temperature,
        sampled_weight=a.sampled_weight,
        draft_vocab=a.draft_vocab,
        fc_bias=not a.no_fc_bias,
        export_format=a.format,
        task=task,
        lr_schedule=a.lr_schedule,
        greedy_answers=a.greedy_answers,
        curve_points=a.curve,
        feature_layers="auto" if a.feature_layers == ["auto"] else [int(i) for i in a.feature_layers],
        also_strategies=tuple(DEFAULT_STRATEGIES if a.also_strategies == ["default"] else a.also_strategies),
    )
    print(
        f"{rep['generated_tokens']} tokens generated in {rep['generation_seconds']:.0f}s, "
        f"{rep['train_steps']} steps in {rep['train_seconds']:.0f}s (of {rep['total_seconds']:.0f}s: loading "
        f"{rep['load_seconds']:.0f}s, measuring {rep['measure_seconds']:.0f}s); drafter in {rep['drafter']}"
    )
    g = rep["generation_split"]
    print(
        f"generation: prefill {g['prefill_seconds']:.1f}s, decode {g['decode_seconds'] + g['sd_seconds']:.1f}s in "
        f"{g['decode_steps']} steps of {g['mean_decode_batch']:.0f} sequences on average, between steps "
        f"{g['other_seconds']:.1f}s, {g['preemptions']} preemptions"
    )
    for t, acc in rep["accept_length"].items():
        print(
            f"accept length with {rep['strategy']} at T={t}: {acc['before']:.2f} untrained -> {acc['after']:.2f} "
            f"(a perfect drafter: {acc['ceiling']:.2f}, {acc['after'] / acc['ceiling']:.0%} of it)"
        )
    if len(rep["accept_by_strategy"]) > 1:
        rows = sorted(rep["accept_by_strategy"].items(), key=lambda kv: -kv[1]["ratio"])
        print(f"at T={rep['temperature']:g}, by strategy (accept of ceiling): " + ", ".join(
            f"{name} {r['accept']:.2f} of {r['ceiling']:.2f} ({r['ratio']:.0%})" for name, r in rows))  # fmt: skip
    for c in rep["curve"]:
        print(f"  after {c['train_tokens'] / 1e6:.2f}M training tokens ({c['seconds']:.0f}s): accept {c['accept']:.2f} "
              f"of {c['ceiling']:.2f} ({c['accept'] / c['ceiling']:.0%})")  # fmt: skip


if __name__ == "__main__":
    main()
