"""The device kit's lock and tables (tools/verl_device_kit.py, tools/verl-device-kit.lock): one version of each
package, every root pinned, nothing that shadows the GPU machine's image except what verl must have older."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kit():
    pytest.importorskip("packaging")
    spec = importlib.util.spec_from_file_location("verl_device_kit", REPO / "tools/verl_device_kit.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_kit_lock_has_one_version_of_each_package(kit):
    from packaging.utils import canonicalize_name

    lock = kit.read_lock()
    names = [canonicalize_name(n) for n, _, _ in lock]
    assert len(names) == len(set(names)), "a package is pinned twice"
    assert {t for _, _, t in lock} <= set(kit.TARGETS)
    pins = {canonicalize_name(n): (v, t) for n, v, t in lock}
    for root, _ in kit.ROOTS:  # every root is in, at its pinned version where the root pins one
        name, _, version = root.partition("==")
        assert canonicalize_name(name) in pins, root
        assert not version or pins[canonicalize_name(name)][0] == version, root
    for name, (_, target) in pins.items():
        # an image package is carried only to replace the image's copy for verl; nothing else shadows the image
        assert (target == "verl-tf") == (name in kit.IMAGE), name
        assert name not in kit.EXCLUDE
    assert pins["transformers"][1] == "verl-tf" and pins["transformers"][0].startswith("5.10.")
    assert pins["verl"] == ("0.9.1", "site")
    assert not {"flash-attn", "vllm", "sglang", "wandb"} & set(pins)


def test_kit_tables_have_no_duplicates(kit):
    from packaging.utils import canonicalize_name

    roots = [canonicalize_name(r.split("==")[0]) for r, _ in kit.ROOTS]
    assert len(roots) == len(set(roots))
    words = (REPO / "tools/verl_device_kit.py").read_text().split("IMAGE: frozenset[str] = frozenset(")[1]
    listed = words.split('"""')[1].split()
    assert len(listed) == len(set(listed)) == len(kit.IMAGE)
    assert set(kit.IMAGE_VERSIONS) <= kit.IMAGE and set(kit.CARRY_ANYWAY) <= kit.IMAGE
    env = kit.machine_environment()
    assert env["python_version"] == "3.12" and env["platform_machine"] == "x86_64"
