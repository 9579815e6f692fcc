"""Where a rollout's eager work goes on a GPU: the prefill of a batch of prompts, and the speculative step that
first catches the drafter up on a stretch of plain steps (the price the SD policy pays to switch at large batches).

    python benchmarks/eager_profile.py --model qwen2.5-coder-1.5b --batch 128 --prompt-len 96 --plain-steps 80

Random bf16 weights of the shape (or a checkpoint, as `step_costs.py --model` takes), a drafter of random weights,
sampling at T=1.0. The SD policy is replaced by a fixed script: `--plain-steps` plain steps, one speculative step
of `--strategy` (which first runs the drafter over every row the plain steps made), then plain steps to the end.
Runs of the same prompts: a warm-up (compiles and captures); `--rounds` timed rounds (the device synchronised
around each phase), each timing the prefill attention's Triton kernel and then its torch reference (on a GPU),
for both phases run it; and a profiled run (the kernel), whose kernel and host-operator tables land in
OUT/prefill.txt and OUT/catchup.txt. The table printed last gives each phase's median wall time against a
plain step's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_costs import build_model  # noqa: E402

from tlt_rt.ir.strategy import Strategy  # noqa: E402
from tlt_rt.models.drafter import Drafter  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402
from tlt_rt.train.profile import CALLER_OPS, profiled  # noqa: E402


def random_drafter(target) -> Drafter:
    """A drafter of N(0, 0.02) weights in the target's dtype and device (its accept length does not matter here)."""
    w = target.lm_head.weight
    torch.manual_seed(7)
    drafter = Drafter(target.arch, target).to(w.device, w.dtype)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return drafter.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Script:
    """The fixed SD schedule and the phase timings of one generate call (`profile_dir`: profile the prefill phase
    and the catch-up step into that folder)."""

    def __init__(self, engine: Engine, strategy: Strategy, plain_steps: int, profile_dir: Path | None = None):
        self.engine, self.strategy, self.plain_steps, self.profile_dir = engine, strategy, plain_steps, profile_dir
        self.steps, self.t_start, self.prefill_s, self.catchup_s, self.behind = 0, 0.0, None, None, 0
        self.plain_s: list[float] = []
        self._step, self._decode = engine.runner.step, engine._decode_step
        engine.policy.decide = self.decide
        engine.runner.step = self.step
        engine._decode_step = self.decode_step

    def decide(self, batch: int, behind=0):
        self.steps += 1
        return self.strategy if self.steps == self.plain_steps + 1 else None

    def decode_step(self, sched, params, keep_hidden, overlap=False):
        if self.prefill_s is None:  # the first decode step ends the prefill phase
            sync(self.engine.device)
            self.prefill_s = time.perf_counter() - self.t_start
        return self._decode(sched, params, keep_hidden, overlap)

    def step(self, seqs, tables, strategy, params, keep_hidden=False):
        sync(self.engine.device)
        if strategy is not None:
            self.behind = sum(s.num_cached - s.draft_cached for s in seqs)
        ctx = profiled(self.profile_dir / "catchup.txt", "SD step with catch-up", self.engine.device, CALLER_OPS) if (
            strategy is not None and self.profile_dir is not None) else contextlib.nullcontext()  # fmt: skip
        t0 = time.perf_counter()
        with ctx:
            out = self._step(seqs, tables, strategy, params, keep_hidden)
            sync(self.engine.device)
        dt = time.perf_counter() - t0
        if strategy is None:
            self.plain_s.append(dt)
        else:
            self.catchup_s = dt
        return out

    def run(self, prompts, params):
        """One generate call under the script; the engine's own step functions are put back after it."""
        self.t_start = time.perf_counter()
        try:
            return self.engine.generate(prompts, params)
        finally:
            self.engine.runner.step = self._step
            del self.engine._decode_step  # the instance attribute: the class's method again


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="as step_costs.py --model takes it")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--plain-steps", type=int, default=80)
    ap.add_argument("--strategy", default="8_4_8")
    ap.add_argument("--out", type=Path, default=Path("eager-profile"))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of a small shape")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds of each prefill attention")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: --device cpu runs a small shape on the host")
    if min(args.batch, args.prompt_len, args.plain_steps, args.rounds) < 1:
        ap.error("--batch, --prompt-len, --plain-steps and --rounds must be >= 1")
    strategy = Strategy.parse(args.strategy)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        target = build_model(args.model, args.device)
    except ValueError as e:
        ap.error(str(e))
    engine = Engine(
        target,
        drafter=random_drafter(target),
        speculative="auto",
        strategies=(args.strategy,),
        max_batch=args.batch,
        overlap=False,
    )  # fmt: skip (the script times each plain step alone)
    engine.capture([engine.bucket(args.batch)], False, ("sampled",))
    g = torch.Generator().manual_seed(0)
    vocab = target.arch.vocab_size
    prompts = torch.randint(0, min(vocab, 32000), (args.batch, args.prompt_len), generator=g).tolist()
    new = args.plain_steps + 16
    params = SamplingParams(temperature=1.0, max_new_tokens=new, stop_token_ids=[], seed=1)
    backend = target.attn_backend  # the drafter's too (the engine hands it over)
    # the prefill attention of both phases: the Triton kernel, and (where the backend has one) the torch reference
    variants = ["kernel", "reference"] if hasattr(backend, "prefill_kernel") else ["torch"]
    Script(engine, strategy, args.plain_steps).run(prompts, params)  # warm-up: compiles and captures
    timed: dict[str, list[Script]] = {v: [] for v in variants}
    for _ in range(args.rounds):  # interleaved rounds
        for v in variants:
            if v != "torch":
                backend.prefill_kernel = v == "kernel"
            script = Script(engine, strategy, args.plain_steps)
            script.run(prompts, params)
            timed[v].append(script)
    if variants[0] != "torch":
        backend.prefill_kernel = True
    # the profiled run: the prefill phase alone (one new token: no decode step), then the catch-up step
    with profiled(args.out / "prefill.txt", f"prefill of {args.batch} x {args.prompt_len} tokens", engine.device):
        engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=1, stop_token_ids=[], seed=1))
        sync(device)
    Script(engine, strategy, args.plain_steps, args.out).run(prompts, params)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    plain_ms = 1e3 * statistics.median(s for runs in timed.values() for r in runs for s in r.plain_s)
    behind = timed[variants[0]][0].behind
    rows = [("plain step", "-", plain_ms, f"batch {args.batch}, median")]
    for v, runs in timed.items():
        rows.append(("prefill phase", v, 1e3 * statistics.median(r.prefill_s for r in runs),
                     f"{args.batch} x {args.prompt_len} prompt tokens"))  # fmt: skip
        rows.append((f"{args.strategy} step with catch-up", v, 1e3 * statistics.median(r.catchup_s for r in runs),
                     f"{behind} drafter rows behind"))  # fmt: skip
    rec = {"model": args.model, "batch": args.batch, "prompt_len": args.prompt_len, "plain_steps": args.plain_steps,
           "strategy": args.strategy, "device": device_name, "behind_rows": behind, "rounds": args.rounds,
           "ms": {f"{phase} ({v})" if v != "-" else phase: ms for phase, v, ms, _ in rows}}  # fmt: skip
    (args.out / "eager_profile.json").write_text(json.dumps(rec, indent=1))
    print(f"\n{args.model}, {device_name}; medians of {args.rounds} interleaved rounds; profiles (kernel) in "
          f"{args.out}/prefill.txt, catchup.txt")  # fmt: skip
    print("| phase | prefill attention | ms | plain steps | what |")
    print("|---|---|---:|---:|---|")
    for phase, v, ms, what in rows:
        print(f"| {phase} | {v} | {ms:.2f} | {ms / plain_ms:.1f} | {what} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
