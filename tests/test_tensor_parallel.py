"""Tensor parallelism over 2 gloo ranks on CPU equals the unsharded model: dense forward and its gradients,
paged prefill / decode / tree verify (and the per-rank KV cache), and a whole greedy and sampled engine run.

One pair of spawned ranks runs every check and writes its results; the tests read them back.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.llama import CausalLM
from tlt_rt.models.tensor_parallel import set_fast_allreduce, shard_for_tp, use_allreduce

from .dist_harness import read_checks, run_checks, spawn_ranks

WORLD = 2
BASE = dict(
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
CASES = {
    "llama": ArchConfig(model_type="llama", vocab_size=96, **BASE),
    "qwen2-tied": ArchConfig(model_type="qwen2", vocab_size=96, qkv_bias=True, tie_word_embeddings=True, **BASE),
    # every bias, and a vocabulary that 2 ranks split unevenly (padded shard)
    "llama-bias-vocab97": ArchConfig(
        model_type="llama", vocab_size=97, qkv_bias=True, o_bias=True, mlp_bias=True, **BASE
    ),
}
ATOL = 1e-5


def _build(case: str) -> CausalLM:
    torch.manual_seed(11)
    model = CausalLM(CASES[case])
    with torch.no_grad():
        for p in model.parameters():  # random biases and norms so that every path matters
            p.normal_(0, 0.2)
    return model.eval()


def _pair(case: str) -> tuple[CausalLM, CausalLM]:
    full = _build(case)
    return full, shard_for_tp(copy.deepcopy(full))


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------- checks
def check_dense(case: str, rank: int) -> None:
    full, tp = _pair(case)
    ids = torch.randint(0, CASES[case].vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = full(ids), tp(ids)
    _close(got.logits, want.logits, "logits")
    _close(got.hidden, want.hidden, "hidden")


def check_dense_grad(case: str, rank: int) -> None:
    full, tp = _pair(case)
    ids = torch.randint(0, CASES[case].vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    for m in (full, tp):
        m(ids).logits.log_softmax(-1).pow(2).mean().backward()
    a, d, i = CASES[case], CASES[case].head_dim, CASES[case].intermediate_size // WORLD
    hq, hkv = a.num_attention_heads // WORLD, a.num_key_value_heads // WORLD
    q, kv, mlp = (slice(rank * n, (rank + 1) * n) for n in (hq * d, hkv * d, i))
    lf, lt = full.model.layers[0], tp.model.layers[0]
    _close(lt.self_attn.q_proj.weight.grad, lf.self_attn.q_proj.weight.grad[q], "q")
    _close(lt.self_attn.k_proj.weight.grad, lf.self_attn.k_proj.weight.grad[kv], "k")
    _close(lt.self_attn.o_proj.weight.grad, lf.self_attn.o_proj.weight.grad[:, q], "o")
    _close(lt.mlp.down_proj.weight.grad, lf.mlp.down_proj.weight.grad[:, mlp], "down")
    _close(lt.input_layernorm.weight.grad, lf.input_layernorm.weight.grad, "norm (replicated)")
    size = tp.model.embed_tokens.weight.shape[0]
    rows = full.model.embed_tokens.weight.grad[rank * size : (rank + 1) * size]
    _close(tp.model.embed_tokens.weight.grad[: rows.shape[0]], rows, "embedding (tied: + lm_head)")


def _meta(tables, q_lens, seq_lens, slots, mode, tree_mask=None) -> AttnMetadata:
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return AttnMetadata(
        mode, cu, torch.tensor(seq_lens, dtype=torch.int32), tables, torch.cat(slots), max(q_lens), tree_mask
    )


def _paged_script(vocab: int, block_size: int):
    """Two sequences: prefill in two uneven chunks, two decode steps, then a random 5-node tree verify.
    Returns the (ids, positions, meta) of every step and the number of cache blocks they need."""
    gen = torch.Generator().manual_seed(3)
    per_seq = 8
    tables = torch.randperm(2 * per_seq + 2, generator=gen)[: 2 * per_seq].view(2, per_seq).int()

    def slots(b, pos):
        return tables[b, pos // block_size].long() * block_size + pos % block_size

    steps, done = [], [0, 0]
    for chunk in ([7, 3], [4, 2]):
        ids, pos, sl = [], [], []
        for b, c in enumerate(chunk):
            p = torch.arange(done[b], done[b] + c)
            ids.append(torch.randint(0, vocab, (c,), generator=gen)), pos.append(p), sl.append(slots(b, p))
            done[b] += c
        steps.append((torch.cat(ids), torch.cat(pos), _meta(tables, chunk, list(done), sl, "prefill")))
    for _ in range(2):
        pos = torch.tensor(done)
        done = [n + 1 for n in done]
        sl = [slots(b, pos[b : b + 1]) for b in range(2)]
        steps.append((torch.randint(0, vocab, (2,), generator=gen), pos, _meta(tables, [1, 1], done, sl, "decode")))
    t = 5
    mask = torch.zeros(2, t, t, dtype=torch.bool)
    for b in range(2):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)]
        for n in range(t):
            j = n
            while j >= 0:
                mask[b, n, j], j = True, parents[j]
    positions = torch.tensor(done).view(2, 1) + mask.sum(-1) - 1  # rotary position by depth
    sl = [slots(b, torch.arange(done[b], done[b] + t)) for b in range(2)]
    meta = _meta(tables, [t, t], [n + t for n in done], sl, "verify", tree_mask=mask)
    steps.append((torch.randint(0, vocab, (2 * t,), generator=gen), positions.flatten(), meta))
    return steps, 2 * per_seq + 2


def check_paged(case: str, rank: int) -> None:
    full, tp = _pair(case)
    a = CASES[case]
    hkv = a.num_key_value_heads // WORLD
    steps, num_blocks = _paged_script(a.vocab_size, 4)
    cf, ct = full.make_cache(num_blocks, 4), tp.make_cache(num_blocks, 4)
    assert tuple(ct.k.shape) == (a.num_hidden_layers, num_blocks, 4, hkv, a.head_dim), tuple(ct.k.shape)
    with torch.no_grad():
        for n, (ids, pos, meta) in enumerate(steps):
            want, got = full.forward_paged(ids, pos, cf, meta), tp.forward_paged(ids, pos, ct, meta)
            _close(got.logits, want.logits, f"step {n} ({meta.mode}) logits")
            _close(got.hidden, want.hidden, f"step {n} ({meta.mode}) hidden")
    heads = slice(rank * hkv, (rank + 1) * hkv)
    _close(ct.k, cf.k[..., heads, :], "k cache holds this rank's KV heads")
    _close(ct.v, cf.v[..., heads, :], "v cache holds this rank's KV heads")


def check_engine(case: str, rank: int) -> None:
    from tlt_rt.rollout.engine import Engine
    from tlt_rt.rollout.params import SamplingParams

    full, tp = _pair(case)
    a = CASES[case]
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [42]]
    kw = dict(speculative="off", block_size=4, max_batch=4, max_prefill_tokens=8)
    ref, eng = Engine(full, **kw), Engine(tp, **kw)
    assert eng.runner.target.cache.k.shape[3] == a.num_key_value_heads // WORLD
    for params in (
        SamplingParams(n=2, temperature=0.0, max_new_tokens=12, stop_token_ids=[]),
        SamplingParams(n=3, temperature=0.9, top_k=20, max_new_tokens=10, stop_token_ids=[], seed=5),
    ):
        want, got = ref.generate(prompts, params), eng.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], "TP=2 tokens differ from TP=1"
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=1e-4)
        every = [None] * WORLD
        dist.all_gather_object(every, [o.token_ids for o in got])
        assert every[0] == every[1], "ranks disagree on the generated tokens"


def check_lockstep(case: str, rank: int) -> None:
    """speculative="auto" over 2 ranks: rank 0's policy decides for both (rank 1's own, made to explore on
    every step, is never read), and greedy tokens equal plain TP=1 decoding; the choices sent over the group
    itself, and over a gloo group beside it (`host_group`, as a GPU group's choices travel between hosts)."""
    from tlt_rt.models.drafter import Drafter
    from tlt_rt.rollout.engine import Engine
    from tlt_rt.rollout.lockstep import TargetHeads, lockstep_engine
    from tlt_rt.rollout.params import SamplingParams

    if case != "qwen2-tied":  # one architecture is enough for the control flow
        return
    full = _build(case)
    shard = copy.deepcopy(full)
    heads = TargetHeads(shard)  # the replicated drafter reads the full embedding and head
    shard_for_tp(shard)
    torch.manual_seed(3)
    drafter = Drafter(full.arch, heads).eval()
    kw = dict(block_size=4, max_batch=4, max_prefill_tokens=8, strategies=["3_2_4", "2_1_2"])
    ref = Engine(full, speculative="off", **kw)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [42]]
    want = ref.generate(prompts, params)
    for host_group in (None, dist.new_group(backend="gloo")):
        eng = lockstep_engine(shard, None, drafter=copy.deepcopy(drafter), speculative="auto", host_group=host_group,
                              **kw)  # fmt: skip
        assert eng.policy.host_group is host_group
        eng.policy.inner.epsilon = 1.0 if rank else 0.0
        got = eng.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], "lockstep TP=2 tokens differ from TP=1"
        st = eng.stats()
        assert st["sd_steps"] > 0 and st["decode_steps"] > 0, st
        every = [None] * WORLD
        dist.all_gather_object(every, [e["strategy"] for e in eng.timeline if e["kind"] != "prefill"])
        assert every[0] == every[1], "ranks took different speculative decisions"
        assert eng.policy.inner.stats()["explore_steps"] == 0  # only rank 0's policy decided, with epsilon 0


def check_sharded_drafter(case: str, rank: int) -> None:
    """A drafter sharded like the target (`shard_drafter_for_tp`) computes the unsharded one's features and
    logits; a full drafter state (a trained replica pushed to the serving copy) loads into the shard slice by
    slice; `replicated_state` leaves the per-rank slices out; and a lockstep engine with `drafter_tp="shard"`
    emits TP=1's greedy tokens with every rank's strategies alike."""
    from tlt_rt.models.drafter import Drafter
    from tlt_rt.models.tensor_parallel import replicated_state, shard_drafter_for_tp
    from tlt_rt.rollout.engine import Engine
    from tlt_rt.rollout.lockstep import TargetHeads, lockstep_engine
    from tlt_rt.rollout.params import SamplingParams

    full = _build(case)
    torch.manual_seed(5)
    drafter = Drafter(full.arch, full).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    sharded = shard_drafter_for_tp(copy.deepcopy(drafter).bind(full))
    assert sharded.arch.num_key_value_heads == full.arch.num_key_value_heads // WORLD
    assert sharded.make_cache(3, 4).k.shape[-2] == full.arch.num_key_value_heads // WORLD
    ids = torch.randint(0, full.arch.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2, 9, full.arch.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = drafter(ids, hidden), sharded(ids, hidden)
        _close(got.hidden, want.hidden, "sharded drafter features")
        _close(got.logits, want.logits, "sharded drafter logits")
        for p in drafter.parameters():  # a trained replica's new weights, pushed whole
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
        sharded.load_state_dict(drafter.state_dict())
        _close(sharded(ids, hidden).logits, drafter(ids, hidden).logits, "sharded drafter after a full load")
    kept = replicated_state(sharded)
    assert "fc.weight" in kept and not any(k.startswith("layers.0.self_attn.") and "proj" in k for k in kept), kept
    with pytest.raises(ValueError, match="already sharded"):
        shard_drafter_for_tp(sharded)
    if case != "qwen2-tied":  # the engine's control flow once
        return
    shard = copy.deepcopy(full)
    heads = TargetHeads(shard)
    shard_for_tp(shard)
    serving = Drafter(full.arch, heads).eval()
    serving.load_state_dict(drafter.state_dict())
    kw = dict(block_size=4, max_batch=4, max_prefill_tokens=8, strategies=["3_2_4"])
    with pytest.raises(ValueError, match="drafter_tp"):
        lockstep_engine(shard, None, drafter=serving, speculative="on", drafter_tp="half", **kw)
    eng = lockstep_engine(shard, None, drafter=serving, speculative="on", drafter_tp="shard", **kw)
    assert serving.tp is not None and eng.runner.drafter.drafter is serving
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10, stop_token_ids=[])
    prompts = [[1, 2, 3, 4, 5], [42]]
    want_tokens = Engine(full, speculative="off", **kw).generate(prompts, params)
    got_tokens = eng.generate(prompts, params)
    assert [o.token_ids for o in got_tokens] == [o.token_ids for o in want_tokens], "sharded-drafter TP=2 tokens"
    assert eng.stats()["sd_steps"] > 0
    every = [None] * WORLD
    dist.all_gather_object(every, [e["tokens"] for e in eng.timeline if e["kind"] != "prefill"])
    assert every[0] == every[1], "the ranks' sharded drafters drafted different trees"


class SmallSums:
    """A stand-in fast all-reduce: sums tensors of at most `most` elements itself (through gloo, into the tensor)
    and counts them, declines larger ones, which must then go through the ordinary all-reduce."""

    def __init__(self, most: int):
        self.most, self.taken, self.declined = most, 0, 0

    def __call__(self, x: torch.Tensor) -> bool:
        if x.numel() > self.most:
            self.declined += 1
            return False
        dist.all_reduce(x)
        self.taken += 1
        return True


class DirectSums(SmallSums):
    """SmallSums that also takes a row-parallel layer's whole matmul (`linear`, as the one-shot sum does: the
    product written where the sum reads it), for row blocks of at most `most` elements."""

    def __init__(self, most: int):
        super().__init__(most)
        self.direct = 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] * weight.shape[0] > self.most:
            return None
        y = x @ weight.t()
        dist.all_reduce(y)
        self.direct += 1
        return y


def check_direct_allreduce(case: str, rank: int) -> None:
    """A fast sum with `linear` takes every row-parallel matmul of a paged (2-D) forward that fits it; the
    embedding's sum still goes through its `__call__`: the logits are unchanged."""
    full, tp = _pair(case)
    a = CASES[case]
    fast = DirectSums(most=13 * a.hidden_size)
    set_fast_allreduce(tp, fast)
    steps, num_blocks = _paged_script(a.vocab_size, 4)
    cf, ct = full.make_cache(num_blocks, 4), tp.make_cache(num_blocks, 4)
    with torch.no_grad():
        for n, (ids, pos, meta) in enumerate(steps):
            want, got = full.forward_paged(ids, pos, cf, meta), tp.forward_paged(ids, pos, ct, meta)
            _close(got.logits, want.logits, f"step {n} ({meta.mode}) logits")
    assert fast.direct == 2 * a.num_hidden_layers * len(steps), (fast.direct, len(steps))
    assert fast.taken == len(steps), fast.taken  # the embedding's sums


class RowSums(DirectSums):
    """DirectSums that also takes a row-parallel layer's matmul and sum as one call (`row_parallel`, as the fused
    kernel of `use_allreduce(model, "fused")` does) for at most `rows` rows, recording each call's slot."""

    def __init__(self, most: int, rows: int):
        super().__init__(most)
        self.rows, self.slots = rows, []

    def row_parallel(self, x: torch.Tensor, weight: torch.Tensor, slot: int) -> torch.Tensor | None:
        if x.shape[0] > self.rows:
            return None
        self.slots.append(slot)
        y = x @ weight.t()
        dist.all_reduce(y)
        return y


def check_row_parallel_slots(case: str, rank: int) -> None:
    """A fast sum with `row_parallel` takes every row-parallel matmul of few rows before `linear`: attention's
    sums in slot 0, the MLP's in slot 1, so consecutive sums alternate across layers and steps (the fused kernel's
    condition); more rows go to `linear`; the logits are unchanged."""
    full, tp = _pair(case)
    a = CASES[case]
    fast = RowSums(most=13 * a.hidden_size, rows=4)
    set_fast_allreduce(tp, fast)
    steps, num_blocks = _paged_script(a.vocab_size, 4)
    cf, ct = full.make_cache(num_blocks, 4), tp.make_cache(num_blocks, 4)
    fused_steps = 0
    with torch.no_grad():
        for n, (ids, pos, meta) in enumerate(steps):
            want, got = full.forward_paged(ids, pos, cf, meta), tp.forward_paged(ids, pos, ct, meta)
            _close(got.logits, want.logits, f"step {n} ({meta.mode}) logits")
            fused_steps += ids.numel() <= 4
    assert 0 < fused_steps < len(steps), "the script must hold steps on both sides of the row limit"
    assert fast.slots == [0, 1] * a.num_hidden_layers * fused_steps, fast.slots
    assert fast.direct == 2 * a.num_hidden_layers * (len(steps) - fused_steps)


def check_fused_shards(case: str, rank: int) -> None:
    """The engine fuses each rank's column-parallel q/k/v and gate/up slices into one matmul each (as on one GPU),
    and its greedy tokens stay those of the unsharded model."""
    from tlt_rt.rollout.engine import Engine
    from tlt_rt.rollout.params import SamplingParams

    full, tp = _pair(case)
    kw = dict(speculative="off", block_size=4, max_batch=4, max_prefill_tokens=8)
    ref, eng = Engine(full, **kw), Engine(tp, **kw)
    for layer in tp.model.layers:
        assert (
            layer.self_attn.fused is not None and layer.self_attn.fused.sizes[0] == layer.self_attn.q_proj.out_features
        )
        assert layer.mlp.fused is not None
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10, stop_token_ids=[])
    prompts = [[1, 2, 3, 4, 5], [42]]
    want, got = ref.generate(prompts, params), eng.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want], "fused TP=2 tokens differ from TP=1"


def check_fast_allreduce(case: str, rank: int) -> None:
    """With a fast all-reduce set, every no-grad sum asks it first and the ones it declines go through NCCL/gloo:
    the forward is unchanged. `use_allreduce` names its kinds and refuses a CPU shard for the one-shot sum."""
    full, tp = _pair(case)
    small = SmallSums(most=2 * 13 * CASES[case].hidden_size)  # a [1, 13, H] block's sums, not a [4, 13, H] one's
    set_fast_allreduce(tp, small)
    assert all(m.tp.fast is small for m in tp.modules() if hasattr(m, "tp") and m.tp is not None)
    for batch in (1, 4):
        ids = torch.randint(0, CASES[case].vocab_size, (batch, 13), generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            want, got = full(ids), tp(ids)
        _close(got.logits, want.logits, f"logits, batch {batch}")
    per_forward = 1 + 2 * CASES[case].num_hidden_layers  # the embedding, and attention and MLP of every layer
    assert small.taken == per_forward and small.declined == per_forward, (small.taken, small.declined)
    with pytest.raises(ValueError, match="needs CUDA"):
        use_allreduce(tp, "oneshot")
    with pytest.raises(ValueError, match="one of"):
        use_allreduce(tp, "ring")
    use_allreduce(tp, "nccl")
    assert tp.tp.fast is None and tp.model.layers[0].mlp.down_proj.tp.fast is None
    with pytest.raises(ValueError, match="tensor-parallel shard"):
        use_allreduce(full, "nccl")


CHECKS = {"dense": check_dense, "dense_grad": check_dense_grad, "paged": check_paged, "engine": check_engine,
          "lockstep": check_lockstep, "fast_allreduce": check_fast_allreduce,
          "direct_allreduce": check_direct_allreduce, "fused_shards": check_fused_shards,
          "row_parallel_slots": check_row_parallel_slots, "sharded_drafter": check_sharded_drafter}  # fmt: skip


# ---------------------------------------------------------------------------------------- harness
def _worker(rank: int, world: int, out_dir: str) -> None:
    run_checks(rank, CHECKS, CASES, out_dir)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    spawn_ranks(_worker, WORLD, (str(out),))
    return read_checks(out, WORLD)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_tp2_equals_tp1(tp_results, check, case):
    for rank, results in enumerate(tp_results):
        outcome = results.get(f"{check}[{case}]", "not run")
        assert outcome == "ok", f"rank {rank}, {check}[{case}]:\n{outcome}"


def test_heads_must_divide():
    model = CausalLM(CASES["llama"])
    with pytest.raises(ValueError, match=r"arch\.num_attention_heads divisible by 3"):
        shard_for_tp(model, rank=0, world=3)
    with pytest.raises(ValueError, match=r"arch\.num_key_value_heads divisible by 4"):
        shard_for_tp(model, rank=0, world=4)
    odd_mlp = CausalLM(ArchConfig(model_type="llama", vocab_size=96, **{**BASE, "intermediate_size": 111}))
    with pytest.raises(ValueError, match=r"arch\.intermediate_size"):
        shard_for_tp(odd_mlp, rank=0, world=2)
    assert shard_for_tp(model, rank=0, world=1) is model


def test_drafter_shards_without_a_group_and_refuses_what_it_cannot_cut():
    """`shard_drafter_for_tp` with an explicit place (no process group): each rank's layer holds its slice of the
    full drafter's weights, fc and the head's rows stay whole, a full state loads slice by slice and a state of
    another shape is refused; heads the world does not divide are refused by name, and a world of one is a no-op."""
    from tlt_rt.models.drafter import Drafter
    from tlt_rt.models.tensor_parallel import drafter_layer_bytes, replicated_state, shard_drafter_for_tp

    full = _build("llama-bias-vocab97")
    torch.manual_seed(2)
    drafter = Drafter(full.arch, full).eval()
    a, d = full.arch, full.arch.head_dim
    for rank in range(WORLD):
        cut = shard_drafter_for_tp(copy.deepcopy(drafter).bind(full), rank=rank, world=WORLD)
        at, mlp = cut.layers[0].self_attn, cut.layers[0].mlp
        hq = a.num_attention_heads // WORLD
        full_at = drafter.layers[0].self_attn
        assert torch.equal(at.q_proj.weight, full_at.q_proj.weight[rank * hq * d : (rank + 1) * hq * d])
        assert torch.equal(at.o_proj.weight, full_at.o_proj.weight[:, rank * hq * d : (rank + 1) * hq * d])
        inter = a.intermediate_size // WORLD
        assert torch.equal(
            mlp.down_proj.weight, drafter.layers[0].mlp.down_proj.weight[:, rank * inter : (rank + 1) * inter]
        )
        assert torch.equal(cut.fc.weight, drafter.fc.weight)
        layer = drafter.layers[0]
        whole_parts = [layer.post_attention_layernorm.weight, layer.self_attn.o_proj.bias, layer.mlp.down_proj.bias]
        kept = sum(t.numel() * t.element_size() for t in whole_parts)  # what every rank keeps whole
        assert drafter_layer_bytes(cut) == (drafter_layer_bytes(drafter) - kept) // WORLD + kept
        state = {k: v + 1 for k, v in drafter.state_dict().items()}
        cut.load_state_dict(state)
        assert torch.equal(
            at.q_proj.weight, state["layers.0.self_attn.q_proj.weight"][rank * hq * d : (rank + 1) * hq * d]
        )
        assert torch.equal(replicated_state(cut)["fc.weight"], state["fc.weight"])
        bad = dict(state, **{"layers.0.mlp.up_proj.weight": torch.zeros(3, a.hidden_size)})
        with pytest.raises(RuntimeError, match="up_proj"):
            cut.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"arch\.num_attention_heads divisible by 3"):
        shard_drafter_for_tp(copy.deepcopy(drafter).bind(full), rank=0, world=3)
    whole = copy.deepcopy(drafter).bind(full)
    assert shard_drafter_for_tp(whole, rank=0, world=1) is whole and getattr(whole, "tp", None) is None
