"""A per-request front of the engine: one persistent scheduler that requests join and leave at any step.

    aeng = AsyncEngine(engine)
    out = await aeng.generate(prompt_ids, {"temperature": 0.9, "max_tokens": 512}, request_id="r1")
    out.token_ids, out.logprobs, out.finish_reason           # "stop" | "length" | "abort"
    await aeng.update_weights(learner.named_parameters())     # HF names, copied in place
    await aeng.sleep(); ...; await aeng.wake_up()             # KV cache (and captured steps) released / back

Every request brings its own sampling settings (vLLM's and SGLang's names, `sampling_params`); each of its
samples carries them (`Sequence.params`), so one running batch mixes temperatures, top-k / top-p and stop
ids per row, and the captured steps read them as per-row inputs. The engine's work (steps, weight copies,
sleep / wake) runs in one worker thread, one thing at a time, so the event loop keeps taking requests while
a step runs and nothing changes the weights or the cache under a step.

Seeds: a request with `seed` s draws sample j from `sequence_seed(s, 0, j)`, the stream `Engine.generate([p],
SamplingParams(seed=s))` gives it, so its tokens are those of that call (plain decoding and greedy
speculation; sampled speculation stays exactly distributed). Without a seed, every request gets a stream
of its own (the engine's seed and the request's arrival number), so repeated prompts differ as GRPO needs.

Drafter training from the rollout (the speculative machinery is unchanged): `on_sample(prompt, completion)`
receives every finished sample with its target hidden states when `collect_hidden` is set, and `on_idle(stop)`
runs in the worker thread whenever no request is left, until a new request, an abort or any other call for
the worker thread (weights, sleep / wake, shutdown) sets `stop`; its errors are logged, serving goes on
(`tlt_rt.integrations.drafter_hook` builds both from a DrafterBuffer and a DrafterTrainer).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tlt_rt.rollout.engine import Engine
from tlt_rt.rollout.params import Completion, SamplingParams, check_prompts
from tlt_rt.rollout.scheduler import RequestOutput, sampling_params_from
from tlt_rt.rollout.sequence import PrefillJob, Sequence
from tlt_rt.rollout.step.rng import sequence_seed

log = logging.getLogger(__name__)

TIMELINE_KEEP = 10_000


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    jobs: list[PrefillJob] = field(default_factory=list)


class AsyncEngine:
    """Per-request generation over one Engine (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        seed: int = 0,
        collect_hidden: bool = False,
        on_sample: Callable[[list[int], Completion], None] | None = None,
        on_idle: Callable[[threading.Event], None] | None = None,
    ):
        self.engine = engine
        self.seed = seed
        self.collect_hidden = collect_hidden
        self.on_sample, self.on_idle = on_sample, on_idle
        self.eos = tuple(engine.target.arch.eos_token_ids)
        self.sched = engine.scheduler()
        self._default = SamplingParams()  # never read: every sequence carries its own params
        self._requests: dict[str, _Request] = {}
        self._owner: dict[int, _Request] = {}  # seq_id -> request
        self._inbox: deque[_Request] = deque()
        self._aborts: deque[str] = deque()
        self._arrivals = 0
        self._asleep = False
        self._captured: list = []  # keys of captured steps released by sleep(), captured again by wake_up()
        self._stop_idle = threading.Event()
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="tlt-engine")
        self._work: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------------------------- public API
    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any] | SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestOutput:  # fmt: skip
        """Generate `n` samples of one prompt; returns when all are done (or the request is aborted)."""
        loop = asyncio.get_running_loop()
        params = sampling_params if isinstance(sampling_params, SamplingParams) else sampling_params_from(
            sampling_params, self.eos
        )  # fmt: skip
        seeded = isinstance(sampling_params, SamplingParams) or any(
            (sampling_params or {}).get(k) is not None for k in ("seed", "sampling_seed")
        )
        (prompt,), params = check_prompts([prompt_ids], params, self.engine.target.arch.vocab_size)
        self.engine.validate([prompt])
        self._arrivals += 1
        request_id = str(request_id if request_id is not None else f"req-{self._arrivals}")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        seqs = self._samples(prompt, params, seeded)
        req = _Request(request_id, prompt, params, seqs, loop.create_future(), loop)
        self._requests[request_id] = req
        self._inbox.append(req)
        self._stop_idle.set()
        self._kick(loop)
        return await req.future

    def abort(self, request_id: str) -> None:
        """End a request now: it returns what it generated so far with finish_reason "abort"."""
        self._aborts.append(str(request_id))
        self._stop_idle.set()
        if self._work is not None:
            self._work.set()

    def abort_all(self) -> None:
        for rid in list(self._requests):
            self.abort(rid)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (HF name, tensor) pairs into the target's live parameters, between steps; returns how many."""
        return await self._call(self.load_weights, named_tensors)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """`update_weights` for a caller that owns the engine thread-wise (no step can be running); a step left
        queued (`EngineConfig.overlap`) is collected first, so every step runs wholly on one set of weights."""
        self._drain()
        return self.engine.load_weights(named_tensors)

    async def sleep(self) -> None:
        """Release the KV cache (and captured steps); running samples are recomputed after `wake_up`."""
        await self._call(self._sleep)

    async def wake_up(self) -> None:
        await self._call(self._wake_up)
        if self._work is not None:
            self._work.set()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def shutdown(self) -> None:
        self._stop_idle.set()  # an idle spell with no step limit would otherwise keep the thread forever
        self._exec.shutdown(wait=True)

    # ------------------------------------------------------------------------------------ the requests
    def _samples(self, prompt: list[int], params: SamplingParams, seeded: bool) -> list[Sequence]:
        stop = frozenset(params.stop_token_ids if params.stop_token_ids is not None else self.eos)
        seqs = []
        for j in range(params.n):
            if seeded:
                seed = sequence_seed(params.seed, 0, j)
            else:
                seed = sequence_seed(self.seed, 0, j, self._arrivals)
            seq = Sequence(self.engine.new_id(), 0, j, prompt, seed, params.max_new_tokens, params=params, stop=stop)
            seqs.append(seq)
        return seqs

    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._work is None:
            self._work = asyncio.Event()
        self._work.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())

    async def _call(self, fn, *args):
        self._stop_idle.set()  # work for the engine thread (a step, weights, sleep) ends an idle spell first
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    async def _run(self) -> None:
        """Step while there is work; otherwise wait for some (training the drafter meanwhile, if asked)."""
        while True:
            try:
                busy = await self._call(self._step)
            except Exception as err:  # every waiting caller learns of it; the engine stays usable
                self._fail_all(err)
                continue
            if busy:
                continue
            self._work.clear()
            if self._inbox or self._aborts:
                continue
            if self.on_idle is not None and not self._asleep:
                self._stop_idle.clear()
                self._exec.submit(self._idle, self._stop_idle)  # ends when a request (or any call) arrives
            await self._work.wait()

    # ----------------------------------------------------------------------------- the engine thread
    def _idle(self, stop: threading.Event) -> None:
        """`on_idle`; its error is logged, not raised: nobody awaits it, and serving goes on."""
        if self._asleep:  # a sleep() queued between the last step and this spell: the memory is the trainer's
            return
        try:
            self.on_idle(stop)
        except Exception:
            log.exception("AsyncEngine: on_idle failed")

    def _step(self) -> bool:
        """Take in new requests and aborts, then one schedule -> run -> postprocess step; False when idle."""
        while self._inbox:
            req = self._inbox.popleft()
            eng = self.engine
            for seq in req.seqs:
                self._owner[seq.seq_id] = req
            for k in range(0, len(req.seqs), eng.max_batch):
                job = PrefillJob(eng.new_id(), list(req.prompt), group=req.seqs[k : k + eng.max_batch])
                req.jobs.append(job)
                self.sched.waiting.append(job)
        while self._aborts:
            req = self._requests.get(self._aborts.popleft())
            if req is not None:
                self.sched.abort(req.seqs, req.jobs)
                self._finish(req)
        if self._asleep or not self.sched.busy:
            self.engine.discard_pending()  # a step queued for samples that were all aborted since
            return False
        self.engine.step_once(self.sched, self._default, self._keep_hidden())
        self._collect()
        if len(self.engine.timeline) > 2 * TIMELINE_KEEP:  # a server runs for days: keep the recent steps
            del self.engine.timeline[:-TIMELINE_KEEP]
        return True

    def _keep_hidden(self) -> bool:
        return self.collect_hidden or any(r.params.return_hidden for r in self._requests.values())

    def _drain(self) -> None:
        """The step left queued on the device, collected and its finished requests answered."""
        self.engine.drain(self.sched, self._default, self._keep_hidden())
        self._collect()

    def _collect(self) -> None:
        done, self.sched.done = self.sched.done, []
        for seq in done:
            req = self._owner.get(seq.seq_id)
            if req is not None and all(s.finished for s in req.seqs):
                self._finish(req)

    def _fail_all(self, err: Exception) -> None:
        try:
            self.engine.discard_pending()
        except Exception:  # the device may be what failed: the queued step goes with the requests
            log.exception("AsyncEngine: the queued step could not be waited for")
        self._inbox.clear()
        for req in list(self._requests.values()):
            self.sched.abort(req.seqs, req.jobs)
            self._requests.pop(req.request_id, None)
            for s in req.seqs:
                self._owner.pop(s.seq_id, None)
            req.loop.call_soon_threadsafe(_reject, req.future, err)

    def _finish(self, req: _Request) -> None:
        if self._requests.pop(req.request_id, None) is None:
            return
        outs = []
        for s in req.seqs:
            self._owner.pop(s.seq_id, None)
            if s.finish_reason is None:
                s.finish_reason = "abort"
            want = req.params.return_hidden or (self.collect_hidden and s.finish_reason != "abort")
            outs.append(s.completion(want))
            if self.on_sample is not None and want and s.finish_reason != "abort":
                self.on_sample(req.prompt, outs[-1])
            if not req.params.return_hidden:
                outs[-1].hidden = None
            s.hidden_chunks = []
        result = RequestOutput(req.request_id, outs)
        req.loop.call_soon_threadsafe(_resolve, req.future, result)

    def _sleep(self) -> None:
        if self._asleep:
            return
        self._drain()
        self.sched.evict_all()
        self._captured = self.engine.release_memory()
        self._asleep = True

    def _wake_up(self) -> None:
        if not self._asleep:
            return
        self.engine.restore_memory(self._captured)
        self._asleep = False


def _reject(future: asyncio.Future, err: Exception) -> None:
    if not future.done():
        future.set_exception(err)


def _resolve(future: asyncio.Future, result: RequestOutput) -> None:
    if not future.done():
        future.set_result(result)
