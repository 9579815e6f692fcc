"""The warm-up's data: the target's answers to the training prompts with their hidden rows, and where they are kept
(`warmup_run.warmup` calls these; `python -m tlt_rt.train.drafter.warmup` is the command line)."""

from __future__ import annotations

import time

import torch

from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.rollout.stats import timeline_split
from tlt_rt.train.drafter.data import DrafterBuffer


def collect_answers(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, split: dict | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Generate with the target: (ids, hidden) of every whole sequence, and the answer tokens generated. The hidden
    rows stay where the engine left them, in the target's dtype (an upcast adds nothing: the drafter's loss
    normalises them in fp32 itself). `split`, a dict, receives where the generation's time went, summed over
    calls (rollout.stats.timeline_split)."""
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
    return ids, hidden, sum(len(o.token_ids) for o in outs)


def generate_data(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    buffer: DrafterBuffer,
    step: int = 0,
    also: tuple[DrafterBuffer, ...] = (),
    split: dict | None = None,
) -> int:
    """`collect_answers`, added to the buffer (and to each buffer of `also`, each on its own device); returns the
    answer tokens generated."""
    ids, hidden, n = collect_answers(engine, prompts, params, split)
    for b in (buffer, *also):
        b.add(step, ids, hidden)
    return n


def gen_buckets(gen_batch: int) -> list[int]:
    """The batch sizes the data-generating engine captures: quarters of `gen_batch` (the batch is near full
    but for the last answers of a call, which run padded up to a quarter)."""
    return sorted({max(1, gen_batch * k // 4) for k in range(1, 5)})


# the share of the free GPU memory the warm-up's answers may take a second time on the GPU (the buffer's one
# concatenated copy of them, made while they are still there)
ANSWERS_GPU_SHARE = 0.8


def answers_device(engine: Engine, hidden: list[torch.Tensor]) -> torch.device:
    """Where the warm-up keeps its answers' hidden rows, generated and still on the engine's device: there when
    their concatenation fits in ANSWERS_GPU_SHARE of the free memory, else in host memory. On an H200 the answers
    of 3,072 prompts on the 1.5B (4.0M rows of 1,536 values) copied to the host one answer at a time in fp32 and
    concatenated there took 51 of the generation's 184 s, beside 132 s of engine steps; kept on the GPU in the
    target's dtype (12 GB there) they are never copied, and every training batch is sliced where it is used."""
    device = engine.device
    if device.type != "cuda":
        return torch.device("cpu")
    need = sum(h.numel() * h.element_size() for h in hidden)
    free, _ = torch.cuda.mem_get_info(device)
    return device if need <= ANSWERS_GPU_SHARE * free else torch.device("cpu")


def keep_answers(engine: Engine, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """The answers' hidden rows where the warm-up keeps them: as they are while `answers_device` says they fit on
    the GPU, else (and from then on) in host memory, so that a later call's answers find room to be generated."""
    if all(h.device.type == "cuda" for h in hidden) and answers_device(engine, hidden).type == "cuda":
        return hidden
    return [h.cpu() for h in hidden]
