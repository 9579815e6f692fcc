"""SpotDrafter over an AsyncEngine with speculation on: the rollout's samples fill the drafter buffer, the idle
engine thread trains a copy of the drafter and pushes it into the serving one, and the target still decides
every token (greedy outputs equal plain decoding whatever the drafter)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tests.helpers.engine import make_engine, tiny_pair
from tlt_rt.integrations.drafter_hook import SpotDrafter
from tlt_rt.rollout import AsyncEngine
from tlt_rt.rollout.async_engine import sampling_params_from
from tlt_rt.train.drafter.data import collect_hidden

ONE = ("3_3_8",)
GREEDY = {"temperature": 0.0, "max_tokens": 14, "ignore_eos": True}
WAVE = [
    ([1, 2, 3], GREEDY),
    ([4, 5, 6, 7, 8], {"temperature": 0.9, "max_tokens": 10, "seed": 3, "n": 2}),
    ([9], {"temperature": 0.0, "max_tokens": 20, "n": 2}),
    ([2, 2, 2, 2], {"temperature": 0.7, "top_k": 3, "max_tokens": 8, "seed": 5, "ignore_eos": True}),
]


class Hooked:
    """An AsyncEngine whose on_idle is the SpotDrafter's, counting idle spells (set when one has returned)."""

    def __init__(self, **spot_kwargs):
        self.engine = make_engine("on", ONE, max_batch=8)
        self.spot = SpotDrafter(self.engine, **spot_kwargs)
        self.returns: list[tuple[int, int]] = []  # (steps pushed, trainer steps) as each idle spell returned
        self.idle_done = threading.Event()
        self.aeng = AsyncEngine(self.engine, collect_hidden=True, on_sample=self.spot.collect, on_idle=self._idle)

    def _idle(self, stop: threading.Event) -> None:
        try:
            self.spot.train_while_idle(stop)
        finally:
            self.returns.append((self.spot.trained_steps, self.spot.trainer.steps))
            self.idle_done.set()

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the idle spell after the last wave has returned."""
        assert await asyncio.get_running_loop().run_in_executor(None, self.idle_done.wait, timeout)

    async def wave(self, reqs):
        """Submit requests together (one busy spell) and wait for them all."""
        self.idle_done.clear()
        return await asyncio.gather(*[self.aeng.generate(p, d) for p, d in reqs])


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], module: torch.nn.Module) -> bool:
    return any(not torch.equal(before[k], v) for k, v in module.state_dict().items())


def _buffer_samples(buffer) -> list[tuple[list[int], torch.Tensor]]:
    out = []
    for s in buffer._steps:
        for start, length in zip(s.starts.tolist(), s.lengths.tolist(), strict=True):
            out.append((s.ids[start : start + length].tolist(), s.hidden[start : start + length]))
    return out


def _plain(prompt: list[int], d: dict):
    """The request on a fresh engine with speculation off."""
    return [o.token_ids for o in make_engine("off").generate([prompt], sampling_params_from(d, eos=(11,)))]


def test_finished_samples_fill_the_buffer_with_their_hidden_rows():
    h = Hooked(min_tokens=10**9)  # never trains: only the collection is under test

    async def main():
        outs = await h.wave(WAVE)
        await h.wait_idle()  # the idle spell moves the collected samples into the buffer as one step
        return outs

    outs = asyncio.run(main())
    h.aeng.shutdown()
    assert h.spot.trained_steps == 0 and h.spot.buffer.steps == [1]
    expected = [p + c.token_ids[:-1] for (p, _), out in zip(WAVE, outs, strict=True) for c in out.outputs]
    assert len(expected) == 6
    samples = _buffer_samples(h.spot.buffer)
    assert sorted(ids for ids, _ in samples) == sorted(expected)
    assert h.spot.buffer.num_samples == len(expected)
    assert h.spot.buffer.num_tokens == sum(len(e) for e in expected)
    # each row is the target's hidden state (before the final norm) at that token: the dense forward's
    target, _ = tiny_pair(0, 4.0)
    dense = collect_hidden(target, [torch.tensor(ids) for ids, _ in samples])
    for (ids, hid), ref in zip(samples, dense, strict=True):
        assert hid.shape == (len(ids), target.arch.hidden_size)
        torch.testing.assert_close(hid, ref, atol=1e-4, rtol=1e-4)
    # the returned completions keep no hidden states (not asked for), and no request is left
    assert all(c.hidden is None for out in outs for c in out.outputs)
    assert h.aeng.num_requests == 0


def test_idle_training_updates_the_serving_drafter_and_outputs_stay_exact():
    h = Hooked(min_tokens=16, max_steps=3, lr=1e-2, batch_tokens=64)
    serving = h.engine.drafter_runner.drafter
    assert h.spot.serving is serving and h.spot.drafter is not serving
    before = _snapshot(serving)
    target_before = _snapshot(h.engine.target)

    async def main():
        first = await h.wave(WAVE)
        await h.wait_idle()
        trained = (h.spot.trained_steps, _changed(before, serving))
        second = await h.wave([(p, GREEDY) for p, _ in WAVE])
        await h.wait_idle()
        return first, trained, second

    first, trained, second = asyncio.run(main())
    h.aeng.shutdown()
    assert trained == (3, True)  # max_steps per idle spell, pushed into the serving drafter
    assert h.spot.trained_steps == 6 and h.spot.trainer.steps == 6
    assert h.spot.buffer.steps == [1, 2]
    # the serving drafter holds the trained weights; the target's are untouched (shared modules not trained)
    for k, v in h.spot.drafter.state_dict().items():
        torch.testing.assert_close(serving.state_dict()[k], v.to(serving.state_dict()[k].dtype))
    assert not _changed(target_before, h.engine.target)
    # the target decides every token: greedy outputs before and after training equal plain decoding
    assert first[0].token_ids == _plain(*WAVE[0])[0]
    assert first[2].outputs[0].token_ids == _plain(*WAVE[2])[0]
    for (p, _), out in zip(WAVE, second, strict=True):
        assert [c.token_ids for c in out.outputs] == _plain(p, GREEDY)
    assert h.engine.stats()["sd_steps"] > 0
    assert h.engine.blocks.num_free == h.engine.blocks.num_blocks


def test_a_new_request_stops_idle_training():
    """With no step limit, training runs until a request arrives; that request is served, exactly."""
    h = Hooked(min_tokens=16, max_steps=None, lr=1e-2, batch_tokens=64)
    serving = h.engine.drafter_runner.drafter

    async def main():
        await h.wave(WAVE)
        deadline = time.monotonic() + 30
        while h.spot.trainer.steps < 2:  # training is under way in the engine thread
            assert time.monotonic() < deadline and not h.returns
            await asyncio.sleep(0.01)
        before = _snapshot(serving)  # nothing pushed yet: the push comes when training stops
        assert h.spot.trained_steps == 0
        out = await asyncio.wait_for(h.aeng.generate([1, 2, 3], GREEDY), 30)
        # the idle spell returned before the request's steps ran, every finished step pushed, none half-done
        pushed, steps = h.returns[0]
        assert pushed == steps >= 2
        assert _changed(before, serving)
        # another idle spell starts after the request and is stopped by sleep() (which must not wait for it)
        while h.spot.trainer.steps == pushed:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(h.aeng.sleep(), 30)
        await h.aeng.wake_up()
        again = await asyncio.wait_for(h.aeng.generate([4, 5], GREEDY), 30)
        return out, again

    out, again = asyncio.run(main())
    assert out.token_ids == _plain([1, 2, 3], GREEDY)[0]
    assert again.token_ids == _plain([4, 5], GREEDY)[0]
    # shutdown stops a training spell that is still running instead of waiting for it forever
    done = threading.Thread(target=h.aeng.shutdown, daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive()
    assert h.spot.trained_steps == h.spot.trainer.steps


def test_aborted_samples_are_not_collected_and_weights_update_during_training():
    h = Hooked(min_tokens=8, max_steps=None, lr=1e-2, batch_tokens=64)
    long = {"temperature": 0.8, "max_tokens": 400, "ignore_eos": True, "seed": 1}
    new_target, _ = tiny_pair(seed=5, scale=4.0)

    async def main():
        h.idle_done.clear()
        x = asyncio.ensure_future(h.aeng.generate([1, 2, 3], long, "x"))
        y = await h.aeng.generate([5, 6], GREEDY, "y")
        h.aeng.abort("x")
        x = await x
        deadline = time.monotonic() + 30
        while h.spot.trainer.steps < 1:  # the idle spell trains on y alone
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        # a weight update is engine-thread work: it stops the training spell instead of waiting behind it
        n = await asyncio.wait_for(h.aeng.update_weights(new_target.state_dict().items()), 30)
        return x, y, n

    x, y, n = asyncio.run(main())
    h.aeng.shutdown()
    assert x.finish_reason == "abort" and y.finish_reason == "length"
    assert [ids for ids, _ in _buffer_samples(h.spot.buffer)] == [[5, 6] + y.token_ids[:-1]]
    assert n == len(new_target.state_dict()) and h.returns and h.returns[0][0] == h.returns[0][1] >= 1


def test_on_idle_errors_are_logged_and_serving_goes_on(caplog):
    calls = []

    def broken(stop):
        calls.append(stop)
        raise RuntimeError("drafter training broke")

    aeng = AsyncEngine(make_engine("on", ONE), on_idle=broken)

    async def main():
        first = await aeng.generate([1, 2, 3], GREEDY)
        while not calls:
            await asyncio.sleep(0.01)
        return first, await aeng.generate([1, 2, 3], GREEDY)

    with caplog.at_level("ERROR", logger="tlt_rt.rollout.async_engine"):
        first, second = asyncio.run(main())
    aeng.shutdown()
    assert first.token_ids == second.token_ids == _plain([1, 2, 3], GREEDY)[0]
    assert "on_idle failed" in caplog.text and "drafter training broke" in caplog.text


def test_spot_drafter_needs_speculation():
    with pytest.raises(ValueError, match="speculation on"):
        SpotDrafter(make_engine("off"))
