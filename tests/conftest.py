"""Shared test set-up: every test is seeded; `gpu` tests are skipped without CUDA."""

from __future__ import annotations

import gc
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
