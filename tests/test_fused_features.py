"""EAGLE-3's fused features: the target hands several layers' outputs to the drafter, which fuses them."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.drafter import tiny_arch
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.eagle_export import ExportError, export_eagle, load_eagle
from tlt_rt.models.llama import CausalLM
from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.trainer import DrafterTrainer
from tlt_rt.train.drafter.warmup import default_feature_layers, generate_data

ARCH = tiny_arch("qwen2", num_hidden_layers=4, max_position_embeddings=512, eos_token_ids=(11,))
H = ARCH.hidden_size
LAYERS = (0, 2)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 1], [3], [2, 2, 2, 2, 2]]


def target(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    t = CausalLM(ARCH).eval()
    with torch.no_grad():
        t.lm_head.weight.mul_(4.0)  # peaked answers: drafts get accepted
    return t


def fused(t: CausalLM, seed: int = 1, identity: bool = False) -> Drafter:
    torch.manual_seed(seed)
    d = Drafter(ARCH, t, feature_layers=LAYERS).eval()
    if not identity:
        with torch.no_grad():
            d.fuse.weight.add_(torch.randn_like(d.fuse.weight) * 0.05)
    return d


def test_the_target_hands_over_its_fused_layers():
    t = target()
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        plain = t(ids)
        t.set_feature_layers([2, 0])
        out = t(ids)
        pos = torch.arange(ids.shape[1])[None]
        x, taps = t.model.embed_tokens(ids), []
        for layer in t.model.layers:
            x = layer(x, pos, t.rotary)
            taps.append(x)
    assert t.feature_layers == LAYERS and t.feature_size == 3 * H and out.hidden.shape == (1, 6, 3 * H)
    assert torch.equal(out.logits, plain.logits)
    torch.testing.assert_close(out.hidden[..., -H:], plain.hidden)
    torch.testing.assert_close(out.hidden[..., :H], taps[0])
    torch.testing.assert_close(out.hidden[..., H : 2 * H], taps[2])
    for bad in ([3], [-1], [1, 1]):  # the last layer is always handed over; layers are distinct
        with pytest.raises(ValueError, match="feature_layers"):
            t.set_feature_layers(bad)


def test_the_engine_returns_the_fused_hidden_of_the_dense_pass():
    t = target()
    eng = Engine(t, drafter=fused(t), speculative="on", strategies=("3_2_4",), block_size=4)
    assert t.feature_layers == LAYERS  # the engine takes them from its drafter
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=9, stop_token_ids=[], return_hidden=True, seed=3)
    for o in eng.generate([[1, 2, 3]], params):
        with torch.no_grad():
            dense = t(torch.tensor([[1, 2, 3] + o.token_ids]))
        assert o.hidden.shape == (3 + len(o.token_ids) - 1, 3 * H)
        torch.testing.assert_close(o.hidden, dense.hidden[0, :-1], atol=1e-4, rtol=1e-4)


def test_a_fresh_fused_drafter_starts_where_the_one_layer_drafter_is():
    t = target()
    torch.manual_seed(1)
    one = Drafter(ARCH, t).eval()
    d = fused(t, identity=True)
    d.load_state_dict({**one.state_dict(), "fuse.weight": d.fuse.weight.detach()})
    hidden = torch.randn(5, 3 * H) * 30  # pre-norm scales
    torch.testing.assert_close(d.features(hidden), one.features(hidden[:, -H:]))
    torch.testing.assert_close(d.target_features(hidden), one.features(hidden[:, -H:]))
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    with torch.no_grad():
        a = d(ids, d.features(hidden)[None])
        b = one(ids, one.features(hidden[:, -H:])[None])
    torch.testing.assert_close(a.logits, b.logits)


@pytest.mark.parametrize("speculative", ["on", "auto"])
def test_greedy_with_a_fused_drafter_is_plain_greedy(speculative):
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    off = Engine(target(), speculative="off", block_size=4).generate(PROMPTS, params)
    t = target()
    eng = Engine(t, drafter=fused(t), speculative=speculative, strategies=("3_3_8", "4_2_6"), block_size=4)
    got = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in off]
    if speculative == "on":
        assert eng.stats()["sd_steps"] > 0


def test_training_moves_the_fuse_and_the_checkpoint_keeps_it(tmp_path):
    t = target()
    d = fused(t).train()
    eng = Engine(t, drafter=fused(t), speculative="on", strategies=("3_2_4",), block_size=4)
    buf = DrafterBuffer(max_steps=1)
    generate_data(eng, PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=0), buf)
    before = d.fuse.weight.detach().clone()
    trainer = DrafterTrainer(d, buf, lr=1e-2, batch_tokens=64, unroll=2, seed=0)
    for _ in range(3):
        m = trainer.step()
    assert torch.isfinite(torch.tensor(m["loss"]))
    assert not torch.equal(d.fuse.weight.detach(), before)  # its input features carried gradients
    trainer.save_checkpoint(tmp_path / "ckpt", async_=False)
    info = json.loads((tmp_path / "ckpt" / "info.json").read_text())
    assert info["tlt_feature_layers"] == list(LAYERS)
    back = load_eagle(tmp_path / "ckpt", t, dtype=torch.float32)
    assert back.feature_layers == LAYERS
    torch.testing.assert_close(back.fuse.weight, d.fuse.weight.detach())


def test_a_fused_drafter_exports_for_tlt_rt_only(tmp_path):
    t = target()
    d = fused(t)
    folder = export_eagle(d, tmp_path / "eagle", dtype=torch.float32)
    assert json.loads((folder / "config.json").read_text())["tlt_feature_layers"] == list(LAYERS)
    back = load_eagle(folder, t, dtype=torch.float32)
    assert back.feature_layers == LAYERS
    torch.testing.assert_close(back.fuse.weight, d.fuse.weight)
    with pytest.raises(ExportError, match="EAGLE-3"):
        export_eagle(d, tmp_path / "vllm", format="vllm")
    with pytest.raises(ValueError, match="feature_layers"):
        Drafter(ARCH, t, feature_layers=(3,))


def test_default_feature_layers():
    assert default_feature_layers(28) == (2, 14)
    assert default_feature_layers(4) == (2,)
    assert default_feature_layers(2) == ()
