"""Host time of a decode step, plain and speculative, with the device work stubbed out (CPU, no GPU needed).

    python benchmarks/step_host.py --batch 1 8 32 128 --strategies 8_4_32 6_2_12 [--steps 100] [--profile]

One engine on a tiny random model (speculation "auto" with a drafter, or "off" for plain decoding without
hidden rows) prefills `--batch` prompts of 64..160 tokens; then every decode step runs through the public
`Engine.step_once` with the policy replaced by a fixed choice and `ModelRunner.run_args` (the fill, the
graph replay or eager run) replaced by a stub that returns precomputed, valid `StepValues` of the step's
shapes. Accept lengths are drawn uniformly in 0..depth (tokens avoid the stop ids), so postprocessing,
window moves and hidden rows see a realistic mix. What is timed is therefore the host path alone: step
inputs, uniforms, the host copy and its parsing, keeping windows and hidden rows, postprocessing, block
reservation, the policy and the timeline.

Per (batch, option, keep_hidden): the median microseconds per step with the 20% / 80% quantiles, and the
median of the serial part: without the host work the step does between launching the device work and
waiting for its results (drawing the next step's uniforms), which a GPU step hides behind its kernels;
and the mean, which counts the rare steps that copy the logged hidden rows out to the sequences.
keep_hidden "on" is the RL setting (an engine with a drafter always keeps hidden rows: the drafter trains
on them); "off" exists for plain decoding only (an engine without a drafter). --profile: a cProfile top
list per configuration.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tlt_rt, not an installed one
from tlt_rt.ir.strategy import Strategy  # noqa: E402
from tlt_rt.models.arch import ArchConfig  # noqa: E402
from tlt_rt.models.drafter import Drafter  # noqa: E402
from tlt_rt.models.llama import CausalLM  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402
from tlt_rt.rollout.sequence import PrefillJob, Sequence  # noqa: E402
from tlt_rt.rollout.step.graph import StepValues, layout  # noqa: E402

ARCH = ArchConfig(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1 << 15,
    eos_token_ids=(255,),
)
BLOCK = 16
VARIANTS = 16  # precomputed step results per configuration, used in turn


class StubDevice:
    """`ModelRunner.run_args` without the device: precomputed StepValues of the step's shapes."""

    def __init__(self, runner, seed: int = 0):
        self.runner, self.gen = runner, torch.Generator().manual_seed(seed)
        self.values: dict[tuple, list[StepValues]] = {}
        self.calls = 0

    def make(self, b: int, option: str) -> list[StepValues]:
        r, d = layout(self.runner, option)
        h, g = ARCH.hidden_size, self.gen
        out = []
        for _ in range(VARIANTS):
            acc = torch.randint(0, d + 1, (b, 1), generator=g).double()
            toks = torch.randint(0, ARCH.vocab_size - 1, (b, d + 1), generator=g).double()  # never the eos
            lps = -torch.rand(b, d + 1, generator=g).double()
            host = torch.cat([acc, toks, lps], 1)
            window = torch.randn(b, r, h, generator=g) if d else None
            out.append(StepValues(host, torch.randn(b, d + 1, h, generator=g), window))
        return out

    def __call__(self, option: str, mode: str, args) -> StepValues:
        b = args.ints.shape[0]
        vals = self.values.get((b, option))
        if vals is None:
            vals = self.values[(b, option)] = self.make(b, option)
        self.calls += 1
        return vals[self.calls % VARIANTS]


class Fixed:
    """A stand-in SD policy that always picks one option, or with `mix` N alternates N plain steps and N of
    the option, as `auto` mixes them where plain decoding and speculation cost about the same."""

    def __init__(self, option: Strategy | None, mix: int = 0):
        self.option, self.mix, self.calls = option, mix, 0
        self.chosen: list[Strategy | None] = []

    def decide(self, batch_size: int, behind: int = 0):
        self.calls += 1
        choice = None if self.mix and (self.calls // self.mix) % 2 == 0 else self.option
        self.chosen.append(choice)
        return choice

    def observe(self, *args, **kwargs) -> None:
        pass


def build(batch: int, strategies: list[str], keep_hidden: bool, steps: int) -> Engine:
    torch.manual_seed(0)
    target = CausalLM(ARCH).eval()
    drafter = Drafter(ARCH, target).eval() if keep_hidden else None
    depth = max(Strategy.parse(s).depth for s in strategies)
    per_seq = -(-(160 + (steps + 20) * (depth + 1) + 64) // BLOCK) + 2
    return Engine(
        target, drafter=drafter, speculative="auto" if keep_hidden else "off", strategies=strategies,
        block_size=BLOCK, num_blocks=batch * per_seq, max_batch=max(batch, 2), max_prefill_tokens=4096,
    )  # fmt: skip


def time_steps(
    batch: int, option: str, strategies: list[str], keep_hidden: bool, steps: int, params, profile: bool, mix: int = 0
) -> tuple[list[float], list[float], list[str]]:
    """Microseconds of host work per decode step, `steps` of them after a few warm-up steps: in all, and
    without the work done while the device runs (between the launch and the wait for the results); and each
    step's kind: "sd", "plain" or "plain 1st" (a plain step right after a speculative one)."""
    eng = build(batch, strategies, keep_hidden, steps)
    rng = random.Random(batch)
    sched = eng.scheduler(set(ARCH.eos_token_ids))
    for i in range(batch):
        prompt = [rng.randrange(ARCH.vocab_size - 1) for _ in range(rng.randrange(64, 161))]
        seq = Sequence(eng.new_id(), i, 0, prompt, rng.getrandbits(63), 1 << 20)
        sched.waiting.append(PrefillJob(eng.new_id(), list(prompt), group=[seq]))
    while sched.waiting:
        eng.step_once(sched, params, keep_hidden)
    eng.runner.run_args = StubDevice(eng.runner)
    eng.policy = Fixed(None if option == "off" else Strategy.parse(option), mix)
    for _ in range(5):  # the first speculative step catches the drafter up eagerly
        eng.step_once(sched, params, keep_hidden)
    overlap = [0]
    prefetch = getattr(eng.runner, "uniforms", None) and eng.runner.uniforms.prefetch

    def timed_prefetch(seqs, *args, **kw) -> None:  # host work done while the device runs: timed apart
        t = time.perf_counter_ns()
        prefetch(seqs, *args, **kw)
        overlap[0] += time.perf_counter_ns() - t

    if prefetch:
        eng.runner.uniforms.prefetch = timed_prefetch
    prof = cProfile.Profile() if profile else None
    times, serial = [], []
    for _ in range(steps):
        if prof is not None:
            prof.enable()
        overlap[0] = 0
        t0 = time.perf_counter_ns()
        eng.step_once(sched, params, keep_hidden)
        t = time.perf_counter_ns() - t0
        times.append(t / 1e3)
        serial.append((t - overlap[0]) / 1e3)
        if prof is not None:
            prof.disable()
    assert len(sched.running) == batch, "a sequence finished: the stub must not emit stop tokens"
    if prof is not None:
        print(f"--- cProfile: batch {batch}, {option}, keep_hidden {'on' if keep_hidden else 'off'}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    chosen = eng.policy.chosen[-steps - 1 :]
    kinds = ["sd" if c else "plain 1st" if p else "plain" for p, c in zip(chosen[:-1], chosen[1:], strict=True)]
    return times, serial, kinds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--strategies", nargs="+", default=["8_4_32", "6_2_12"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--keep-hidden", choices=["on", "off", "both"], default="both")
    ap.add_argument("--greedy", action="store_true", help="greedy sampling (no uniforms); default T=0.9")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--mix", type=int, default=0,
                    help="alternate N plain and N speculative steps (as auto mixes them); 0: never. Each such "
                         "option also gets a row of its plain steps right after speculative ones ('+plain1') "
                         "and one of its other plain steps ('+plain')")  # fmt: skip
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    params = SamplingParams(temperature=0.0 if args.greedy else 0.9, max_new_tokens=1 << 20, stop_token_ids=[255])
    hidden = {"on": [True], "off": [False], "both": [False, True]}[args.keep_hidden]
    mixed = f"; speculative options alternate {args.mix} plain steps and {args.mix} of theirs" if args.mix else ""
    print(
        f"host us/step over {args.steps} steps, {'greedy' if args.greedy else 'T=0.9'}{mixed}: median [p20, p80] of all"
    )
    print("host work, the median of the serial part (without what runs while the device computes), and the mean")
    print("of all host work (with the rare steps that copy logged hidden rows out)")
    print(f"{'batch':>5}  {'option':>8}  {'keep_hidden':>11}  {'median':>8}  {'p20':>8}  {'p80':>8}  {'serial':>8}"
          f"  {'mean':>8}")  # fmt: skip
    for b in args.batch:
        for kh in hidden:
            for option in ["off", *(args.strategies if kh else [])]:
                t, ser, kinds = time_steps(b, option, args.strategies, kh, args.steps, params, args.profile, args.mix)
                rows = [(option, t, ser)]
                if args.mix and option != "off":
                    for kind, name in (("plain 1st", "+plain1"), ("plain", "+plain")):
                        pick = [i for i, k in enumerate(kinds) if k == kind]
                        rows.append((name, [t[i] for i in pick], [ser[i] for i in pick]))
                for name, t, ser in rows:
                    if len(t) < 2:
                        continue
                    q = statistics.quantiles(t, n=5)
                    med, kh_name = statistics.median(t), "on" if kh else "off"
                    row = f"{b:>5}  {name:>8}  {kh_name:>11}  {med:8.1f}  {q[0]:8.1f}  {q[3]:8.1f}"
                    print(f"{row}  {statistics.median(ser):8.1f}  {statistics.mean(t):8.1f}", flush=True)


if __name__ == "__main__":
    main()
