"""What a speculative step costs in plain steps, on one engine, in interleaved rounds (GPU).

    python benchmarks/step_ratio.py --batch 1 32 --strategies 8_4_32 6_2_12 [--trainer] [--kernels]

One engine (SmolLM2 bf16, or `--model` as step_costs.py takes it: a shape of random weights with a drafter of
random weights, or a checkpoint; speculation on, every step captured) generates greedily for `--batch` prompts
with stops off, and its policy is replaced by a fixed rotation: plain, then each strategy, then plain
again, ... so every option runs on the same live batch at nearly the same context, one step after the
other. A step's time is its wall time in the engine's timeline (inputs, replay, the host copy and the
postprocessing). Per batch: the median step of each option and its ratio to plain decoding.

--trainer [VARIANT ...]: each round runs again with the RL worker's drafter trainer busy beside the engine
(a thread on its own CUDA stream training on random rollout data, as tail training does), once per
variant: `all` (back to back on every SM), `sms=N` (drafter.tail_sms), `duty=F` (drafter.tail_duty),
`vocab=N` (reduced draft vocabulary), `tokens=N`, `gil=S` (the interpreter's switch interval while the
trainer runs; default the tail trainer's own, 0 = Python's 5 ms), or several joined by ','; `py` is a thread
of pure Python instead (no device work: what sharing the GIL alone costs). Prints each option's step time
with the trainer against without, and the trainer's steps. --hidden keeps hidden rows as RL rollouts do.
--kernels: the GPU kernels (count and time) of one step of each option, from the torch profiler.
--engine KEY=VALUE ...: rollout settings for both engines (`decode_chain=true pdl=true`: the one-row chain).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import prompts_for  # noqa: E402
from step_costs import append_jsonl, build_model, kernel_table, model_source  # noqa: E402

from tlt_rt.ir.strategy import Strategy  # noqa: E402
from tlt_rt.models.default import load_tokenizer  # noqa: E402
from tlt_rt.models.drafter import Drafter  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402
from tlt_rt.train.drafter.config import DrafterConfig  # noqa: E402
from tlt_rt.train.drafter.data import DrafterBuffer  # noqa: E402
from tlt_rt.train.drafter.tail import TAIL_SWITCH_INTERVAL_S, Pacer, trainer_stream  # noqa: E402
from tlt_rt.train.drafter.trainer import DrafterTrainer  # noqa: E402


class Rotation:
    """A stand-in SD policy: `run` steps of plain decoding, then `run` of each strategy in turn, and again."""

    def __init__(self, options, run: int = 1):
        self.options, self.run, self.i = options, run, 0

    def decide(self, batch_size: int, behind: int = 0):
        option = self.options[(self.i // self.run) % len(self.options)]
        self.i += 1
        return option

    def observe(self, *args, **kwargs) -> None:
        pass


class BusyTrainer:
    """The RL worker's drafter trainer (`DrafterTrainer`: fp32 replica, bf16 autocast, the default loss) over
    random rollout data, back to back in a thread, as tail training runs beside a rollout. `sms` and `duty`
    are `drafter.tail_sms` / `drafter.tail_duty`: its stream's SM share and its pacing."""

    def __init__(self, engine: Engine, sms: int = 0, duty: float = 1.0, batch_tokens: int = 4096,
                 draft_vocab: int = 0, samples: int = 64, length: int = 256,
                 gil: float = TAIL_SWITCH_INTERVAL_S):  # fmt: skip
        self.gil = gil
        target = engine.target
        v, h = target.arch.vocab_size, target.arch.hidden_size
        gen = torch.Generator().manual_seed(0)
        buffer = DrafterBuffer(max_steps=4, seed=0)
        ids = [torch.randint(0, v, (length,), generator=gen) for _ in range(samples)]
        hidden = [torch.randn(length, h, generator=gen, dtype=torch.bfloat16).cuda() for _ in range(samples)]
        buffer.add(0, ids, hidden)
        drafter = Drafter(target.arch, target).to("cuda", torch.float32)
        cfg = DrafterConfig(batch_tokens=batch_tokens, draft_vocab=draft_vocab)
        self.trainer = DrafterTrainer(drafter, buffer, cfg)
        self.trainer.train(threading.Event(), max_steps=2)  # kernels loaded, allocator warm
        self.sms, self.duty, self.used_sms = sms, duty, 0
        self.stop, self.steps, self.thread = threading.Event(), 0, None

    def _count(self, _metrics) -> None:
        self.steps += 1
        self.pacer()

    def _run(self) -> None:
        stream, self.used_sms = trainer_stream(torch.device("cuda"), self.sms)
        stream.wait_stream(torch.cuda.current_stream())
        self.pacer = Pacer(self.duty, self.stop)
        with torch.cuda.stream(stream):
            self.trainer.train(self.stop, after_step=self._count)
        stream.synchronize()

    def __enter__(self):
        self.stop.clear()
        self.steps = 0
        self.switch = sys.getswitchinterval()
        if self.gil > 0:  # as TailTrainer.start does
            sys.setswitchinterval(min(self.switch, self.gil))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        while self.steps == 0 and self.thread.is_alive():  # running before the rollout starts
            self.stop.wait(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        sys.setswitchinterval(self.switch)


class BusyPython(BusyTrainer):
    """A thread running pure Python back to back, no device work: what sharing the GIL with a busy thread
    costs the engine's steps, at the tail trainer's switch interval (`gil`)."""

    def __init__(self, engine: Engine, gil: float = TAIL_SWITCH_INTERVAL_S):
        self.gil, self.used_sms = gil, 0
        self.stop, self.steps, self.thread = threading.Event(), 0, None

    def _run(self) -> None:
        while not self.stop.is_set():
            x = 0
            for i in range(20_000):
                x += i
            self.steps += 1


def trainer_variant(spec: str) -> dict:
    """'all' | 'py' | 'sms=16' | 'duty=0.5' | 'vocab=8192' | 'gil=1e-4' | combinations joined by ',' ->
    BusyTrainer keywords ('py': BusyPython's)."""
    out: dict = {}
    for part in spec.split(","):
        if part in ("all", "py"):
            continue
        key, _, value = part.partition("=")
        names = {"sms": ("sms", int), "duty": ("duty", float), "vocab": ("draft_vocab", int),
                 "tokens": ("batch_tokens", int), "gil": ("gil", float)}  # fmt: skip
        if key not in names or not value or (spec.startswith("py") and key != "gil"):
            raise SystemExit(f"--trainer {spec!r}: parts are all, sms=N, duty=F, vocab=N, tokens=N, gil=S; "
                             "py takes gil=S only")  # fmt: skip
        name, kind = names[key]
        out[name] = kind(value)
    return out


def busy(engine: Engine, spec: str) -> BusyTrainer:
    """The busy neighbour a --trainer variant names."""
    cls = BusyPython if spec.split(",")[0] == "py" else BusyTrainer
    return cls(engine, **trainer_variant(spec))


def step_times(engine: Engine, prompts, max_new: int, hidden: bool = False) -> dict[str, list[float]]:
    """Step seconds per option of one generate call; the first step of each run of an option is left out
    (after a switch the drafter's windows are rebuilt from the kept hidden rows, a cost of the switch)."""
    start = len(engine.timeline)
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=[],
                                            return_hidden=hidden))  # fmt: skip
    out: dict[str, list[float]] = {}
    prev = None
    for e in engine.timeline[start:]:
        if e["kind"] == "prefill":
            prev = None
            continue
        name = e["strategy"] or "off"
        if name == prev:
            out.setdefault(name, []).append(e["seconds"])
        prev = name
    return out


def kernels_per_step(engine: Engine, prompts, options, show: int = 0) -> dict[str, tuple[int, float]]:
    """(launches, kernel us) of one step of each option (the sixth of a generate call), torch profiler;
    `show` > 0 prints that many kernels of each with the most launches."""
    from torch.profiler import ProfilerActivity, profile

    out, step = {}, engine.runner.step
    for option in options:
        engine.policy = Rotation([option])
        seen, profs = [0], []

        def one_profiled(*a, seen=seen, profs=profs, **k):
            seen[0] += 1
            if seen[0] != 6:
                return step(*a, **k)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                res = step(*a, **k)
                torch.cuda.synchronize()
            profs.append(prof)
            return res

        engine.runner.step = one_profiled
        engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[]))
        engine.runner.step = step
        rows = kernel_table(profs[0], 1)
        name = str(option) if option else "off"
        out[name] = (round(sum(r[2] for r in rows)), sum(r[1] for r in rows))
        for k, us, n in sorted(rows, key=lambda r: -r[2])[:show]:
            print(f"  {name:8} {n:4.0f} x {us:7.1f} us  {k[:110]}")
    return out


def random_prompts(n: int, length: int = 64) -> list[list[int]]:
    """Prompts of random ids for a model of random weights (no tokenizer of its own), the same on every call."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 32000, (n, length), generator=g).tolist()


def engine_options(pairs: list[str]) -> dict:
    """`--engine KEY=VALUE ...` -> Engine keywords, each value parsed for its rollout setting's type; a clear
    SystemExit on an unknown key or a malformed pair."""
    from tlt_rt.config_loader import field_hints, parse_value
    from tlt_rt.rollout.config import EngineConfig

    hints, out = field_hints(EngineConfig), {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in hints:
            known = ", ".join(sorted(k for k in hints if not k.startswith("_")))
            raise SystemExit(f"--engine {pair!r}: expected KEY=VALUE with KEY a rollout setting ({known})")
        out[key] = parse_value(value, hints[key], key)
    return out


def make_engine(args, b: int, speculative: str) -> Engine:
    """An engine of `--model` (None: the default model file) for `b` rows, `--engine`'s settings applied."""
    # one step at a time unless --engine overlap=true: a plain step's time is then its own, not what it adds
    # while the host works on the step before (rollout.overlap)
    options = {"max_batch": max(b, 1), "num_blocks": 256 + 32 * b, "overlap": False, **engine_options(args.engine)}
    options["speculative"] = speculative
    if speculative != "off":
        options["strategies"] = args.strategies
    if args.model is None:
        return Engine.from_pretrained(None, drafter_path=args.drafter, dtype="bfloat16", device="cuda", **options)
    if args.drafter is not None:
        raise SystemExit("--drafter goes with the default model; --model builds a drafter of random weights")
    from eager_profile import random_drafter

    target = build_model(args.model)
    return Engine(target, drafter=random_drafter(target) if speculative != "off" else None, **options)


def sd_engine(args, b: int, prompts) -> Engine:
    """The speculative engine the rounds time: every step captured, its policy a rotation, warmed up."""
    engine = make_engine(args, b, "on")
    if args.draft_vocab:
        engine.drafter_runner.drafter.set_draft_vocab(torch.arange(args.draft_vocab))
    engine.capture(profile=False, modes=("greedy",))
    engine.policy = Rotation([None, *(Strategy.parse(s) for s in args.strategies)])
    step_times(engine, prompts, 16, args.hidden)  # prefill shapes compile here
    return engine


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--strategies", nargs="+", default=["8_4_32", "6_2_12"])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drafter", default=None, help="an exported drafter folder (default: freshly initialised)")
    ap.add_argument(
        "--trainer",
        nargs="*",
        default=None,
        metavar="VARIANT",
        help="also time every round with a drafter trainer beside, once per variant: all (every SM, "
        "back to back), sms=N (drafter.tail_sms), duty=F (drafter.tail_duty), vocab=N (draft "
        "vocabulary), tokens=N (batch tokens), gil=S (switch interval), joined by ','; py = a pure-Python "
        "thread; no value = all",
    )
    ap.add_argument("--hidden", action="store_true", help="keep the hidden rows, as RL rollouts do")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft over N target ids (a reduced head, ids 0..N-1: costs, not gains)")  # fmt: skip
    ap.add_argument("--kernels", type=int, default=-1,
                    help="GPU kernels per step of each option; N > 0 also prints the N most launched")  # fmt: skip
    ap.add_argument("--run", type=int, default=6, help="steps of one option before the next")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default=None,
                    help="a shape (random weights) or a checkpoint, as step_costs.py --model takes it")  # fmt: skip
    ap.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE",
                    help="rollout settings for both engines, e.g. decode_chain=true pdl=true")  # fmt: skip
    args = ap.parse_args(argv)
    engine_options(args.engine)  # a bad setting fails before any engine is built
    source = "checkpoint"  # the default model
    if args.model is not None:
        try:
            source = model_source(args.model)
        except ValueError as e:
            ap.error(str(e))
    warnings.simplefilter("ignore")
    tok = load_tokenizer(args.model) if source == "checkpoint" else None  # a shape of random weights has none
    strategies = [Strategy.parse(s) for s in args.strategies]
    options = [None, *strategies]
    names = ["off", *args.strategies]
    variants = [] if args.trainer is None else (args.trainer or ["all"])
    for v in variants:
        trainer_variant(v)  # a bad spec fails before any engine is built
    rows = []
    for b in args.batch:
        prompts = prompts_for(b, tok) if tok is not None else random_prompts(b)
        engine = sd_engine(args, b, prompts)
        # plain decoding on an engine without speculation, timed in the same rounds: the reference the
        # SD-capable engine's plain steps (which keep hidden rows for the drafter) are compared with
        plain = make_engine(args, b, "off")
        plain.capture(profile=False, modes=("greedy",))
        step_times(plain, prompts, 16)
        trainers = {v: busy(engine, v) for v in variants}
        times = {(n, t): [] for n in [*names, "off-engine"] for t in [None, *variants]}
        steps = dict.fromkeys(variants, 0)
        for _ in range(args.rounds):
            times[("off-engine", None)] += step_times(plain, prompts, args.max_new_tokens, args.hidden)["off"]
            for v in [None, *variants]:
                engine.policy = Rotation(options, args.run)
                if v is None:
                    got = step_times(engine, prompts, args.max_new_tokens, args.hidden)
                else:
                    with trainers[v] as t:
                        got = step_times(engine, prompts, args.max_new_tokens, args.hidden)
                    steps[v] += t.steps
                for n, ts in got.items():
                    times[(n, v)] += ts
        row = {"batch": b, "device": torch.cuda.get_device_name(), "draft_vocab": args.draft_vocab or None}
        row["off-engine_ms"] = 1e3 * statistics.median(times[("off-engine", None)])
        for n in names:
            row[f"{n}_ms"] = 1e3 * statistics.median(times[(n, None)])
            for v in variants:
                row[f"{n}_busy[{v}]_ms"] = 1e3 * statistics.median(times[(n, v)])
        for v in variants:
            row[f"trainer[{v}]_steps"] = steps[v]
            row[f"trainer[{v}]_sms"] = trainers[v].used_sms
        if args.kernels >= 0:
            for n, (launches, us) in kernels_per_step(engine, prompts, options, args.kernels).items():
                row[f"{n}_kernels"], row[f"{n}_kernel_us"] = launches, us
        rows.append(row)
        del engine, trainers, plain
        torch.cuda.empty_cache()
    vocab = f"; draft vocabulary {args.draft_vocab}" if args.draft_vocab else ""
    print(f"device: {torch.cuda.get_device_name()}; median step ms, interleaved in one engine per batch{vocab}")
    for r in rows:
        plain = r["off_ms"]
        cells = [f"off {plain:.3f}"] + [f"{n} {r[n + '_ms']:.3f} ({r[n + '_ms'] / plain:.2f}x)" for n in names[1:]]
        print(f"batch {r['batch']:4d}: " + ", ".join(cells) + f"; off engine {r['off-engine_ms']:.3f}")
        for v in variants:
            print(f"    trainer {v} ({r[f'trainer[{v}]_steps']} steps, SMs {r[f'trainer[{v}]_sms'] or 'all'}) "
                  "step time beside / without: "
                  + ", ".join(f"{n} {r[f'{n}_busy[{v}]_ms'] / r[n + '_ms']:.3f}" for n in names))  # fmt: skip
        if args.kernels >= 0:
            print("    kernels per step (launches, us): "
                  + ", ".join(f"{n} {r[n + '_kernels']} / {r[n + '_kernel_us']:.0f}" for n in names))  # fmt: skip
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
