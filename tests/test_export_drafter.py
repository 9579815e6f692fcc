"""The drafter after RL as a deliverable: export for SGLang and vLLM, and drafter.path from a run's checkpoint.

No serving engine is installed here, so each engine's loader rules are written down below from its source
(read with the repository search tools) and the exported folders are checked against them:

SGLang, python/sglang/srt/models/llama_eagle.py (034b3be) and qwen2_eagle.py (005da00):
  EntryClass LlamaForCausalLMEagle / Qwen2ForCausalLMEagle; load_weights prefixes "model." to every name without
  "lm_head" (lm_head names are skipped) and hands it to the family's loader, which stacks q/k/v into qkv_proj
  and gate/up into gate_up_proj; the model registers embed_tokens, fc (nn.Linear(2H, H), bias on) and layers
  without layer 0's input_layernorm (deleted). --speculative-token-map: torch.load(weights_only=True) of the
  hot token ids, turned into an int64 tensor (eagle_worker.py load_token_map).
vLLM, vllm/model_executor/models/llama_eagle.py (newest stored version) and transformers_utils/configs/eagle.py:
  EAGLEConfig(method="eagle") keeps an architecture that starts with "Eagle", else prefixes it; the registry
  maps EagleLlamaForCausalLM (llama_eagle), no other EAGLE-1 family we train; fc = nn.Linear(2H, H, bias=False);
  load_weights prefixes "model." (not lm_head), stacks q/k/v and gate/up, skips embed_tokens when PP is off
  and looks every other name up in its parameters (an unknown name fails); its Llama layer takes q/k/v's bias
  from `qkv_bias` when present and o_proj's from `attention_bias`.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.helpers.drafter import H, V, rows, tiny_pair
from tlt_rt.export_drafter import main as export_main
from tlt_rt.models import save_target
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.eagle_export import ExportError, export_eagle, find_drafter, load_eagle
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.trainer import DrafterTrainer

SGLANG_ARCHS = {"LlamaForCausalLMEagle", "Qwen2ForCausalLMEagle"}
VLLM_REGISTRY = {"EagleLlamaForCausalLM"}  # EAGLE-1 draft models of the families tlt_rt trains
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj"}
STACKED[".up_proj"] = ".gate_up_proj"


def engine_params(engine: str, cfg: dict) -> set[str]:
    """Parameter names the engine's EAGLE draft model registers for this config (the rules above)."""
    layer = "model.layers.0."
    names = {"model.embed_tokens.weight", "model.fc.weight", layer + "post_attention_layernorm.weight"}
    names |= {layer + "self_attn.qkv_proj.weight", layer + "self_attn.o_proj.weight"}
    names |= {layer + "mlp.gate_up_proj.weight", layer + "mlp.down_proj.weight"}
    if engine == "sglang":
        names.add("model.fc.bias")
        qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
        o_bias = cfg["model_type"] == "llama" and cfg.get("attention_bias", False)
    else:
        o_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = bool(cfg.get("qkv_bias", o_bias))
    if qkv_bias:
        names.add(layer + "self_attn.qkv_proj.bias")
    if o_bias:
        names.add(layer + "self_attn.o_proj.bias")
    return names


def engine_load(engine: str, folder) -> set[str]:
    """What the engine's load_weights does with the folder's tensor names; raises where it would fail."""
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1
    if engine == "sglang":
        assert set(cfg["architectures"]) <= SGLANG_ARCHS, cfg["architectures"]
    else:  # EAGLEConfig's renaming, then the registry
        archs = [a if a.startswith("Eagle") else f"Eagle{a}" for a in cfg["architectures"]]
        assert set(archs) <= VLLM_REGISTRY, archs
        assert cfg["model_type"] == "llama"
    params = engine_params(engine, cfg)
    loaded = set()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        for name in st.keys():
            assert not name.startswith("model."), name  # the loaders add the prefix themselves
            if "lm_head" in name:
                continue
            full = "model." + name
            for old, new in STACKED.items():
                full = full.replace(old, new)
            if engine == "vllm" and "embed_tokens." in full:
                continue
            if full not in params:
                raise KeyError(f"{engine} registers no parameter {full} (from {name})")
            loaded.add(full)
    return loaded


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_export_matches_each_engines_loader_and_reads_back_identically(model_type, engine, tmp_path):
    target, drafter = tiny_pair(model_type)
    if engine == "vllm":  # vLLM's fc has no bias: a drafter trained without one
        torch.manual_seed(0)
        drafter = Drafter(target.arch, target, fc_bias=False)
    folder = export_eagle(drafter, tmp_path / engine, format=engine, dtype=torch.float32)
    loaded_names = engine_load(engine, folder)
    cfg = json.loads((folder / "config.json").read_text())
    missing = engine_params(engine, cfg) - loaded_names - {"model.embed_tokens.weight"}
    assert not missing, missing  # every trained parameter reaches the engine
    loaded = load_eagle(folder, target)
    ids, feats = rows(target, drafter, 9, torch.Generator().manual_seed(8))
    with torch.no_grad():
        a, b = drafter(ids[None], feats[None]), loaded(ids[None], feats[None])
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)


@pytest.mark.filterwarnings("ignore:To copy construct")
def test_reduced_vocab_and_fc_bias_get_clear_errors_for_vllm(tmp_path):
    target, drafter = tiny_pair()
    drafter.set_draft_vocab(torch.arange(30, 60))
    folder = export_eagle(drafter, tmp_path / "sgl", format="sglang")
    token_map = torch.tensor(torch.load(folder / "hot_token_map.pt", weights_only=True), dtype=torch.int64)
    assert torch.equal(token_map, torch.arange(30, 60))  # what SGLang's load_token_map makes of it
    with pytest.raises(ExportError, match="token map.*--full-vocab"):
        export_eagle(drafter, tmp_path / "v", format="vllm")
    with pytest.raises(ExportError, match="fc.bias is non-zero"):
        export_eagle(drafter, tmp_path / "v", format="vllm", full_vocab=True)
    folder = export_eagle(drafter, tmp_path / "v", format="vllm", full_vocab=True, drop_fc_bias=True)
    assert not (folder / "hot_token_map.pt").exists()
    engine_load("vllm", folder)
    with torch.no_grad():
        drafter.fc.bias.zero_()
    export_eagle(drafter, tmp_path / "v0", format="vllm", full_vocab=True)  # a zero bias is no bias
    with pytest.raises(ExportError, match="unknown format"):
        export_eagle(drafter, tmp_path / "x", format="tgi")


def run_folder(tmp_path, target, drafter, steps=(2, 4)):
    """A run folder in tlt_rt.train.rl.checkpoint's layout, each checkpoint with a policy/ and a drafter/."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, V, (12,), generator=g) for _ in range(3)]
    buf = DrafterBuffer()
    buf.add(0, seqs, [target(s[None]).hidden[0].detach() for s in seqs])
    trainer = DrafterTrainer(drafter, buf, batch_tokens=16, draft_vocab=40)
    run = tmp_path / "run"
    for n in steps:
        trainer.step()
        ck = run / "checkpoints" / f"step_{n:06d}"
        save_target(target, ck / "policy")
        trainer.save_checkpoint(ck / "drafter", async_=False)
        (ck / "COMPLETE").write_text("ok\n")
    (run / "checkpoints" / "step_000009").mkdir()  # incomplete: ignored
    return run


def test_drafter_path_takes_a_run_or_its_checkpoint_with_identical_logits(tmp_path):
    target, drafter = tiny_pair()
    run = run_folder(tmp_path, target, drafter)
    latest = run / "checkpoints" / "step_000004"
    assert find_drafter(run) == ("checkpoint", latest / "drafter")
    assert find_drafter(latest) == ("checkpoint", latest / "drafter")
    ids, feats = rows(target, drafter, 9, torch.Generator().manual_seed(8))
    want = drafter.eval()(ids[None], feats[None])
    for path in (run, latest, latest / "drafter"):
        got = load_eagle(path, target)
        assert torch.equal(got.d2t, drafter.d2t)
        with torch.no_grad():
            out = got(ids[None], feats[None])
        assert torch.equal(out.logits, want.logits) and torch.equal(out.hidden, want.hidden)
    with pytest.raises(FileNotFoundError, match="neither an EAGLE"):
        load_eagle(tmp_path, target)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_eagle(tmp_path / "nowhere", target)


def test_export_drafter_command_from_a_run(tmp_path, capsys):
    target, drafter = tiny_pair()
    run = run_folder(tmp_path, target, drafter)
    out = tmp_path / "served"
    assert export_main([str(run), str(out), "--format", "sglang", "--dtype", "float32", "--strategy", "8_4_32"]) == 0
    printed = capsys.readouterr().out
    assert "--speculative-algorithm EAGLE" in printed and f"--speculative-draft-model-path {out}" in printed
    assert "--speculative-num-steps 8 --speculative-eagle-topk 4 --speculative-num-draft-tokens 32" in printed
    assert f"--speculative-token-map {out / 'hot_token_map.pt'}" in printed
    assert "40-token draft vocabulary" in printed
    engine_load("sglang", out)
    served = load_eagle(out, target)
    ids, feats = rows(target, drafter, 9, torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(served(ids[None], feats[None]).logits, drafter.eval()(ids[None], feats[None]).logits)
    # vLLM refuses the reduced vocabulary with the way out in the message; --full-vocab exports it
    assert export_main([str(run), str(tmp_path / "v"), "--format", "vllm"]) == 2
    assert "--full-vocab" in capsys.readouterr().err
    args = [str(run), str(tmp_path / "v"), "--format", "vllm", "--full-vocab", "--drop-fc-bias"]
    assert export_main(args) == 0
    printed = capsys.readouterr().out
    assert "vllm serve" in printed and '"method": "eagle"' in printed and "--speculative-config" in printed
    assert export_main([str(tmp_path / "nowhere"), str(out), "--format", "sglang"]) == 2
    assert H == target.arch.hidden_size
