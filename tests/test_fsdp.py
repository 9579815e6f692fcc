"""FSDP2 learner on 2 gloo ranks against one process on the whole batch, and the engine weight handoff."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.llama import CausalLM
from tlt_rt.train.cluster.fsdp import (
    full_state_for_engine,
    load_into_engine,
    push_to_engine,
    reshard_for_tp,
    shard_learner,
    tp_split_dim,
)
from tlt_rt.train.rl.grpo import policy_loss, token_logprobs

from .dist_harness import spawn_ranks

WORLD = 2
STEPS = 2
BATCH, SEQ = 4, 10
LR, WD = 1e-2, 0.1


def _arch(tie: bool = False, bias: bool = False, kv_heads: int = 2) -> ArchConfig:
    return ArchConfig(
        model_type="qwen2" if bias else "llama", vocab_size=96, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
        tie_word_embeddings=tie, qkv_bias=bias,
    )  # fmt: skip


def _model(tie: bool) -> CausalLM:
    torch.manual_seed(1234)
    model = CausalLM(_arch(tie))
    with torch.no_grad():  # checkpoint-like scale: nn.Embedding's N(0, 1) as a tied head gives huge logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per step: ids [B, T+1], mask [B, T] (ragged responses), advantages [B]."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 96, (BATCH, SEQ + 1), generator=g)
        lengths = torch.randint(2, SEQ, (BATCH,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).float()
        adv = torch.randn(BATCH, generator=g)
        out.append((ids, mask, adv))
    return out


def _loss(model: torch.nn.Module, ids, mask, adv, num_tokens: float) -> torch.Tensor:
    logp = token_logprobs(model(ids[:, :-1]).logits, ids[:, 1:])
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, num_tokens=num_tokens)
    return loss


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # eps well above the default: Adam's first step is ~sign(grad), which would turn the float-summation
    # noise of near-zero gradients (~1e-10 on 5e-8) into lr-sized differences between the two runs
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=1e-3)


def _reference(tie: bool) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """One process, whole batch: the gradients of each step and the final state."""
    model = _model(tie)
    opt = _optimizer(model)
    grads = []
    for ids, mask, adv in _batches():
        _loss(model, ids, mask, adv, float(mask.sum())).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, {k: v.clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, out_dir: str) -> None:
    for tie in (False, True):
        model = shard_learner(_model(tie), mixed_precision=False)
        opt = _optimizer(model)
        grads = []
        for ids, mask, adv in _batches():
            part = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
            _loss(model, ids[part], mask[part], adv[part], float(mask.sum())).backward()
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        moments = [s["exp_avg"] for s in opt.state.values()]
        engine = CausalLM(_arch(tie))
        ptrs = {n: t.data_ptr() for n, t in engine.state_dict().items()}
        push_to_engine(model, engine)
        result = {
            "grads": grads,
            "state": full_state_for_engine(model),
            "state_bf16": full_state_for_engine(model, torch.bfloat16),
            "pushed": {k: v.clone() for k, v in engine.state_dict().items()},
            "ptrs_kept": all(t.data_ptr() == ptrs[n] for n, t in engine.state_dict().items()),
            "moments_sharded": all(type(m).__name__ == "DTensor" for m in moments),
            "local_numel": sum(m.to_local().numel() for m in moments),
            "full_numel": sum(m.numel() for m in moments),
        }
        torch.save(result, Path(out_dir) / f"tie{int(tie)}_rank{rank}.pt")
    # bf16 compute, fp32 master shards and fp32 reduction: the first step's gradients
    model = shard_learner(_model(True), mixed_precision=True)
    ids, mask, adv = _batches()[0]
    part = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    _loss(model, ids[part], mask[part], adv[part], float(mask.sum())).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    dtypes = {p.dtype for p in model.parameters()} | {g.dtype for g in grads.values()}
    torch.save({"grads": grads, "dtypes": dtypes}, Path(out_dir) / f"bf16_rank{rank}.pt")


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    spawn_ranks(_worker, WORLD, (str(out),), timeout_s=90)
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_fsdp_step_matches_single_process(fsdp_results, tie):
    ref_grads, ref_state = _reference(tie)
    for rank in range(WORLD):
        got = torch.load(fsdp_results / f"tie{int(tie)}_rank{rank}.pt")
        for step, (g_ref, g) in enumerate(zip(ref_grads, got["grads"], strict=True)):
            assert g.keys() == g_ref.keys()
            for n in g_ref:
                torch.testing.assert_close(g[n], g_ref[n], atol=1e-6, rtol=1e-5, msg=f"step {step} grad {n}")
        # (2) the gathered state is the single-process state after the steps, on every rank
        assert got["state"].keys() == ref_state.keys()
        for n, t in ref_state.items():
            assert not torch.equal(t, _model(tie).state_dict()[n]), f"{n} did not change"
            torch.testing.assert_close(got["state"][n], t, atol=1e-6, rtol=1e-5, msg=n)
            assert got["state_bf16"][n].dtype == torch.bfloat16
            torch.testing.assert_close(got["state_bf16"][n], got["state"][n].bfloat16(), atol=0, rtol=0, msg=n)
            torch.testing.assert_close(got["pushed"][n], t, atol=1e-6, rtol=1e-5, msg=n)
        assert got["ptrs_kept"]
        # optimizer moments live sharded: each rank holds about half
        assert got["moments_sharded"]
        assert got["local_numel"] < 0.6 * got["full_numel"]


def test_fsdp_bf16_compute_close_to_fp32(fsdp_results):
    ref_grads, _ = _reference(True)
    got = torch.load(fsdp_results / "bf16_rank0.pt")
    assert got["dtypes"] == {torch.float32}  # master weights and reduced gradients stay fp32
    for n, g in ref_grads[0].items():
        rel = (got["grads"][n] - g).norm() / g.norm()
        assert rel < 0.05, f"{n}: bf16 gradient off by {rel:.3f} (relative norm)"


@pytest.mark.parametrize("world,kv_heads", [(1, 2), (2, 2), (4, 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_reshard_for_tp_round_trip(world, kv_heads, bias):
    arch = _arch(bias=bias, kv_heads=kv_heads)
    state = CausalLM(arch).state_dict()
    before = {k: v.clone() for k, v in state.items()}
    parts = [reshard_for_tp(state, r, world, arch) for r in range(world)]
    for name, full in state.items():
        dim = tp_split_dim(name)
        if dim is None:
            assert all(p[name] is full for p in parts), name
            continue
        assert all(p[name].shape[dim] == full.shape[dim] // world for p in parts), name
        torch.testing.assert_close(torch.cat([p[name] for p in parts], dim=dim), full, atol=0, rtol=0, msg=name)
    assert all(torch.equal(state[k], before[k]) for k in state)  # pure


def test_reshard_for_tp_layout():
    arch = _arch()
    state = CausalLM(arch).state_dict()
    part = reshard_for_tp(state, 1, 2, arch)
    d = arch.head_dim
    q = state["model.layers.0.self_attn.q_proj.weight"]  # [heads * d, hidden]: rank 1 has heads 2, 3
    torch.testing.assert_close(part["model.layers.0.self_attn.q_proj.weight"], q[2 * d :])
    k = state["model.layers.0.self_attn.k_proj.weight"]  # 2 KV heads: rank 1 has KV head 1
    torch.testing.assert_close(part["model.layers.0.self_attn.k_proj.weight"], k[d:])
    o = state["model.layers.0.self_attn.o_proj.weight"]  # [hidden, heads * d]: the columns of heads 2, 3
    torch.testing.assert_close(part["model.layers.0.self_attn.o_proj.weight"], o[:, 2 * d :])
    assert part["lm_head.weight"].shape == (arch.vocab_size // 2, arch.hidden_size)


def test_reshard_for_tp_rejects_bad_worlds():
    arch = _arch()
    state = CausalLM(arch).state_dict()
    with pytest.raises(ValueError, match="num_key_value_heads"):
        reshard_for_tp(state, 0, 4, arch)  # 4 query heads but 2 KV heads
    with pytest.raises(ValueError, match="outside"):
        reshard_for_tp(state, 2, 2)
    with pytest.raises(KeyError, match="no tensor-parallel rule"):
        reshard_for_tp({"model.mystery.weight": torch.zeros(2)}, 0, 1)


def test_load_into_engine_keeps_storage():
    engine = CausalLM(_arch(tie=True)).bfloat16()
    ptrs = {n: t.data_ptr() for n, t in engine.state_dict().items()}
    src = CausalLM(_arch(tie=True)).state_dict()  # fp32: the copy converts
    load_into_engine(engine, src)
    for n, t in engine.state_dict().items():
        assert t.data_ptr() == ptrs[n], n
        torch.testing.assert_close(t, src[n].bfloat16(), atol=0, rtol=0, msg=n)
    assert engine.lm_head.weight is engine.model.embed_tokens.weight
    with pytest.raises(KeyError, match="missing"):
        load_into_engine(engine, {k: v for k, v in src.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match="shape"):
        load_into_engine(engine, {**src, "model.norm.weight": torch.zeros(3)})
