"""The warm-up's data: the target's answers to the training prompts with their hidden rows, and where they are kept
(`warmup_run.warmup` calls these; `python -m tlt_rt.train.drafter.warmup` is the command line)."""

from __future__ import annotations

import time

import torch

from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.rollout.stats import timeline_split
from tlt_rt.train.drafter.data import DrafterBuffer


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
    time went, summed over calls (rollout.stats.timeline_split). The hidden rows stay in the target's dtype (an
    upcast adds nothing: the drafter's loss normalises them in fp32 itself) and go to each buffer's device
    (`DrafterBuffer(device=...)`; where none is set, they stay where the engine left them)."""
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
        hidden.append(o.hidden.detach())
    for b in (buffer, *also):
        b.add(step, ids, hidden)
    return sum(len(o.token_ids) for o in outs)


def gen_buckets(gen_batch: int) -> list[int]:
    """The batch sizes the data-generating engine captures: quarters of `gen_batch` (the batch is near full
    but for the last answers of a call, which run padded up to a quarter)."""
    return sorted({max(1, gen_batch * k // 4) for k in range(1, 5)})


# the share of the free GPU memory (after the generating engine took its KV blocks) that the warm-up's answers may
# fill on the GPU, counting them twice: the buffer concatenates the second call's answers to the first's
ANSWERS_GPU_SHARE = 0.8


def answers_device(engine: Engine, prompts: list[list[int]], per_prompt: int, max_new_tokens: int) -> torch.device:
    """Where the warm-up keeps its answers' hidden rows: on the engine's GPU when even their longest case fits
    there twice over, else in host memory. On an H200 the answers of 3,072 prompts on the 1.5B (4.0M rows of
    1,536 values) copied to the host one answer at a time in fp32 and concatenated there took 51 of the
    generation's 184 s, beside 132 s of engine steps; kept on the GPU in the target's dtype (12 GB there) they are
    never copied, and every training batch is sliced where it is used."""
    device = engine.device
    if device.type != "cuda":
        return torch.device("cpu")
    target = engine.target
    rows = sum(len(p) + max_new_tokens for p in prompts) * per_prompt
    need = 2 * rows * target.feature_size * target.lm_head.weight.element_size()
    free, _ = torch.cuda.mem_get_info(device)
    return device if need <= ANSWERS_GPU_SHARE * free else torch.device("cpu")
