"""The dry run's memory forecast by phase: rollout and learner peaks, and a clear error when one does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tlt_rt.config import TLTConfig, load_config
from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.shapes import KNOWN_SHAPES
from tlt_rt.train.__main__ import main as train_main
from tlt_rt.train.__main__ import resolve_arch
from tlt_rt.train.memory import GIB, activation_bytes_per_token, describe, forecast

ROOT = Path(__file__).resolve().parents[1]
QWEN = str(ROOT / "configs" / "qwen2.5-1.5b-math-gpu.yaml")
SHAPE = ArchConfig(**KNOWN_SHAPES["qwen2.5-7b"])


def _cfg(*keys: str) -> TLTConfig:
    return load_config(TLTConfig, QWEN, list(keys))


def test_dry_run_prints_both_phases_of_the_qwen_config(capsys):
    assert train_main([QWEN, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rollout phase:" in out and "learner phase:" in out and "both phases fit" in out
    assert "vocab 151936" in out


def test_a_learner_that_does_not_fit_fails_naming_the_keys(capsys):
    code = train_main([QWEN, "--dry-run", "rl.activation_checkpointing=false", "rl.micro_batch_tokens=65536"])
    assert code == 2
    captured = capsys.readouterr()
    assert "learner phase over by" in captured.err and "rl.micro_batch_tokens" in captured.err
    assert "rl.activation_checkpointing" in captured.err
    assert "learner phase:" in captured.out  # the breakdown is printed before the error


def test_chunked_logprobs_and_checkpointing_shrink_the_learner_phase():
    mb = "rl.micro_batch_tokens=16384"
    dense = forecast(_cfg(mb, "rl.logprob_chunk_tokens=0", "rl.activation_checkpointing=false"), SHAPE)
    chunked = forecast(_cfg(mb, "rl.activation_checkpointing=false"), SHAPE)
    both = forecast(_cfg(mb, "rl.activation_checkpointing=true"), SHAPE)
    assert both.learner_total < chunked.learner_total < dense.learner_total
    assert dense.rollout_total == chunked.rollout_total == both.rollout_total
    # 16k rows x 152k ids x 4 B x 3 of logits against one 2k-row chunk
    assert dense.learner_total - chunked.learner_total > 20 * GIB


def test_release_engine_leaves_the_kv_cache_out_of_the_learner_phase():
    kept = forecast(_cfg(), SHAPE)
    released = forecast(_cfg("rl.release_engine=true"), SHAPE)
    kv = next(v for k, v in kept.rollout.items() if k.startswith("KV cache"))
    assert kept.learner_total - released.learner_total >= kv
    assert any(k.endswith("(kept)") for k in kept.learner) and not any(k.endswith("(kept)") for k in released.learner)


def test_the_kv_cache_is_what_the_batch_can_fill():
    shape = resolve_arch(_cfg())[0]  # Qwen2.5-1.5B: 28 KiB of K/V a token, 128 x 2,624 tokens fill 9 GiB
    f = forecast(_cfg(), shape)
    (name,) = [k for k in f.rollout if k.startswith("KV cache")]
    assert "max_batch x full context" in name
    more = forecast(_cfg("rollout.max_batch=256"), shape)
    assert sum(v for k, v in more.rollout.items() if k.startswith("KV")) > f.rollout[name]


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_activations_scale_with_layers_and_dtype(dtype_bytes):
    a = SHAPE
    one = activation_bytes_per_token(ArchConfig(**{**KNOWN_SHAPES["qwen2.5-7b"], "num_hidden_layers": 1}), dtype_bytes)
    assert activation_bytes_per_token(a, dtype_bytes) == a.num_hidden_layers * one


def _saved_bytes_per_token(
    checkpoint: bool, tokens: tuple[int, int] = (4, 64), compiled: bool = False
) -> tuple[float, ArchConfig]:
    """Bytes the learner's bf16 forward saves for its backward per token, parameters left out."""
    import torch

    from tlt_rt.models.llama import CausalLM

    a = ArchConfig(model_type="qwen2", vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, qkv_bias=True,
                   max_position_embeddings=512)  # fmt: skip
    model = CausalLM(a).to(torch.bfloat16).train()
    model.checkpoint_layers = checkpoint
    model.compile_layers = compiled
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    b, t = tokens
    ids = torch.randint(0, a.vocab_size, (b, t))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(ids, head=lambda h, w: h.sum(-1))
    return sum(saved.values()) / (b * t), a


def test_the_activation_forecast_matches_what_the_forward_saves():
    """The forecast's largest learner term, against the tensors autograd actually keeps (CPU, bf16). The CPU's
    attention also keeps its [T, T] probabilities (1 KiB a token here), which GPU flash attention does not."""
    kept, a = _saved_bytes_per_token(checkpoint=False)
    assert 0.85 < kept / activation_bytes_per_token(a, 2) < 1.2
    # checkpointed: each layer's input, the final norm's input in bf16 and fp32, the ids and positions; the
    # recompute's one layer is forecast apart
    kept, a = _saved_bytes_per_token(checkpoint=True)
    layer_inputs = a.num_hidden_layers * a.hidden_size * 2
    assert layer_inputs < kept <= layer_inputs + 4 * a.hidden_size * 2  # (2,574 here: 1,024 + 1,536 + 14)


def test_the_compiled_layers_activation_forecast_matches_what_their_graphs_save():
    """With rl.compile_layers the learner's layers save less (inductor recomputes the norms' upcasts and the
    rotary): the forecast's compiled term against what the compiled forward keeps (CPU, bf16; besides the layers
    the final norm keeps its input and output in fp32, 2 KiB a token here). The Qwen 1.5B config's dry run
    counts it, and its learner phase comes within 15% of the measured peaks (55-57 GiB on an H200)."""
    kept, a = _saved_bytes_per_token(checkpoint=False, compiled=True)
    want = activation_bytes_per_token(a, 2, compiled=True)
    assert want < 0.8 * activation_bytes_per_token(a, 2)
    assert 0.95 < (kept - 2 * a.hidden_size * 4) / want < 1.1
    cfg = load_config(TLTConfig, "configs/qwen2.5-1.5b-math-gpu.yaml")
    arch = ArchConfig(**KNOWN_SHAPES["qwen2.5-coder-1.5b"])
    peak = forecast(cfg, arch).learner_total / GIB
    assert 55 / 1.15 < peak < 57 * 1.15 and any("compiled layers" in k for k in forecast(cfg, arch).learner_moments[
        "forward + backward of a micro-batch"
    ])  # fmt: skip
    eager = load_config(TLTConfig, "configs/qwen2.5-1.5b-math-gpu.yaml", ["rl.compile_layers=false"])
    assert forecast(eager, arch).learner_total / GIB > peak + 3


def test_learner_rates_report_both_peaks_of_each_phase_largest_over_workers():
    from tlt_rt.train.records import learner_rates
    from tlt_rt.train.rl.learner import LearnResult

    gib = 2**30
    a = LearnResult(seconds=2.0, forward_tokens=1000, flops=4e12, peak_flops=1e15, peak_rollout_bytes=10 * gib,
                    peak_learn_bytes=20 * gib, reserved_rollout_bytes=12 * gib,
                    reserved_learn_bytes=24 * gib)  # fmt: skip
    b = LearnResult(seconds=1.0, forward_tokens=1000, flops=1e12, peak_flops=1e15, peak_rollout_bytes=11 * gib,
                    peak_learn_bytes=18 * gib, reserved_rollout_bytes=13 * gib,
                    reserved_learn_bytes=22 * gib)  # fmt: skip
    out = learner_rates([a, b])
    assert out["gpu_peak_rollout_gib"] == 11 and out["gpu_peak_learn_gib"] == 20
    assert out["gpu_reserved_rollout_gib"] == 13 and out["gpu_reserved_learn_gib"] == 24
    assert out["learner_tokens_per_second"] == 750  # the mean of the workers' 500 and 1000
    assert abs(out["learner_mfu"] - 0.0015) < 1e-12  # (4e12 / 2 / 1e15 + 1e12 / 1 / 1e15) / 2
    cpu = learner_rates([LearnResult(seconds=1.0, forward_tokens=10, flops=1.0)])
    assert cpu["gpu_reserved_learn_gib"] is None and cpu["learner_mfu"] is None


def test_the_learner_peak_counts_the_larger_of_the_backward_and_the_optimizer_step():
    f = forecast(_cfg(), SHAPE)
    backward = sum(f.learner_moments["forward + backward of a micro-batch"].values())
    step = sum(f.learner_moments["optimizer step"].values())
    assert f.learner_total == sum(f.learner.values()) + max(backward, step)
    assert f.learner_peak_moment == "forward + backward of a micro-batch"  # 8k rows of activations > fp32 grads
    small = ("rl.activation_checkpointing=true", "rl.micro_batch_tokens=1024", "rl.logprob_chunk_tokens=256")
    tiny = forecast(_cfg(*small), SHAPE)
    assert tiny.learner_peak_moment == "optimizer step"  # a small checkpointed micro-batch: the fp32 copies win
    lines, err = describe(f, 1000.0)
    text = "\n".join(lines)
    assert err is None and "(the larger, counted)" in text and "(not counted)" in text


def test_an_update_counts_its_compiles_and_allocator_retries():
    """Learner.update says how many graphs torch.compile made during it (and, on a GPU, allocator retries):
    the two usual reasons one update takes several times the others."""
    import torch

    from tlt_rt.config import RLConfig
    from tlt_rt.models.llama import CausalLM
    from tlt_rt.train.records import learner_rates
    from tlt_rt.train.rl.learner import Learner, LearnSample, MiniBatch, SamplingFilter

    arch = ArchConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, qkv_bias=True)  # fmt: skip
    model = CausalLM(arch)
    glue = model.model.layers[0].mlp.glue
    glue.swiglu = torch.compile(glue.swiglu, backend="eager", dynamic=True)  # a compiled piece, as on a GPU
    learner = Learner(model, RLConfig(), SamplingFilter())
    batch = [LearnSample([1, 2], [3, 4, 5], [-1.0] * 3, 1.0), LearnSample([1], [6, 7], [-1.0] * 2, -1.0)]
    first = learner.update([MiniBatch(batch, num_tokens=5, num_seqs=2)])
    again = learner.update([MiniBatch(batch, num_tokens=5, num_seqs=2)])
    assert first.compiles >= 1 and again.compiles == 0  # the same shapes reuse the graph
    assert first.alloc_retries == again.alloc_retries == 0  # none on a CPU
    rec = learner_rates([first])
    assert rec["learner_compiles"] == first.compiles and rec["learner_update_seconds"] == first.seconds


def test_learner_warm_up_compiles_the_training_graphs_before_any_update():
    """After `Learner.warm_up` (micro-batches of one and of several, gradients on), updates of any batch
    size compile nothing more: a batch of one is its own shape to torch.compile, and the first update that
    met one used to compile inside the step (inductor's own size guards: tests/test_learner_warm_up.py)."""
    import random

    import torch

    from tlt_rt.config import RLConfig
    from tlt_rt.models.llama import CausalLM, Glue, set_glue
    from tlt_rt.train.rl.learner import Learner, LearnSample, MiniBatch, SamplingFilter

    class EagerCompiledGlue(Glue):  # dynamo's guards and recompiles, without inductor's code generation
        def __init__(self):
            for name in ("rms_norm", "add_rms_norm", "rotate_pair", "swiglu"):
                setattr(self, name, torch.compile(getattr(Glue, name), backend="eager", dynamic=True))

    arch = ArchConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, qkv_bias=True)  # fmt: skip
    torch._dynamo.reset()
    model = CausalLM(arch)
    set_glue(model, EagerCompiledGlue())
    with torch.no_grad():  # the engine's use first: no gradients
        model(torch.randint(0, 60, (2, 5)))
    learner = Learner(model, RLConfig(micro_batch_tokens=64), SamplingFilter())
    assert learner.warm_up() > 0
    assert all(p.grad is None for p in model.parameters())  # nothing left behind for the first update
    rng = random.Random(0)
    for sizes in ([3], [30, 2], [5, 6, 7, 8], [40]):  # micro-batches of one and of several
        batch = [LearnSample([1, 2], [rng.randrange(60) for _ in range(n)], [-1.0] * n, 1.0) for n in sizes]
        out = learner.update([MiniBatch(batch, num_tokens=sum(sizes), num_seqs=len(sizes))])
        assert out.compiles == 0, sizes
