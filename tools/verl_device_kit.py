"""What verl 0.9.1 needs on the GPU machine beyond its image: the resolver behind tools/verl-device-kit.sh.

    python tools/verl_device_kit.py resolve WHEEL_DIR     # walk Requires-Dist from ROOTS, rewrite the lock
    python tools/verl_device_kit.py fetch DIR             # download the lock's wheels into DIR/site, DIR/verl-tf
    python tools/verl_device_kit.py pins [site|verl-tf]   # the lock's `name==version` lines of one target

The GPU machine runs CPython 3.12 on x86-64 Linux with the packages of IMAGE (its package list); its torch is
2.11.0+cu130 and its transformers 5.17.0, which verl 0.9.1 refuses (it pins transformers<5.11). `resolve`
starts from ROOTS, reads each downloaded wheel's `Requires-Dist` (markers evaluated for that machine; extras,
requested or offered, skipped), and keeps what the image lacks. A requirement the image has at a version it
does not allow (transformers, tokenizers) is kept too, with target `verl-tf`: installed apart from the rest
(/tmp/site-verl-tf) and put first on verl's PYTHONPATH only, so the project keeps the image's own. Everything
else has target `site` (/tmp/site). One version of each package: a later, narrower requirement re-picks the
newest version that meets all of them, and the closure is walked again from the roots over the final pins.

The result is LOCK (tracked): `name==version target` lines, which tools/verl-device-kit.sh downloads exactly.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

LOCK = Path(__file__).with_name("verl-device-kit.lock")

# what the kit starts from, and why each is there
ROOTS: tuple[tuple[str, str], ...] = (
    ("verl==0.9.1", "verl itself"),
    ("ray==2.60.0", "the project's ray (the version device-prep.sh carries); verl asks for ray>=2.41"),
    ("TransferQueue==0.1.11", "verl's default v1 trainer imports transfer_queue (declared in verl's verl-core extra)"),
    ("cachetools", "verl.workers.rollout.router imports it at the top (declared in verl's verl-core extra)"),
    ("fastapi", "verl.workers.rollout.utils imports it at the top (declared in verl's verl-core extra)"),
    ("uvicorn", "verl.workers.rollout.utils imports it at the top (declared in verl's verl-core extra)"),
    ("gguf", "tlt_rt's GGUF -> HF folder conversion (tlt_rt.models.default.convert_gguf)"),
)

# the GPU machine's image, as .library/device/KINDS.md lists it (read on a machine on 2026-11-17)
IMAGE: frozenset[str] = frozenset(
    canonicalize_name(n)
    for n in """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
    multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
    patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
    py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
    scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
    shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
    tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
    uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
    """.split()
)

# the versions known of them (KINDS.md's pip list and the machine's torch); the others are taken to fit
IMAGE_VERSIONS: dict[str, str] = {
    canonicalize_name(k): v
    for k, v in {
        "accelerate": "1.15.0",
        "huggingface-hub": "1.33.0",
        "numpy": "2.5.2",
        "safetensors": "0.8.0",
        "tokenizers": "0.23.2",
        "torch": "2.11.0",
        "torchaudio": "2.11.0",
        "torchvision": "0.26.0",
        "transformers": "5.17.0",
        "triton": "3.6.0",
        "sentencepiece": "0.2.2",
        "tiktoken": "0.14.0",
        "onnx": "1.23.1",
        "jax": "0.11.2",
    }.items()
}

TARGETS = ("site", "verl-tf")

# image packages carried anyway (target verl-tf), where the image's version is not known and a requirement's lower
# bound is recent; each is backward compatible, so a newer copy on verl's path alone is safe
CARRY_ANYWAY: dict[str, str] = {
    "typing-extensions": "pydantic 2.14 (for fastapi and verl's agent loop) asks for >=4.16.0",
}

# declared by verl but left out, and why
EXCLUDE: dict[str, str] = {
    "wandb": "verl imports it only for trainer.logger=wandb (verl.utils.tracking); the device run logs to the console",
}

# pip download's view of the GPU machine (pure-Python wheels match any of these)
PLATFORM_ARGS = (
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64",
)  # fmt: skip


def machine_environment() -> dict[str, str]:
    """Marker values of the GPU machine (CPython 3.12.3, x86-64 Linux)."""
    env = dict(default_environment())
    env.update(
        python_version="3.12", python_full_version="3.12.3", implementation_name="cpython",
        implementation_version="3.12.3", platform_python_implementation="CPython", sys_platform="linux",
        platform_system="Linux", platform_machine="x86_64", os_name="posix", extra="",
    )  # fmt: skip
    return env


def requires(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the GPU machine, extras left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = z.read(meta).decode("utf-8", "replace")
    env, out = machine_environment(), []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or req.marker.evaluate(env):  # extra == "x" lines are false with extra=""
            out.append(req)
    return out


def image_satisfies(name: str, spec: SpecifierSet) -> bool:
    """Whether the image's copy of `name` (it must have one) meets `spec`; unknown versions are taken to, except
    those of CARRY_ANYWAY."""
    if name in CARRY_ANYWAY:
        return False
    v = IMAGE_VERSIONS.get(name)
    return v is None or spec.contains(Version(v), prereleases=True)


def wheel_key(path: Path) -> tuple[str, Version]:
    name, version, _, _ = parse_wheel_filename(path.name)
    return canonicalize_name(name), version


def download(reqs: Iterable[str], dest: Path) -> None:
    """Wheels for the GPU machine; a requirement published as a source archive alone (antlr4-python3-runtime 4.9.3,
    which omegaconf 2.3 pins) is built here, and kept only if the wheel is pure Python."""
    reqs = list(reqs)
    pip = [sys.executable, "-m", "pip"]
    get = [*pip, "download", "-q", "--no-deps", *PLATFORM_ARGS, "-d", str(dest)]
    if not reqs or subprocess.run([*get, *reqs], capture_output=True).returncode == 0:
        return
    for req in reqs:
        if subprocess.run([*get, req], capture_output=True).returncode == 0:
            continue
        before = set(dest.glob("*.whl"))
        subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(dest), req], check=True)
        for built in set(dest.glob("*.whl")) - before:
            if not any(t.abi == "none" and t.platform == "any" for t in parse_wheel_filename(built.name)[3]):
                built.unlink()
                raise SystemExit(f"{req}: no wheel for the GPU machine, and its build here is not pure Python")


def resolve(dest: Path) -> dict[str, tuple[Version, str, Path]]:
    """name -> (version, target, wheel) of the closure; wheels land in `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    specs: dict[str, SpecifierSet] = {}
    pins: dict[str, tuple[Version, Path]] = {}
    todo = [Requirement(r) for r, _ in ROOTS]
    while todo:
        wanted: dict[str, SpecifierSet] = {}
        for req in todo:
            name = canonicalize_name(req.name)
            if name in EXCLUDE:
                continue
            specs[name] = specs.get(name, SpecifierSet()) & req.specifier
            if name in IMAGE and image_satisfies(name, specs[name]):
                continue
            if name in pins and specs[name].contains(pins[name][0], prereleases=True):
                continue
            wanted[name] = specs[name]
        todo = []
        download((f"{n}{s}" for n, s in wanted.items()), dest)
        for name, spec in wanted.items():
            fits = [
                (v, p) for p in dest.glob("*.whl") for n, v in [wheel_key(p)] if n == name and spec.contains(v, True)
            ]
            if not fits:
                continue
            version, path = max(fits)
            old = pins.get(name)
            if old is not None and old[1] != path:
                old[1].unlink(missing_ok=True)  # one version of each package
            pins[name] = (version, path)
            todo.extend(requires(path))
        missing = set(wanted) - set(pins)
        if missing:
            raise SystemExit(f"no wheel found for {sorted(missing)}")
    return closure(pins)


def closure(pins: dict[str, tuple[Version, Path]]) -> dict[str, tuple[Version, str, Path]]:
    """What the roots reach over the final pins (a re-pinned package's old requirements fall away)."""
    out: dict[str, tuple[Version, str, Path]] = {}
    stack = [canonicalize_name(Requirement(r).name) for r, _ in ROOTS]
    while stack:
        name = stack.pop()
        if name in out or name not in pins or name in EXCLUDE:
            continue
        version, path = pins[name]
        out[name] = (version, "verl-tf" if name in IMAGE else "site", path)
        stack.extend(canonicalize_name(r.name) for r in requires(path))
    return out


def write_lock(found: dict[str, tuple[Version, str, Path]], path: Path = LOCK) -> None:
    lines = [
        "# verl 0.9.1's closure beyond the GPU machine's image: `name==version target` (site: /tmp/site,",
        "# verl-tf: /tmp/site-verl-tf, first on verl's PYTHONPATH only). Written by tools/verl_device_kit.py resolve.",
    ]
    lines += [f"# left out: {n} ({why})" for n, why in sorted(EXCLUDE.items())]
    for target in TARGETS:
        lines += [f"{n}=={v} {t}" for n, (v, t, _) in sorted(found.items()) if t == target]
    path.write_text("\n".join(lines) + "\n")


def read_lock(path: Path = LOCK) -> list[tuple[str, str, str]]:
    """(name, version, target) of every lock line."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pin, target = line.split()
            name, version = pin.split("==")
            out.append((name, version, target))
    return out


def fetch(dest: Path, path: Path = LOCK) -> dict[str, list[Path]]:
    """Download exactly the lock's pins into dest/<target>/; fails unless each pin gives one wheel."""
    out: dict[str, list[Path]] = {}
    for target in TARGETS:
        d = dest / target
        d.mkdir(parents=True, exist_ok=True)
        pins = {canonicalize_name(n): v for n, v, t in read_lock(path) if t == target}
        have = {wheel_key(w) for w in d.glob("*.whl")}
        download((f"{n}=={v}" for n, v in pins.items() if (n, Version(v)) not in have), d)
        got: dict[str, list[Path]] = {}
        for w in d.glob("*.whl"):
            got.setdefault(wheel_key(w)[0], []).append(w)
        for name in set(got) - set(pins):  # left over from an earlier lock
            for w in got.pop(name):
                w.unlink()
        bad = {n: [w.name for w in ws] for n, ws in got.items() if len(ws) != 1 or str(wheel_key(ws[0])[1]) != pins[n]}
        if bad or set(got) != set(pins):
            raise SystemExit(f"{d}: want one wheel per pin; missing {sorted(set(pins) - set(got))}, off {bad}")
        out[target] = sorted(w for ws in got.values() for w in ws)
    return out


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "resolve":
        found = resolve(Path(argv[1]))
        write_lock(found)
        for n, (v, t, p) in sorted(found.items()):
            print(f"{n}=={v} {t} {p.name}")
        return 0
    if len(argv) == 2 and argv[0] == "fetch":
        for target, wheels in fetch(Path(argv[1])).items():
            print(f"{target}: {len(wheels)} wheels")
        return 0
    if len(argv) == 2 and argv[0] == "pins" and argv[1] in TARGETS:
        print("\n".join(f"{n}=={v}" for n, v, t in read_lock() if t == argv[1]))
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
