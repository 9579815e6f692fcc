"""One GPU's two phases on a config, with random weights of a known shape: the rollout's and the learner's GPU
memory peaks against the dry run's forecast, and the learner's tokens/s, model TFLOP/s and MFU.

    python benchmarks/learner_step.py --config configs/qwen2.5-1.5b-math-gpu.yaml --shape qwen2.5-coder-1.5b \\
        --variants "" "rl.activation_checkpointing=false rl.micro_batch_tokens=8192" [--profile] [-- KEY=VALUE ...]

No checkpoint is read: the model is built from `--shape` (tlt_rt/models/shapes.py) with random weights,
so a GPU machine needs nothing but the repository. The engine is the run's (config rollout.*, its steps
captured, the drafter beside it with its reduced head); it decodes `max_batch` sequences of random prompts for
`--decode-tokens` tokens (the rollout peak is mostly what the engine allocates up front). The learner then
runs `--rounds` updates (the first one untimed) on one RL step's worth of samples: prompts_per_step x
group_size responses with lengths drawn around `--response-median` with a long tail, as the Qwen workload
gives them. Each `--variants` entry (space-separated KEY=VALUE overrides of rl.*, "" for the config as it is)
gets its own learner and its own rows. On a CPU everything runs but memory is not measured.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_costs import append_jsonl, kernel_table  # noqa: E402

from tlt_rt.config import TLTConfig, load_config  # noqa: E402
from tlt_rt.models.arch import ArchConfig  # noqa: E402
from tlt_rt.models.drafter import Drafter  # noqa: E402
from tlt_rt.models.llama import CausalLM  # noqa: E402
from tlt_rt.models.shapes import KNOWN_SHAPES  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402
from tlt_rt.train.drafter.vocab import DraftVocab  # noqa: E402
from tlt_rt.train.memory import GIB, forecast  # noqa: E402
from tlt_rt.train.profile import kernel_kinds  # noqa: E402
from tlt_rt.train.rl.flops import peak_flops  # noqa: E402
from tlt_rt.train.rl.learner import Learner, LearnSample, MiniBatch, SamplingFilter  # noqa: E402

TINY = dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, qkv_bias=True, max_position_embeddings=4096,
            eos_token_ids=(511,))  # fmt: skip


def build(arch: ArchConfig, cfg: TLTConfig, device: torch.device):
    """The policy (random weights), the serving drafter with its reduced head, and an fp32 trained replica with
    its AdamW state, as a worker holds them."""
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(
        cfg.model.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(arch).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    serving = Drafter(arch, model).to(device, dtype).eval()
    n = min(cfg.drafter.draft_vocab, arch.vocab_size)
    if n > 0 and cfg.rollout.speculative != "off":
        serving.set_draft_vocab(DraftVocab(arch.vocab_size, n, keep=arch.eos_token_ids).build())
    replica = Drafter(arch, model).to(device, torch.float32)
    opt = torch.optim.AdamW([p for p in replica.parameters() if p.requires_grad], lr=1e-4)
    for p in replica.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()  # the moments exist from the first drafter step on
    opt.zero_grad(set_to_none=True)
    return model, serving, (replica, opt)


def samples(cfg: TLTConfig, median: int, prompt_len: int, vocab: int, seed: int) -> list[LearnSample]:
    """One RL step's responses: log-normal lengths around `median` (sigma 0.6: p99 ~4x the median), capped at
    max_new_tokens, random ids and advantages."""
    rng = random.Random(seed)
    out = []
    cap = cfg.rollout.max_new_tokens
    for _ in range(cfg.rl.prompts_per_step * cfg.rl.group_size):
        n = max(1, min(cap, int(rng.lognormvariate(0, 0.6) * median)))
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        response = [rng.randrange(vocab) for _ in range(n)]
        out.append(LearnSample(prompt, response, [-3.0] * n, rng.gauss(0, 1)))
    return out


def peak_gib(device: torch.device) -> tuple[float | None, float | None]:
    """(allocated, reserved) peaks since the last reset, GiB; (None, None) on a CPU."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    keys = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen2.5-1.5b-math-gpu.yaml")
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b", help=f"one of {', '.join(KNOWN_SHAPES)}, or tiny")
    ap.add_argument("--variants", nargs="*", default=[""], help="rl.* overrides per learner variant")
    ap.add_argument("--rounds", type=int, default=3, help="learner updates per variant; the first is untimed")
    ap.add_argument("--response-median", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=120)
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens each rollout sequence decodes")
    ap.add_argument(
        "--fresh-batches",
        action="store_true",
        help="new response lengths every round, as a run's steps have (default: one batch reused)",
    )
    ap.add_argument("--profile", action="store_true", help="the GPU kernels of one update, by time")
    ap.add_argument("--out", default=None, help="append the rows to this JSON-lines file")
    args = ap.parse_args(argv)
    cfg = load_config(TLTConfig, args.config, keys)
    arch = ArchConfig(**(TINY if args.shape == "tiny" else KNOWN_SHAPES[args.shape]))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        keys = [*keys, "cluster.gpus_per_worker=0"]
    model, serving, replica = build(arch, cfg, device)
    r = cfg.rollout
    engine = Engine(model, drafter=serving if r.speculative != "off" else None, config=r.engine(),
                    max_context=cfg.model.max_context)  # fmt: skip
    if device.type == "cuda":
        engine.capture()
    prompts = [[random.Random(i).randrange(arch.vocab_size) for _ in range(args.prompt_len)]
               for i in range(max(1, r.max_batch // cfg.rl.group_size))]  # fmt: skip

    def rollout() -> float:
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(n=cfg.rl.group_size, temperature=r.temperature,
                                                max_new_tokens=args.decode_tokens, stop_token_ids=[]))  # fmt: skip
        return time.perf_counter() - t0

    rollout_s = rollout()
    rows = []
    head = (
        "| variant | phase | forecast GiB | allocated GiB | held GiB | held / forecast | s/update | fwd tok/s "
        "| TFLOP/s | MFU |"
    )
    print(f"# learner_step: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, shape "
          f"{args.shape}, config {args.config} {' '.join(keys)}; rollout of {len(prompts) * cfg.rl.group_size} "
          f"sequences x {args.decode_tokens} tokens in {rollout_s:.1f} s; each phase's peak measured with the "
          "learner's state resident (its first update done), held = what the allocator reserved")  # fmt: skip
    print(head)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for variant in args.variants:
        vcfg = load_config(TLTConfig, args.config, [*keys, *variant.split()])
        fc = forecast(vcfg, arch)
        learner = Learner(model, vcfg.rl, SamplingFilter(r.temperature, r.top_k, r.top_p))
        if device.type == "cuda":
            learner.warm_up(max_len=vcfg.model.max_context)  # as a worker does at start-up
        times, flops, fwd = [], 0.0, 0.0
        rollout_peak: tuple[float | None, float | None] = (None, None)
        for i in range(args.rounds):
            batch = samples(vcfg, args.response_median, args.prompt_len, arch.vocab_size,
                            seed=1 + (i if args.fresh_batches else 0))  # fmt: skip
            tokens = sum(len(s.response) for s in batch)
            if i == min(1, args.rounds - 1):  # the moments exist now: a rollout as a run's next one sees it
                reset_peak(device)
                rollout()
                rollout_peak = peak_gib(device)
                reset_peak(device)
            prof = None
            if args.profile and i == args.rounds - 1 and device.type == "cuda":
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            out = learner.update([MiniBatch(batch, num_tokens=tokens, num_seqs=len(batch))])
            if prof is not None:
                torch.cuda.synchronize(device)
                prof.__exit__(None, None, None)
                table = kernel_table(prof, 1)
                busy = sum(us for _, us, _ in table) / 1e6
                print(
                    f"# {variant or '(config)'}: {busy:.3f} s of kernels in a {out.seconds:.3f} s update "
                    f"({busy / out.seconds:.0%} busy); by kind: "
                    + ", ".join(f"{k} {v / 1e6:.3f} s" for k, v in kernel_kinds(table).items())
                )
                for name, us, n in table[:15]:
                    print(f"#   {us / 1e3:8.2f} ms  {n:6.0f} launches  {name[:90]}")
            if i > 0 or args.rounds == 1:
                times.append(out.seconds)
            flops, fwd = out.flops, out.forward_tokens
        learn_peak = peak_gib(device)
        sec = statistics.median(times)
        peak = peak_flops(device)
        mfu = flops / sec / peak if peak else None
        label = variant or "(config)"
        for phase, total, (alloc, held) in (("rollout", fc.rollout_total, rollout_peak),
                                            ("learner", fc.learner_total, learn_peak)):  # fmt: skip
            ratio = f"{held / (total / GIB):.2f}" if held else "-"
            cells = [f"{sec:.2f}", f"{fwd / sec:.0f}", f"{flops / sec / 1e12:.1f}", f"{mfu:.0%}" if mfu else "-"]
            cells = cells if phase == "learner" else ["", "", "", ""]
            measured = [f"{alloc:.2f}" if alloc else "-", f"{held:.2f}" if held else "-"]
            print(f"| {label} | {phase} | {total / GIB:.2f} | {' | '.join(measured)} | {ratio} | "
                  + " | ".join(cells) + " |")  # fmt: skip
        rows.append(dict(bench="learner_step", shape=args.shape, config=args.config, variant=label,
                         device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                         forecast_rollout_gib=fc.rollout_total / GIB, forecast_learner_gib=fc.learner_total / GIB,
                         rollout_peak_gib=rollout_peak[0], learner_peak_gib=learn_peak[0],
                         rollout_reserved_gib=rollout_peak[1], learner_reserved_gib=learn_peak[1], seconds=sec,
                         forward_tokens=fwd, flops=flops, mfu=mfu))  # fmt: skip
        del learner, out
        if device.type == "cuda":  # the next variant's held peaks start from what the engine holds
            torch.cuda.empty_cache()
    append_jsonl(args.out, rows)
    del replica
    return 0


if __name__ == "__main__":
    sys.exit(main())
