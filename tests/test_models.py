"""Our Llama-family implementation against transformers, and the paged forwards against the dense one."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tlt_rt.models import AttnMetadata, UnsupportedModelError, load_target

SMALL = dict(
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=256,
)

CASES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, rope_theta=10000.0)),
    "llama-tied": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True)),
    "llama3-rope": lambda: LlamaForCausalLM(
        LlamaConfig(
            **SMALL,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    ),
    "llama-linear-rope-bias": lambda: LlamaForCausalLM(
        LlamaConfig(**SMALL, attention_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
    ),
    "qwen2-bias": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
    "qwen2-tied-mha": lambda: Qwen2ForCausalLM(
        Qwen2Config(**{**SMALL, "num_key_value_heads": 4}, tie_word_embeddings=True)
    ),
}


def _randomize(hf):
    # transformers initialises biases to zero; random values make the bias paths matter
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(1)
    hf = _randomize(CASES[request.param]()).eval()
    path = tmp_path_factory.mktemp(request.param)
    # a small shard size makes the sharded (index.json) layout
    hf.save_pretrained(path, max_shard_size="20KB" if "qwen2" in request.param else "1GB")
    return hf, path


def _hf_outputs(hf, ids):
    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda m, i, o: captured.update(h=o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        logits = hf(ids).logits
    hook.remove()
    return logits, captured["h"]


def test_dense_forward_matches_transformers(checkpoint):
    hf, path = checkpoint
    ours = load_target(path, dtype="float32")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40))
    ref_logits, ref_hidden = _hf_outputs(hf, ids)
    with torch.no_grad():
        out = ours(ids)
    torch.testing.assert_close(out.hidden, ref_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits, ref_logits, atol=1e-5, rtol=1e-5)


def test_gradients_flow(checkpoint):
    _, path = checkpoint
    ours = load_target(path, dtype="float32").train()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    out = ours(ids)
    out.logits.log_softmax(-1).mean().backward()
    grads = [p.grad for p in ours.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert ours.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


class Pager:
    """Minimal block bookkeeping for tests: each sequence gets a random set of blocks."""

    def __init__(self, num_seqs: int, max_len: int, block_size: int, gen: torch.Generator):
        self.bs = block_size
        per_seq = -(-max_len // block_size)
        perm = torch.randperm(num_seqs * per_seq + 3, generator=gen)[: num_seqs * per_seq]
        self.tables = perm.view(num_seqs, per_seq).int()
        self.num_blocks = num_seqs * per_seq + 3

    def slots(self, seq: int, positions: torch.Tensor) -> torch.Tensor:
        return self.tables[seq, positions // self.bs].long() * self.bs + positions % self.bs


def _meta(pager, seqs, q_lens, seq_lens, slots, mode, tree_mask=None):
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return AttnMetadata(
        mode=mode,
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=pager.tables[seqs],
        slot_mapping=torch.cat(slots),
        max_q_len=max(q_lens),
        tree_mask=tree_mask,
    )


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_chunked_prefill_and_decode_match_dense(checkpoint, fused):
    _, path = checkpoint
    model = load_target(path, dtype="float32")
    if fused:  # q/k/v and gate/up as single matmuls in the paged forward; the dense one stays separate
        assert model.fuse_projections() == 2 * SMALL["num_hidden_layers"]
    gen = torch.Generator().manual_seed(3)
    lens = [23, 9]
    seqs = [torch.randint(0, SMALL["vocab_size"], (n,), generator=gen) for n in lens]
    pager = Pager(2, 40, 8, gen)
    cache = model.make_cache(pager.num_blocks, 8)
    got = [[], []]
    with torch.no_grad():
        # prefill in two chunks of different sizes per sequence
        done = [0, 0]
        for chunk in ([10, 4], [13, 5]):
            ids, pos, slots = [], [], []
            for b, c in enumerate(chunk):
                p = torch.arange(done[b], done[b] + c)
                ids.append(seqs[b][p]), pos.append(p), slots.append(pager.slots(b, p))
                done[b] += c
            meta = _meta(pager, [0, 1], chunk, list(done), slots, "prefill")
            out = model.forward_paged(torch.cat(ids), torch.cat(pos), cache, meta)
            split = out.logits.split(chunk)
            for b in range(2):
                got[b].append(split[b])
        # then three decode steps with fresh tokens
        for _ in range(3):
            new = torch.randint(0, SMALL["vocab_size"], (2,), generator=gen)
            pos = torch.tensor([len(seqs[0]), len(seqs[1])])
            slots = [pager.slots(b, pos[b : b + 1]) for b in range(2)]
            seqs = [torch.cat([s, new[b : b + 1]]) for b, s in enumerate(seqs)]
            meta = _meta(pager, [0, 1], [1, 1], [len(s) for s in seqs], slots, "decode")
            out = model.forward_paged(new, pos, cache, meta)
            for b in range(2):
                got[b].append(out.logits[b : b + 1])
        for b in range(2):
            dense = model(seqs[b][None]).logits[0]
            torch.testing.assert_close(torch.cat(got[b]), dense, atol=1e-5, rtol=1e-5)


def _random_parents(t: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)]


def test_tree_verify_matches_dense_paths(checkpoint):
    _, path = checkpoint
    model = load_target(path, dtype="float32")
    gen = torch.Generator().manual_seed(5)
    t, prefixes = 7, [11, 6]
    pager = Pager(2, 32, 4, gen)
    cache = model.make_cache(pager.num_blocks, 4)
    prompts = [torch.randint(0, SMALL["vocab_size"], (n,), generator=gen) for n in prefixes]
    with torch.no_grad():
        slots = [pager.slots(b, torch.arange(n)) for b, n in enumerate(prefixes)]
        meta = _meta(pager, [0, 1], prefixes, prefixes, slots, "prefill")
        model.forward_paged(torch.cat(prompts), torch.cat([torch.arange(n) for n in prefixes]), cache, meta)
        parents = [_random_parents(t, gen) for _ in range(2)]
        tokens = torch.randint(0, SMALL["vocab_size"], (2, t), generator=gen)
        depth = torch.zeros(2, t, dtype=torch.long)
        mask = torch.zeros(2, t, t, dtype=torch.bool)
        for b in range(2):
            for i in range(t):
                j = i
                while j >= 0:
                    mask[b, i, j] = True
                    j = parents[b][j]
                depth[b, i] = mask[b, i].sum() - 1
        positions = torch.tensor(prefixes).view(2, 1) + depth
        slots = [pager.slots(b, torch.arange(prefixes[b], prefixes[b] + t)) for b in range(2)]
        meta = _meta(pager, [0, 1], [t, t], [n + t for n in prefixes], slots, "verify", tree_mask=mask)
        out = model.forward_paged(tokens.flatten(), positions.flatten(), cache, meta)
        logits = out.logits.view(2, t, -1)
        for b in range(2):
            for i in range(t):
                path = mask[b, i].nonzero().flatten()  # ancestors in topological order, then i
                seq = torch.cat([prompts[b], tokens[b, path]])
                dense = model(seq[None]).logits[0, -1]
                torch.testing.assert_close(logits[b, i], dense, atol=1e-5, rtol=1e-5)


def test_load_errors_name_the_file_and_tensor(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = checkpoint
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(tmp_path / "empty")
    cfg = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_target(bad)
    # a shape mismatch names the file and the tensor
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 120}))
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(f))
    save_file(state, str(wrong / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors.*mlp\.(gate|up|down)_proj\.weight"):
        load_target(wrong)
    del state["model.norm.weight"]
    (wrong / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(wrong / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.norm\.weight"):
        load_target(wrong)


def test_tree_window_wider_than_the_new_tokens(checkpoint):
    """A second tree level whose nodes see ancestors written by an earlier level (the drafter's case)."""
    _, path = checkpoint
    model = load_target(path, dtype="float32")
    gen = torch.Generator().manual_seed(9)
    prefix, t1, t2 = 6, 3, 4
    pager = Pager(1, 32, 4, gen)
    cache = model.make_cache(pager.num_blocks, 4)
    prompt = torch.randint(0, SMALL["vocab_size"], (prefix,), generator=gen)
    toks1 = torch.randint(0, SMALL["vocab_size"], (t1,), generator=gen)
    toks2 = torch.randint(0, SMALL["vocab_size"], (t2,), generator=gen)
    parents2 = torch.randint(0, t1, (t2,), generator=gen)  # each level-2 node hangs from a level-1 node
    with torch.no_grad():
        meta = _meta(pager, [0], [prefix], [prefix], [pager.slots(0, torch.arange(prefix))], "prefill")
        model.forward_paged(prompt, torch.arange(prefix), cache, meta)
        eye1 = torch.eye(t1, dtype=torch.bool)[None]
        pos1 = torch.arange(prefix, prefix + t1)
        meta = _meta(pager, [0], [t1], [prefix + t1], [pager.slots(0, pos1)], "verify", tree_mask=eye1)
        model.forward_paged(toks1, torch.full((t1,), prefix), cache, meta)
        mask = torch.zeros(1, t2, t1 + t2, dtype=torch.bool)
        mask[0, torch.arange(t2), parents2] = True
        mask[0, torch.arange(t2), t1 + torch.arange(t2)] = True
        pos2 = torch.arange(prefix + t1, prefix + t1 + t2)
        meta = _meta(pager, [0], [t2], [prefix + t1 + t2], [pager.slots(0, pos2)], "verify", tree_mask=mask)
        out = model.forward_paged(toks2, torch.full((t2,), prefix + 1), cache, meta)
        for i in range(t2):
            seq = torch.cat([prompt, toks1[parents2[i]].view(1), toks2[i].view(1)])
            torch.testing.assert_close(out.logits[i], model(seq[None]).logits[0, -1], atol=1e-5, rtol=1e-5)


def test_fused_projections_follow_weight_updates(checkpoint):
    _, path = checkpoint
    model = load_target(path, dtype="float32")
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    model.fuse_projections()
    # checkpoints see the same parameters under the same names
    assert keys.keys() == model.state_dict().keys()
    assert all(torch.equal(keys[k], v) for k, v in model.state_dict().items())
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(3, SMALL["hidden_size"])
    with torch.no_grad():
        q, k, v = attn.fused(x)
        torch.testing.assert_close(k, attn.k_proj(x))
        # an in-place update (as a weight sync does) reaches the fused matmul
        attn.k_proj.weight.copy_(torch.randn_like(attn.k_proj.weight))
        mlp.up_proj.weight.mul_(2.0)
        assert attn.fused.intact() and mlp.fused.intact()
        torch.testing.assert_close(attn.fused(x)[1], attn.k_proj(x))
        torch.testing.assert_close(mlp(x), mlp.down_proj(mlp.glue.swiglu(mlp.gate_proj(x), mlp.up_proj(x))))
        # a re-allocated weight breaks the sharing: the layer notices and runs the separate matmuls
        attn.v_proj.weight.data = attn.v_proj.weight.data.clone() + 1.0
        assert not attn.fused.intact()
        ref = attn.v_proj(x).view(3, -1, attn.head_dim)
        pos = torch.arange(3)
        _, _, got_v = attn._qkv(x, pos, model.rotary)
        torch.testing.assert_close(got_v, ref)
        assert attn.fuse() and attn.fused.intact()  # fusing again picks up the new weight
        torch.testing.assert_close(attn.fused(x)[2], attn.v_proj(x))
    # with gradients wanted the separate layers run, so training still reaches every parameter
    model.train()
    model(torch.randint(0, SMALL["vocab_size"], (1, 6))).logits.sum().backward()
    assert attn.q_proj.weight.grad is not None and mlp.gate_proj.weight.grad is not None


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mlp_bias", [False, True])
def test_mlp_forward_add_is_the_residual_plus_the_mlp(fused, mlp_bias):
    """`MLP.forward_add` (the residual added by the down projection's matmul, or on its own with a bias)
    gives residual + mlp(x)."""
    from tlt_rt.models.arch import ArchConfig
    from tlt_rt.models.llama import MLP

    torch.manual_seed(0)
    arch = ArchConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, mlp_bias=mlp_bias)  # fmt: skip
    mlp = MLP(arch)
    assert not fused or mlp.fuse()
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    with torch.no_grad():
        want = res + mlp(x)
        torch.testing.assert_close(mlp.forward_add(x, res.clone()), want)
    got = mlp.forward_add(x, res)  # with gradients: out of place, the residual kept
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert mlp.down_proj.weight.grad is not None


def test_casting_a_model_keeps_its_rotary_frequencies_fp32():
    """model.to(bfloat16) casts every buffer; the rotary frequencies come back fp32 and exact (the fused
    rotary + cache-write kernel takes only fp32 ones, and bf16 would round them)."""
    from tlt_rt.models.arch import ArchConfig, rope_inv_freq
    from tlt_rt.models.llama import CausalLM

    arch = ArchConfig(model_type="qwen2", vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, qkv_bias=True)  # fmt: skip
    model = CausalLM(arch).to(torch.bfloat16)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary.inv_freq, rope_inv_freq(arch))
    assert not torch.equal(rope_inv_freq(arch).bfloat16().float(), rope_inv_freq(arch))  # what a cast loses
