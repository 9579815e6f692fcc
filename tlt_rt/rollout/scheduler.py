"""What runs next, and what a step's results mean for the requests.

One Scheduler lives for one `Engine.generate` call. It owns the queues and the block bookkeeping of
admission, completion and preemption, and postprocesses every step: it appends the emitted tokens, applies
stop tokens and length limits, finishes samples and frees their blocks. Prefill chunks go first (first
come, first served), then every running sample steps together. When blocks run out the youngest running
sample is preempted: its blocks are freed and it waits at the front of the queue to be recomputed from its
tokens.

What a serving request brings and gets back: `sampling_params_from` maps a vLLM or SGLang `sampling_params`
dict to ours, refusing what it cannot honour (a penalty we do not apply is an error, not a silent no-op);
`RequestOutput` is a request's `n` samples.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tlt_rt.rollout.block_manager import BlockManager
from tlt_rt.rollout.params import Completion, SamplingParams
from tlt_rt.rollout.sequence import PrefillJob, Sequence, StepRows


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_batch: int,
        max_prefill_tokens: int,
        stats: Counter,
        stop: set[int] = frozenset(),
        max_context: int = 1 << 62,
        min_admit: int = 0,
    ):
        self.blocks = blocks
        self.min_admit = min_admit  # EngineConfig.prefill_min_samples
        self.stop = stop
        self.max_context = max_context
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.stats = stats
        self.waiting: deque[PrefillJob] = deque()
        self.running: list[Sequence] = []
        self.done: list[Sequence] = []
        self._allocated: set[int] = set()  # prefill jobs that hold blocks
        self.step_rows = StepRows()  # hidden rows of decode steps, until a sequence's history is read

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[tuple[PrefillJob, int]]:
        """Prefill chunks for this step, allocating blocks for jobs as they are first admitted."""
        jobs, budget = [], self.max_prefill_tokens
        slots = self.max_batch - len(self.running)
        if self.min_admit and self.running and slots < self._waiting_samples(self.min_admit):
            return []  # decode on until enough places are free to admit several prompts in one prefill
        for job in self.waiting:
            n = len(job.group) if job.group else 1
            if budget <= 0 or n > slots:
                break
            if job.done == 0 and job.seq_id not in self._allocated:
                # room for the prompt and one private block per sample it forks into
                if not self.blocks.can_allocate(len(job.tokens) + n * self.blocks.block_size):
                    break
                self.blocks.allocate(job.seq_id, len(job.tokens))
                self._allocated.add(job.seq_id)
            chunk = min(job.remaining, budget)
            jobs.append((job, chunk))
            budget -= chunk
            slots -= n
        return jobs

    def _waiting_samples(self, most: int) -> int:
        """Samples the waiting jobs fork into, counted up to `most`; 0 when a job's prefill is under way (its
        later chunks must not wait)."""
        n = 0
        for job in self.waiting:
            if job.done > 0:
                return 0
            n += len(job.group) if job.group else 1
            if n >= most:
                return most
        return n

    def prefilled(self, job: PrefillJob) -> None:
        """A job's last chunk ran: it leaves the queue (its blocks now belong to its sequences)."""
        self.waiting.remove(job)
        self._allocated.discard(job.seq_id)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        self.done.append(seq)

    def preempt_youngest(self) -> Sequence:
        """Free the most recently admitted sample's blocks; it will be recomputed from its tokens."""
        victim = self.running.pop()
        self.blocks.free(victim.seq_id)
        victim.reset_for_recompute()
        self.stats["preemptions"] += 1
        self.waiting.appendleft(PrefillJob(victim.seq_id, victim.tokens[:-1], seq=victim))
        return victim

    def make_room(self, blocks: int) -> None:
        """Preempt until `blocks` blocks are free (or nothing runs)."""
        while self.blocks.num_free < blocks and self.running:
            self.preempt_youngest()

    def reserve(self, extra: int) -> None:
        """Every running sample gets blocks for `extra` more positions; the youngest make way if needed."""
        i = 0
        while i < len(self.running):
            rest = self.running[i:]
            i += self.blocks.ensure_many([s.seq_id for s in rest], [s.num_cached + extra for s in rest])
            if i < len(self.running):  # blocks ran out at sample i
                self.preempt_youngest()

    def abort(self, seqs: list[Sequence], jobs: list[PrefillJob]) -> None:
        """Drop a request's samples and prefill jobs wherever they are, freeing their blocks."""
        ids = {s.seq_id for s in seqs}
        for seq in [s for s in self.running if s.seq_id in ids]:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)
        mine = {j.seq_id for j in jobs}
        for job in [j for j in self.waiting if j.seq_id in mine or (j.seq is not None and j.seq.seq_id in ids)]:
            self.waiting.remove(job)
            if job.seq_id in self._allocated:
                self._allocated.discard(job.seq_id)
                self.blocks.free(job.seq_id)

    def evict_all(self) -> None:
        """Every cached row is about to be lost (the cache is released): running samples are preempted and
        waiting jobs start their prefill again (their blocks stay theirs)."""
        while self.running:
            self.preempt_youngest()
        for job in self.waiting:
            job.done, job.hidden_chunks = 0, []

    # ---- postprocessing ------------------------------------------------------------------------------------
    def emit(self, seq: Sequence, toks: list[int], lps: list[float]) -> int:
        """Append tokens until a stop token or a limit; returns how many were kept."""
        kept = self._append(seq, toks, lps)
        self.stats["generated_tokens"] += kept
        return kept

    def _append(self, seq: Sequence, toks: list[int], lps: list[float]) -> int:
        out = seq.output
        stop = self.stop if seq.stop is None else seq.stop
        # the last token the limits allow, then cut at the first stop token before it
        room = min(seq.max_new_tokens - len(out), self.max_context - len(seq.prompt) - len(out))
        kept = min(len(toks), max(room, 1))
        reason = "length" if kept == room else None
        if not stop.isdisjoint(toks[:kept]):  # most steps emit no stop token: one set test, no loop
            for i in range(kept):
                if toks[i] in stop:
                    kept, reason = i + 1, "stop"
                    break
        out.extend(toks[:kept])
        seq.logprobs.extend(lps[:kept])
        if reason is not None:
            seq.finish_reason = reason
            self.finish(seq)
        return kept

    def postprocess(self, seqs: list[Sequence], out) -> int:
        """Apply one decode step's `StepOut` (rollout/step/io.py) to its sequences; returns the tokens kept.
        Each sample's root and accepted tokens enter its cache, their hidden rows its history."""
        kept = []
        stop, context = self.stop, self.max_context
        for seq, toks, lps in zip(seqs, out.tokens, out.logprobs, strict=True):
            seq.counter += 1
            o, k = seq.output, len(toks)
            n = len(o)
            # the usual step: every token kept, no limit reached, no stop token (what `_append` does then)
            if (
                n + k < seq.max_new_tokens
                and len(seq.prompt) + n + k < context
                and (stop if seq.stop is None else seq.stop).isdisjoint(toks)
            ):
                o.extend(toks)
                seq.logprobs.extend(lps)
            else:
                k = self._append(seq, toks, lps)
            seq.num_cached += k
            kept.append(k)
        emitted = sum(kept)
        self.stats["generated_tokens"] += emitted
        hidden = out.hidden  # logged, copied out to the sequences when one of their histories is next read
        if hidden is None:
            return emitted
        if hidden.shape[1] == 1 or emitted == len(seqs):  # one row each
            self.step_rows.add(hidden[:, 0], seqs)
        else:  # each sequence's first kept rows
            self.step_rows.add(hidden, seqs, kept)
        return emitted


# vLLM / SGLang sampling parameter names -> ours; names that change nothing when left at their neutral value
_ALIASES = {"max_tokens": "max_new_tokens", "sampling_seed": "seed"}
_OURS = {"n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed", "return_hidden"}
_NEUTRAL = {
    "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_p": 0.0,
    "min_tokens": 0, "min_new_tokens": 0, "best_of": None, "stop": None,
}  # fmt: skip
_IGNORED = {  # about text, logging or the log-probs we always return
    "logprobs", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "detokenize",
    "include_stop_str_in_output", "no_stop_trim", "output_kind", "return_logprob", "extra_args", "priority",
}  # fmt: skip


def sampling_params_from(d: dict[str, Any] | None, eos: Iterable[int] = ()) -> SamplingParams:
    """SamplingParams from a vLLM or SGLang style dict; a setting we cannot honour is an error, not a no-op.

    `ignore_eos=True` drops the model's EOS ids from the stop set (explicit `stop_token_ids` still stop)."""
    d = dict(d or {})
    ignore_eos = bool(d.pop("ignore_eos", False))
    kw: dict[str, Any] = {}
    for name, value in d.items():
        ours = _ALIASES.get(name, name)
        if ours in _OURS:
            if ours in kw and kw[ours] != value:
                raise ValueError(f"sampling_params: {name}={value!r} contradicts {ours}={kw[ours]!r}")
            if value is not None or ours == "stop_token_ids":
                kw[ours] = value
        elif name in _NEUTRAL:
            if value not in (_NEUTRAL[name], None, [], ""):
                raise ValueError(f"sampling_params: {name}={value!r} is not supported (only {_NEUTRAL[name]!r})")
        elif name not in _IGNORED:
            raise ValueError(f"sampling_params: unknown setting {name!r}")
    params = SamplingParams(**kw)
    if params.stop_token_ids is None:
        params.stop_token_ids = [] if ignore_eos else list(eos)
    elif not ignore_eos:
        params.stop_token_ids = sorted(set(params.stop_token_ids) | set(eos))
    return params


@dataclass
class RequestOutput:
    """A request's result: its `n` samples (the first one's fields are the request's, as verl reads them)."""

    request_id: str
    outputs: list[Completion]

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[float]:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason
