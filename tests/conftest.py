"""Shared test set-up: every test is seeded; `gpu` tests are skipped without CUDA; the fixtures of the
training-run tests (a module's Ray cluster, a tiny policy with SmolLM2's tokenizer and its prompts)."""

from __future__ import annotations

import gc
import json
import os
import random

import numpy as np
import pytest
import torch
from hypothesis import settings

# Triton decides between compiling and interpreting when a kernel module is imported, once per process:
# without CUDA every kernel test runs under the interpreter, so switch it on before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True, print_blob=True)
settings.register_profile("thorough", deadline=None, max_examples=300)
settings.load_profile(os.environ.get("TLT_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
    if torch.cuda.is_available():  # one test's cached blocks must not crowd out the next (7B-shaped) test
        gc.collect()
        torch.cuda.empty_cache()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny policy with SmolLM2's tokenizer that writes only "1", "2" and spaces (and stops with EOS about one
    time in ten), and prompts whose answer is 1: rewards are mixed within groups, so every step has a signal."""
    from tlt_rt.models import save_target
    from tlt_rt.models.arch import ArchConfig
    from tlt_rt.models.default import load_tokenizer
    from tlt_rt.models.llama import CausalLM

    folder = tmp_path_factory.mktemp("tiny")
    tok = load_tokenizer(None)
    arch = ArchConfig(model_type="llama", vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, bos_token_id=1, eos_token_ids=(tok.eos_token_id,))  # fmt: skip
    torch.manual_seed(0)
    model = CausalLM(arch)
    favoured = [tok.convert_tokens_to_ids(t) for t in ("1", "2")] + tok.encode(" ")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02)
        # the residual stream's channel 0 is large and positive, the final norm keeps only it, and the head
        # reads it as +2 for the favoured tokens and -2 for all others
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight[:, 0] = -2.0
        model.lm_head.weight[favoured, 0] = 2.0
        model.lm_head.weight[tok.eos_token_id, 0] = 1.85
    save_target(model, folder / "policy", tok)
    with open(folder / "data.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"question": f"Reply with the number one ({i}).", "answer": "1"}) + "\n")
    return folder
