"""The engine on CUDA: Triton kernels and CUDA graphs give the same tokens as the eager torch path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers.engine import PROMPTS, TINY, count_calls
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.llama import CausalLM
from tlt_rt.rollout import Engine, SamplingParams

pytestmark = pytest.mark.gpu


# the Triton kernels want head dims of at least 16
GPU_TINY = replace(
    TINY, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256
)


def _pair():
    torch.manual_seed(0)
    target = CausalLM(GPU_TINY).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    return target.cuda(), Drafter(GPU_TINY, target).cuda().eval()


def _engines(**kw):
    out = []
    for eager, backend in ((True, "torch"), (False, "auto")):
        target, drafter = _pair()
        out.append(Engine(target, drafter=drafter, block_size=16, enforce_eager=eager, attn_backend=backend, **kw))
    return out


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_graphs_and_kernels_match_eager_torch(speculative):
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=40, stop_token_ids=[])
    eager, graphed = _engines(speculative=speculative, strategies=("3_3_8", "4_2_6"))
    a, b = eager.generate(PROMPTS, params), graphed.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert graphed.graph_memory()["graphs"] > 0
    if speculative == "on":
        assert graphed.stats()["sd_steps"] > 0


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_fused_decode_kernels_keep_the_eager_tokens(speculative, monkeypatch):
    """fuse_norm and fuse_rope on: the graphed engine's greedy tokens stay the eager torch engine's, plain and
    speculative, and its plain decode steps ran through both kernels (the add + norm + projection, the rotary
    inside decode attention)."""
    from tlt_rt.codegen.kernels import decode_rope_attention, norm_linear

    targets = ((norm_linear, "norm_linear", "norm"), (decode_rope_attention, "decode_rope_attention", "rope"))
    used = count_calls(monkeypatch, targets)
    # at most 8 rows a step (the norm kernel's limit): two prompts x 3 samples
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=40, stop_token_ids=[])
    prompts = PROMPTS[:2]
    target, drafter = _pair()
    eager = Engine(target, drafter=drafter, block_size=16, enforce_eager=True, attn_backend="torch",
                   speculative=speculative, strategies=("3_3_8", "4_2_6"))  # fmt: skip
    target, drafter = _pair()
    fused = Engine(target, drafter=drafter, block_size=16, speculative=speculative, strategies=("3_3_8", "4_2_6"),
                   fuse_norm=True, fuse_rope=True)  # fmt: skip
    fused.glue.norm_rows = 8  # (one row by default) the kernel on every step of these 6 rows; steps capture lazily
    a, b = eager.generate(prompts, params), fused.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    if speculative == "off":  # (speculative steps verify more rows than the norm kernel takes, in verify mode)
        assert used["norm"] > 0 and used["rope"] > 0, used
    else:
        assert fused.stats()["sd_steps"] > 0


def test_capture_all_buckets_then_generate():
    _, graphed = _engines(speculative="auto", strategies=("3_3_8", "4_2_6"), max_batch=8)
    mem = graphed.capture()
    # every step, and a lone prompt's prefill at each padded size (64 / 128 / 256 by default)
    assert mem["graphs"] == len(graphed.graph_keys()) + 3 and len(graphed.runner.prefill_keys()) == 3
    outs = graphed.generate([[1, 2, 3]], SamplingParams(n=8, temperature=0.9, max_new_tokens=16, stop_token_ids=[]))
    assert len(outs) == 8 and all(len(o.token_ids) == 16 for o in outs)


def test_steps_do_not_wait_for_other_streams():
    """A drafter trainer on its own stream (spot training in the rollout's tail) is neither waited for nor
    timed by the engine: generate returns while a long kernel queued on another stream still runs."""
    _, graphed = _engines(speculative="auto", strategies=("3_3_8",), max_batch=4)
    graphed.capture()
    params = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=[])
    graphed.generate(PROMPTS[:2], params)  # first prefill shapes compile here
    side, done = torch.cuda.Stream(), torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(3_000_000_000)  # ~1.5-2 s of one SM's cycles, far longer than a few tiny steps
        done.record(side)
    outs = graphed.generate(PROMPTS[:2], params)
    still_running = not done.query()
    side.synchronize()
    assert all(len(o.token_ids) == 4 for o in outs)
    assert still_running, "an engine step synchronised the whole device instead of its own stream"


def test_trainer_on_an_sm_partition_computes_what_it_would_on_all():
    """`drafter.tail_sms`: the tail trainer's stream lives on a green context of a few SMs (where the build has
    them); its kernels give the results they give on an ordinary stream, while the engine decodes beside it."""
    from tlt_rt.train.drafter.tail import trainer_stream

    dev = torch.device("cuda")
    stream, sms = trainer_stream(dev, 16)
    total = torch.cuda.get_device_properties(dev).multi_processor_count
    try:
        from torch.cuda.green_contexts import SUPPORTED
    except ImportError:
        SUPPORTED = False
    assert sms in (0, 16) and (sms == 16 or not SUPPORTED or total <= 16)
    a = torch.randn(2048, 576, device=dev)
    b = torch.randn(576, 4096, device=dev)
    ref = torch.softmax(a @ b, -1)
    _, graphed = _engines(speculative="auto", strategies=("3_3_8",), max_batch=4)
    graphed.capture()
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[])
    alone = [o.token_ids for o in graphed.generate(PROMPTS[:2], params)]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = [torch.softmax(a @ b, -1) for _ in range(20)]
    beside = [o.token_ids for o in graphed.generate(PROMPTS[:2], params)]
    stream.synchronize()
    assert beside == alone
    for g in got:
        torch.testing.assert_close(g, ref)


def test_smollm2_bf16_answers():
    from tlt_rt.models.default import load_tokenizer

    tok = load_tokenizer(None)
    eng = Engine.from_pretrained(None, speculative="on", dtype="bfloat16", device="cuda", strategies=("6_4_16",))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 17*3?"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    out = eng.generate([list(ids)], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert tok.decode(out[0].token_ids).startswith("17*3 = 51")
    assert torch.cuda.is_available()


def test_step_graphs_match_plain_and_eager_decoding():
    """Whole steps replayed from their captured graphs (padded batches, prompts shorter than the catch-up
    block) give the greedy tokens of plain decoding and of the eager engine; nothing is captured lazily."""
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=40, stop_token_ids=[])
    strategies = ("3_3_8", "4_2_6")
    eager, graphed = _engines(speculative="on", strategies=strategies, max_batch=16)
    off = _engines(speculative="off", strategies=strategies, max_batch=16)[1]
    mem = graphed.capture()
    keys = graphed.graph_keys()
    assert len(keys) == len(graphed.buckets) * (1 + len(strategies)) * 2  # x (off + strategies) x 2 modes
    assert all(k[0] == "step" for k in keys)
    assert mem["graphs"] == len(keys) + len(graphed.runner.prefill_keys()) and mem["pool_bytes"] > 0
    pool = graphed.runner.pool
    replays = []
    replay = pool.replay
    pool.replay = lambda key, *args: replays.append(key) or replay(key, *args)
    tokens = [o.token_ids for o in graphed.generate(PROMPTS, params)]
    assert tokens == [o.token_ids for o in eager.generate(PROMPTS, params)]
    assert tokens == [o.token_ids for o in off.generate(PROMPTS, params)]
    assert graphed.stats()["sd_steps"] > 0
    assert sum(k[2] != "off" for k in replays) == graphed.stats()["sd_steps"]
    assert len(replays) == graphed.stats()["steps"]
    assert graphed.graph_memory()["graphs"] == mem["graphs"]  # nothing captured lazily


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_step_graph_replay_equals_eager_step(temperature):
    """One captured SD step (batch 3 padded to bucket 4) against the same step run eagerly on a copy of the
    caches: the same host results, moved windows and hidden rows."""
    from tlt_rt.rollout.model_runner import ModelRunner
    from tlt_rt.rollout.step.graph import StepArgs
    from tlt_rt.rollout.step.target import accept_mode

    torch.manual_seed(0)
    target, drafter = _pair()
    runs = []
    for buckets in ([1, 2, 4], None):
        runner = ModelRunner(target, drafter, 64, 16, 8, buckets, window_rows=5)
        for c in (runner.target.cache, runner.drafter.cache):
            c.k.normal_(generator=torch.Generator("cuda").manual_seed(1))
            c.v.normal_(generator=torch.Generator("cuda").manual_seed(2))
        runs.append(runner)
    gen = torch.Generator().manual_seed(3)
    b, r, h = 3, 5, GPU_TINY.hidden_size
    lens = torch.tensor([2, 40, 77])
    ints = torch.cat([lens[:, None], lens.clamp(max=r)[:, None], torch.randint(0, GPU_TINY.vocab_size, (b, r),
                      generator=gen), torch.arange(b * 8).view(b, 8)], 1)  # fmt: skip
    floats = torch.cat([torch.rand(b, 2 * 4, generator=gen), torch.tensor([[temperature, -1.0, 1.0]] * b)], 1)
    window = torch.randn(b, r, h, generator=gen).cuda()
    params = SamplingParams(temperature=temperature)
    outs = [rn.run_args("3_3_8", accept_mode(params), StepArgs(ints, floats, window)) for rn in runs]
    assert runs[0].pool.has(("step", 4, "3_3_8", accept_mode(params)))
    (got, want) = outs
    torch.testing.assert_close(got.host, want.host)
    torch.testing.assert_close(got.window, want.window)
    torch.testing.assert_close(got.hidden, want.hidden)


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_returned_hidden_outlive_graph_replays(speculative):
    """Hidden rows kept from a replayed graph's output are copies, not views the next replay overwrites."""
    _, graphed = _engines(speculative=speculative, strategies=("3_3_8",))
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=20, stop_token_ids=[], return_hidden=True)
    for o in graphed.generate([[1, 2, 3]], params):
        with torch.no_grad():
            dense = graphed.target(torch.tensor([[1, 2, 3] + o.token_ids], device="cuda"))
        torch.testing.assert_close(o.hidden, dense.hidden[0, :-1], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("speculative", ["on", "auto"])
def test_a_fused_drafter_under_graphs_keeps_greedy_and_the_fused_hidden(speculative):
    """EAGLE-3 features: every hidden buffer of the captured steps is the fused width, and greedy stays plain."""
    arch = replace(GPU_TINY, num_hidden_layers=4)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=32, stop_token_ids=[], return_hidden=True)
    got = {}
    for mode in ("off", speculative):
        torch.manual_seed(0)
        target = CausalLM(arch).eval()
        with torch.no_grad():
            target.lm_head.weight.mul_(4.0)
        drafter = Drafter(arch, target, feature_layers=(0, 2)).eval()
        with torch.no_grad():
            drafter.fuse.weight.add_(torch.randn_like(drafter.fuse.weight) * 0.05)
        target, drafter = target.cuda(), drafter.cuda()
        eng = Engine(target, drafter=drafter if mode != "off" else None, speculative=mode,
                     strategies=("3_3_8", "4_2_6"), block_size=16)  # fmt: skip
        got[mode] = eng.generate(PROMPTS, params)
        if mode != "off":
            assert target.feature_size == 3 * arch.hidden_size and eng.graph_memory()["graphs"] > 0
            assert all(o.hidden.shape[-1] == 3 * arch.hidden_size for o in got[mode])
            if mode == "on":
                assert eng.stats()["sd_steps"] > 0
    assert [o.token_ids for o in got[speculative]] == [o.token_ids for o in got["off"]]


def test_a_captured_engine_pads_a_lone_prefill_up_to_256_tokens_by_default():
    target, drafter = _pair()
    assert Engine(target, drafter=drafter, block_size=16).runner.prefill_keys() == [
        ("prefill", 64), ("prefill", 128), ("prefill", 256)
    ]  # fmt: skip
    assert Engine(target, drafter=drafter, block_size=16, enforce_eager=True).runner.prefill_keys() == []


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_a_captured_one_prompt_prefill_gives_the_eager_engines_tokens(speculative):
    """`prefill_graph_tokens`: a lone prompt's prefill replays a graph captured at its padded size (64 here); the
    tokens equal the eager torch engine's, and the graph was captured and replayed."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=[])
    eager, _ = _engines(speculative=speculative, strategies=("3_3_8",))  # every prefill eager, unpadded
    target, drafter = _pair()
    graphed = Engine(target, drafter=drafter, block_size=16, speculative=speculative, strategies=("3_3_8",),
                     prefill_graph_tokens=64)  # fmt: skip
    graphed.capture()
    assert ("prefill", 64) in graphed.runner.pool.graphs
    replays = []
    pool = graphed.runner.pool
    pool.replay = lambda key, *args, replay=pool.replay: replays.append(key) or replay(key, *args)
    for prompt in PROMPTS:
        a, b = eager.generate([prompt], params), graphed.generate([prompt], params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert replays.count(("prefill", 64)) == len(PROMPTS)


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_captured_steps_read_weights_updated_in_place(speculative):
    """An RL worker's learner copies its new weights into the engine's parameters in place (q/k/v and gate/up are
    views into the fused projections the graphs captured): every captured step, prefill and decode, plain and
    speculative, then computes with the new weights, giving the greedy tokens of an eager engine built on them."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=[])
    target, drafter = _pair()
    graphed = Engine(target, drafter=drafter, block_size=16, speculative=speculative, strategies=("3_3_8", "4_2_6"),
                     prefill_graph_tokens=64)  # fmt: skip
    graphed.capture()
    before = graphed.generate(PROMPTS, params)
    torch.manual_seed(7)
    new = CausalLM(GPU_TINY).eval()
    with torch.no_grad():
        new.lm_head.weight.mul_(4.0)
        for p, q in zip(target.parameters(), new.parameters(), strict=True):  # as the learner does: p.copy_(master)
            p.copy_(q)
    after = graphed.generate(PROMPTS, params)
    ref = Engine(new.cuda(), block_size=16, enforce_eager=True, attn_backend="torch").generate(PROMPTS, params)
    assert [o.token_ids for o in after] == [o.token_ids for o in ref]
    assert [o.token_ids for o in before] != [o.token_ids for o in after]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_plain_steps_one_ahead_keep_every_token_and_log_prob(temperature):
    # captured steps of buckets 4 / 8 / 16: a sample stopping inside a bucket leaves the step queued behind it
    # standing, its other rows' results bit for bit those of the step the engine would have run without it
    params = SamplingParams(n=3, temperature=temperature, seed=3, max_new_tokens=48)
    outs, launches = [], []
    for overlap in (False, True):
        target, _ = _pair()
        eng = Engine(target, speculative="off", block_size=16, graph_batches=[4, 8, 16], overlap=overlap)
        real, seen = eng.runner.launch, []

        def launch(*args, _real=real, _seen=seen, **kw):
            _seen.append(kw.get("after") is not None)
            return _real(*args, **kw)

        eng.runner.launch = launch
        got = eng.generate(PROMPTS, params)
        outs.append([(o.token_ids, o.logprobs, o.finish_reason) for o in got])
        launches.append((len(seen), sum(seen), eng.stats()["decode_steps"]))
    assert outs[1] == outs[0]
    assert any(reason == "stop" for _, _, reason in outs[1])
    n, ahead, steps = launches[1]
    assert ahead > steps // 2 and n - steps < sum(reason == "stop" for _, _, reason in outs[1])


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculative_steps_one_ahead_keep_every_token_and_log_prob(temperature):
    # captured speculative steps queued after one of the same strategy: the replay of the same graph overwrites
    # the step before's outputs, which the engine keeps first (its host row, its moved windows)
    params = SamplingParams(n=3, temperature=temperature, seed=3, max_new_tokens=48)
    outs, hists = [], []
    for options in (dict(overlap=False), dict(overlap_speculative=True)):
        target, drafter = _pair()
        eng = Engine(target, drafter=drafter, speculative="on", strategies=("3_3_8",), block_size=16,
                     graph_batches=[4, 8, 16], **options)  # fmt: skip
        got = eng.generate(PROMPTS, params)
        outs.append([(o.token_ids, o.logprobs, o.finish_reason) for o in got])
        hists.append(eng.stats()["accept_length_hist"])
    assert outs[1] == outs[0] and hists[1] == hists[0]


def test_async_engine_with_steps_queued_ahead_gives_closed_calls_tokens():
    # the serving front (verl's server) over captured plain steps queued one ahead: requests join and one leaves
    # (aborted) between steps; every other request's tokens are those of a closed call on its own
    import asyncio

    from tlt_rt.rollout import AsyncEngine
    from tlt_rt.rollout.scheduler import sampling_params_from

    reqs = [(f"r{i}", PROMPTS[i % len(PROMPTS)], {"temperature": 0.9 * (i % 2), "max_tokens": 12 + 5 * i,
                                                   "seed": i, "ignore_eos": i % 3 == 0}) for i in range(6)]  # fmt: skip

    def engine():
        target, _ = _pair()
        return Engine(target, speculative="off", block_size=16, graph_batches=[4, 8])

    aeng = AsyncEngine(engine())

    async def main():
        gone = asyncio.ensure_future(aeng.generate([1, 2], {"temperature": 0.5, "max_tokens": 300,
                                                            "ignore_eos": True}, "gone"))  # fmt: skip
        outs = []
        for rid, prompt, d in reqs:
            outs.append(asyncio.ensure_future(aeng.generate(prompt, d, rid)))
            await asyncio.sleep(0.005)
        aeng.abort("gone")
        return await gone, await asyncio.gather(*outs)

    gone, outs = asyncio.run(main())
    assert gone.finish_reason == "abort"
    ref = engine()
    for (_, prompt, d), out in zip(reqs, outs, strict=True):
        want = ref.generate([prompt], sampling_params_from(d, eos=GPU_TINY.eos_token_ids))
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in want]
    aeng.shutdown()


def test_a_steps_rows_of_samples_left_are_picked_without_waiting_for_the_step_queued_behind():
    # samples finishing while a step is queued behind the collected one: their rows are dropped from its hidden
    # copy on the device; the host must not wait for the queued step to do it (a stall at every finish)
    from tlt_rt.rollout.step.io import StepOut

    hidden = torch.randn(4, 1, 32, device="cuda")
    out = StepOut([0] * 4, [[i] for i in range(4)], [[0.0]] * 4, hidden.clone())
    out.rows([0, 1, 2])  # the pinned host allocator's first block (cudaHostAlloc) taken before anything is queued
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # the step queued behind: ~0.5 s of device work
    queued = torch.cuda.Event()
    queued.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        picked = out.rows([0, 2, 3])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not queued.query(), "picking the rows waited for the work queued before it"
    assert picked.tokens == [[0], [2], [3]]
    assert torch.equal(picked.hidden, hidden[torch.tensor([0, 2, 3], device="cuda")])


# where the engine's loop may wait for the device: a step's collection, a dropped step's discard, a prefill (its
# first tokens come to the host), the drafter's eager catch-up (run with no step in flight), a capture
WAITS_ALLOWED = {
    ("rollout/model_runner.py", "collect"),
    ("rollout/model_runner.py", "discard"),
    ("rollout/model_runner.py", "prefill"),
    ("rollout/step/prefill.py", "*"),
    ("rollout/step/drafting.py", "catch_up"),
    ("codegen/graphs.py", "capture"),
}


def _waits(fn) -> list[str]:
    """Run fn under PyTorch's sync debug mode; the engine frames (innermost first, as `file:function`) of every
    synchronizing call that no frame in WAITS_ALLOWED explains."""
    import traceback
    import warnings

    found = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = []
        for f in traceback.extract_stack():
            where = f.filename.replace("\\", "/")
            if "/tlt_rt/" in where:
                frames.append((where.rsplit("/tlt_rt/", 1)[1], f.name))
        if not any(f in WAITS_ALLOWED or (f[0], "*") in WAITS_ALLOWED for f in frames):
            chain = " <- ".join(f"{path}:{name}" for path, name in reversed(frames[-4:]))
            found.append(chain or f"{filename}:{lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


@pytest.mark.parametrize("speculative", ["off", "on", "auto"])
def test_the_loop_waits_for_the_device_only_to_collect_a_step(speculative):
    # steps queued ahead pay off only if nothing between a launch and the collection of the step before waits for
    # the stream: an upload from pageable memory there (a hidden-row index at each finish) cost auto 15% at batch 128
    from collections import Counter

    target, drafter = _pair()
    eng = Engine(target, drafter=drafter, speculative=speculative, strategies=("3_3_8",), block_size=16,
                 graph_batches=[4, 8, 16])  # fmt: skip
    params = SamplingParams(n=3, temperature=0.9, seed=3, max_new_tokens=48)
    eng.generate(PROMPTS, params)  # captures every step it needs
    found = _waits(lambda: eng.generate(PROMPTS, params))
    assert not found, f"the loop waited for the device outside a collection: {Counter(found).most_common(8)}"
