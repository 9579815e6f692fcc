"""Drafter training throughput, packed rows (`packed`) against one padded sample per row (`unpacked`), and
the drafter warm-up's step (`warmup-vocab8192`: the GPU configs' 8,192-id draft head, three unrolled passes,
the warm-up's batch: WARMUP_TOKENS), the same with its attention as one dense mask over the packed row
(`warmup-vocab8192-dense`, the training-time test before it ran in bands) and with five passes (`warmup5-vocab8192`).

    pytest benchmarks/bench_drafter_train.py --benchmark-only

A SmolLM2-135M-shaped drafter (H=576, 9 heads / 3 KV heads, MLP 1536, V=49152) bound to a one-layer
target of the same shape (only its embedding, final norm and LM head are used). One round = one
optimizer step (`DrafterTrainer.step`: batch assembly, forward, loss over the full vocabulary, backward,
AdamW) on `batch_tokens` tokens. Samples have long-tailed RL-like lengths. extra_info holds the real
(non-padding) tokens per step, tokens/s at the median time and the share of the token budget they use.
CPU: fp32, batch_tokens=256, lengths 8..200. CUDA: bf16 target, fp32 drafter, batch_tokens=8192,
lengths 64..3000.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tlt_rt.models import ArchConfig, CausalLM
from tlt_rt.models.drafter import Drafter, xformers_works
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.trainer import DrafterTrainer
from tlt_rt.train.drafter.warmup import CPU_BATCH_TOKENS, GPU_BATCH_TOKENS

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BATCH_TOKENS, LO, HI = (8192, 64, 3000) if CUDA else (256, 8, 200)
WARMUP_TOKENS = GPU_BATCH_TOKENS if CUDA else CPU_BATCH_TOKENS
SMOLLM2 = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def _setup(packed: bool, draft_vocab: int = 0, batch_tokens: int = BATCH_TOKENS, unroll: int = 1) -> DrafterTrainer:
    torch.manual_seed(0)
    arch = ArchConfig(**SMOLLM2, num_hidden_layers=1)
    target = CausalLM(arch).to(DEVICE, torch.bfloat16 if CUDA else torch.float32).eval()
    drafter = Drafter(arch, target).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    # long-tailed lengths: most responses short, a few near the cap
    lengths = (LO + (HI - LO) * torch.rand(64, generator=g) ** 3).long().tolist()
    ids = [torch.randint(0, arch.vocab_size, (n,), generator=g) for n in lengths]
    hidden = [torch.randn(n, arch.hidden_size, generator=g).to(target.lm_head.weight.dtype) for n in lengths]
    buf = DrafterBuffer(max_steps=1, device=DEVICE)
    buf.add(0, ids, hidden)
    if draft_vocab:
        drafter.set_draft_vocab(torch.arange(draft_vocab))
    return DrafterTrainer(drafter, buf, lr=1e-4, batch_tokens=batch_tokens, packed=packed, unroll=unroll)


@pytest.mark.parametrize(
    "provider", ["packed", "unpacked", "warmup-vocab8192", "warmup-vocab8192-dense", "warmup5-vocab8192"]
)
def test_drafter_train_step(benchmark, provider):
    warm = provider.startswith("warmup")
    trainer = _setup(
        provider != "unpacked", *((8192, WARMUP_TOKENS, 5 if "warmup5" in provider else 3) if warm else ())
    )
    if provider.endswith("-dense"):
        trainer.drafter.forward_unrolled = functools.partial(Drafter.forward_unrolled, trainer.drafter, block=0)
    trainer.step()  # warm-up (allocator, kernels, optimizer state)
    tokens: list[float] = []

    def step():
        tokens.append(trainer.step()["tokens"])

    benchmark.pedantic(step, rounds=5 if CUDA else 3, warmup_rounds=1)
    median_s = benchmark.stats.stats.median
    mean_tokens = sum(tokens) / len(tokens)
    benchmark.extra_info.update(
        device=torch.cuda.get_device_name() if CUDA else "cpu",
        batch_tokens=trainer.batch_tokens,
        real_tokens_per_step=mean_tokens,
        tokens_per_s=mean_tokens / median_s,
        budget_used=mean_tokens / trainer.batch_tokens,
        packed_attention="xformers" if provider == "packed" and xformers_works(DEVICE) else "sdpa",
    )
