"""The drafter: paged forward against the dense one, feeding itself back, shared modules, packing, export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.helpers.drafter import H, Pager, V, rows, tiny_pair
from tlt_rt.models.drafter import draft_vocab_from_counts, packed_causal_attention, xformers_works
from tlt_rt.models.eagle_export import export_eagle, load_eagle

TOL = dict(atol=1e-4, rtol=1e-4)  # fp32, different reduction orders


@pytest.fixture(params=["llama", "qwen2"])
def pair(request):
    return tiny_pair(request.param)


def test_shared_modules_are_the_targets_and_get_no_grads(pair):
    target, drafter = pair
    assert drafter.embed_tokens is target.model.embed_tokens
    assert drafter.norm is target.model.norm and drafter.lm_head is target.lm_head
    keys = set(drafter.state_dict())
    assert all(k.startswith(("fc.", "layers.0.")) for k in keys), keys
    assert "layers.0.input_layernorm.weight" not in keys
    assert {id(p) for p in drafter.parameters()}.isdisjoint({id(p) for p in target.parameters()})
    ids, feats = rows(target, drafter.train(), 9, torch.Generator().manual_seed(0))
    out = drafter(ids[None], feats[None])
    (out.logits.logsumexp(-1).mean() + out.hidden.pow(2).mean()).backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())


def test_paged_prefill_and_decode_match_dense(pair):
    target, drafter = pair
    gen = torch.Generator().manual_seed(3)
    data = [rows(target, drafter, n, gen) for n in (17, 9)]
    pager = Pager(2, 32, 4, gen)
    cache = drafter.make_cache(pager.num_blocks, 4)
    assert cache.num_layers == 1
    got: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    with torch.no_grad():
        for chunk in ([10, 4], [4, 3], [1, 1], [1, 1]):  # chunked prefill, then decode steps
            ids, hid, pos, slots = [], [], [], []
            for b in range(2):
                p = torch.arange(done[b], done[b] + chunk[b])
                ids.append(data[b][0][p]), hid.append(data[b][1][p]), pos.append(p), slots.append(pager.slots(b, p))
                done[b] += chunk[b]
            mode = "decode" if chunk == [1, 1] else "prefill"
            out = drafter.forward_paged(
                torch.cat(ids), torch.cat(hid), torch.cat(pos), cache, pager.meta(chunk, done, slots, mode)
            )
            for b, lg, hd in zip(range(2), out.logits.split(chunk), out.hidden.split(chunk), strict=True):
                got[b].append(torch.cat([lg, hd], -1))
        for b in range(2):
            dense = drafter(data[b][0][None], data[b][1][None])
            want = torch.cat([dense.logits[0], dense.hidden[0]], -1)[: done[b]]
            torch.testing.assert_close(torch.cat(got[b]), want, **TOL)


def test_feeding_its_own_hidden_back_matches_dense(pair):
    """Multi-step drafting: each step's token is the argmax and its feature the drafter's own output."""
    target, drafter = pair
    gen = torch.Generator().manual_seed(4)
    ids, feats = rows(target, drafter, 11, gen)
    pager = Pager(1, 32, 4, gen)
    cache = drafter.make_cache(pager.num_blocks, 4)
    n = ids.shape[0]
    with torch.no_grad():
        p = torch.arange(n)
        out = drafter.forward_paged(ids, feats, p, cache, pager.meta([n], [n], [pager.slots(0, p)], "prefill"))
        tok, hid = out.logits[-1:].argmax(-1), out.hidden[-1:]
        for step in range(4):
            p = torch.tensor([n + step])
            ids, feats = torch.cat([ids, tok]), torch.cat([feats, hid])
            out = drafter.forward_paged(
                tok, hid, p, cache, pager.meta([1], [n + step + 1], [pager.slots(0, p)], "decode")
            )
            dense = drafter(ids[None], feats[None])
            torch.testing.assert_close(out.logits[0], dense.logits[0, -1], **TOL)
            torch.testing.assert_close(out.hidden[0], dense.hidden[0, -1], **TOL)
            tok, hid = out.logits.argmax(-1), out.hidden


def test_tree_verify_matches_dense_paths(pair):
    target, drafter = pair
    gen = torch.Generator().manual_seed(5)
    t, prefixes = 6, [8, 5]
    data = [rows(target, drafter, n, gen) for n in prefixes]
    pager = Pager(2, 32, 4, gen)
    cache = drafter.make_cache(pager.num_blocks, 4)
    with torch.no_grad():
        slots = [pager.slots(b, torch.arange(n)) for b, n in enumerate(prefixes)]
        meta = pager.meta(prefixes, prefixes, slots, "prefill")
        drafter.forward_paged(
            torch.cat([d[0] for d in data]),
            torch.cat([d[1] for d in data]),
            torch.cat([torch.arange(n) for n in prefixes]),
            cache,
            meta,
        )
        parents = [[-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)] for _ in range(2)]
        tokens = torch.randint(0, V, (2, t), generator=gen)
        tfeat = torch.randn(2, t, H, generator=gen)
        mask = torch.zeros(2, t, t, dtype=torch.bool)
        for b in range(2):
            for i in range(t):
                j = i
                while j >= 0:
                    mask[b, i, j], j = True, parents[b][j]
        positions = torch.tensor(prefixes).view(2, 1) + mask.sum(-1) - 1
        slots = [pager.slots(b, torch.arange(prefixes[b], prefixes[b] + t)) for b in range(2)]
        meta = pager.meta([t, t], [n + t for n in prefixes], slots, "verify", tree_mask=mask)
        out = drafter.forward_paged(tokens.flatten(), tfeat.flatten(0, 1), positions.flatten(), cache, meta)
        logits = out.logits.view(2, t, -1)
        for b in range(2):
            for i in range(t):
                path = mask[b, i].nonzero().flatten()
                dense = drafter(
                    torch.cat([data[b][0], tokens[b, path]])[None], torch.cat([data[b][1], tfeat[b, path]])[None]
                )
                torch.testing.assert_close(logits[b, i], dense.logits[0, -1], **TOL)


def test_packed_rows_equal_unpacked_samples():
    target, drafter = tiny_pair()
    gen = torch.Generator().manual_seed(6)
    data = [rows(target, drafter, n, gen) for n in (7, 1, 12, 5)]
    ids = torch.cat([d[0] for d in data])[None]
    feats = torch.cat([d[1] for d in data])[None]
    pos = torch.cat([torch.arange(d[0].shape[0]) for d in data])[None]
    seg = torch.cat([torch.full((d[0].shape[0],), k) for k, d in enumerate(data)])[None]
    with torch.no_grad():
        packed = drafter(ids, feats, pos, seg)
        off = 0
        for d in data:
            one = drafter(d[0][None], d[1][None])
            n = d[0].shape[0]
            torch.testing.assert_close(packed.hidden[0, off : off + n], one.hidden[0], **TOL)
            torch.testing.assert_close(packed.logits[0, off : off + n], one.logits[0], **TOL)
            off += n


@pytest.mark.skipif(
    not xformers_works("cuda" if torch.cuda.is_available() else "cpu"), reason="xformers kernels do not run here"
)
def test_xformers_packed_attention_equals_ours():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(2, 24, 4, 16, device=dev)
    k, v = torch.randn(2, 24, 2, 16, device=dev), torch.randn(2, 24, 2, 16, device=dev)
    seg = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [3] * 20 + [-1] * 4], device=dev)
    ours = packed_causal_attention(q, k, v, 0.25, seg, "sdpa")
    torch.testing.assert_close(packed_causal_attention(q, k, v, 0.25, seg, "xformers"), ours, atol=2e-4, rtol=2e-4)


def test_xformers_probe_never_raises():
    assert xformers_works("cpu") in (True, False)
    with pytest.raises(ValueError, match="impl"):
        packed_causal_attention(
            torch.zeros(1, 2, 1, 4),
            torch.zeros(1, 2, 1, 4),
            torch.zeros(1, 2, 1, 4),
            1.0,
            torch.zeros(1, 2, dtype=torch.long),
            "flash",
        )


def test_reduced_draft_vocab():
    target, drafter = tiny_pair()
    counts = torch.randint(0, 50, (V,))
    d2t = draft_vocab_from_counts(counts, 20)
    assert torch.equal(counts[d2t].sort(descending=True).values, counts.sort(descending=True).values[:20])
    ids, feats = rows(target, drafter, 6, torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = drafter(ids[None], feats[None]).logits[0]
        drafter.set_draft_vocab(d2t)
        assert drafter.draft_vocab_size == 20 and "draft_head" not in drafter.state_dict()
        small = drafter(ids[None], feats[None]).logits[0]
        torch.testing.assert_close(small, full[:, d2t])
        pager = Pager(1, 16, 4, torch.Generator().manual_seed(0))
        cache = drafter.make_cache(pager.num_blocks, 4)
        p = torch.arange(6)
        out = drafter.forward_paged(ids, feats, p, cache, pager.meta([6], [6], [pager.slots(0, p)], "prefill"))
    assert out.logits.shape == (6, V) and torch.isinf(out.logits).sum() == 6 * (V - 20)
    torch.testing.assert_close(out.logits[:, d2t], small)
    with pytest.raises(ValueError, match="distinct"):
        drafter.set_draft_vocab(torch.tensor([1, 1]))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_eagle_export_round_trip(model_type, tmp_path):
    target, drafter = tiny_pair(model_type)
    folder = export_eagle(drafter, tmp_path / "eagle")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}[model_type]]
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == H and cfg["vocab_size"] == V
    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
        assert st.get_tensor("fc.weight").shape == (H, 2 * H)
    want = {"fc.weight", "fc.bias", "embed_tokens.weight", "layers.0.post_attention_layernorm.weight"}
    want |= {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    want |= {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    if model_type == "qwen2":
        want |= {f"layers.0.self_attn.{p}_proj.bias" for p in "qkv"}
    assert names == want
    loaded = load_eagle(folder, target)
    ids, feats = rows(target, drafter, 9, torch.Generator().manual_seed(8))
    with torch.no_grad():
        a, b = drafter(ids[None], feats[None]), loaded(ids[None], feats[None])
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
    assert loaded.embed_tokens is target.model.embed_tokens


def test_eagle_export_with_draft_vocab_and_bad_folders(tmp_path):
    target, drafter = tiny_pair()
    drafter.set_draft_vocab(torch.arange(30, 60))
    folder = export_eagle(drafter, tmp_path / "eagle", include_embed=False)
    assert torch.equal(torch.load(folder / "hot_token_map.pt"), torch.arange(30, 60))
    loaded = load_eagle(folder, target)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.draft_head, drafter.draft_head)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_eagle(tmp_path, target)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="EAGLE"):
        load_eagle(folder, target)
    other, _ = tiny_pair(hidden_size=32, head_dim=8)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        load_eagle(folder, other)
