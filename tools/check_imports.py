"""Fail on import circles among tlt_rt's modules, and on a package importing one above it; `make lint` runs it.

    python tools/check_imports.py [--local]

Packages (and the top-level modules) sit in LAYERS, from the bottom up: the runtime's flow is ir and models <-
codegen <- rollout <- train <- integrations <- the front (report, compile, the command line). A module may
import its own package and any in a lower layer; the imports that break that today are listed in KNOWN, each
to be removed (one that is gone fails the check as well, so the list only shrinks).

Every `import` / `from ... import` inside tlt_rt/ is an edge, wherever it sits (a function-local import
still ties the two modules together), except those under `if TYPE_CHECKING:`. `from pkg import name`
points at `pkg.name` when that is a module, else at `pkg` (its __init__). A circle is a strongly
connected component of more than one module (or a module importing itself); each is printed with one
path through it. `--local` also lists the imports made inside functions, which must say why (a heavy
optional dependency) in a comment.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "tlt_rt"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(imported tlt_rt module, line, inside a function) for every import in `path`."""
    name = module_name(path)
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub, local)
                continue
            inner = local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == PKG:
                        out.append((alias.name, child.lineno, local))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] != PKG:
                    continue
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    out.append((sub if sub in modules else base, child.lineno, local))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


LAYERS: list[tuple[str, ...]] = [
    ("options",),
    ("yaml12",),
    ("config_loader",),
    ("ir", "models"),
    ("codegen",),
    ("rollout",),
    ("train",),
    ("integrations",),
    ("config", "compare", "demo", "export_drafter"),
    ("report", "compile", "program"),
    ("__main__",),
]
KNOWN: dict[tuple[str, str], str] = {}


def package_of(module: str) -> str:
    """The layer name of a tlt_rt module: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_errors(graph: dict[str, set[str]], known: dict[tuple[str, str], str] = KNOWN) -> list[str]:
    """Imports from a package into one in a higher layer, or into another package of the same layer (not in
    `known`), and entries of `known` that no longer occur."""
    rank = {name: i for i, names in enumerate(LAYERS) for name in names}
    errors, seen = [], set()
    for src in sorted(graph):
        a = package_of(src)
        top = rank.get(a, len(LAYERS))  # a package without a place may import any placed one (reported below)
        for dst in sorted(graph[src]):
            b = package_of(dst)
            if a == b or a == "" or (b in rank and rank[b] < top):
                continue
            if (src, dst) in known:
                seen.add((src, dst))
                continue
            where = "a higher layer" if rank.get(b, len(LAYERS)) > top else "its own layer"
            errors.append(f"{src} imports {dst}: {b or dst} is in {where} than {a} (tools/check_imports.py LAYERS)")
    for pair in sorted(set(known) - seen):
        errors.append(f"{pair[0]} no longer imports {pair[1]}: drop it from KNOWN in tools/check_imports.py")
    for src in sorted(graph):
        if package_of(src) not in rank and package_of(src):
            errors.append(f"{src}: package {package_of(src)!r} has no place in LAYERS (tools/check_imports.py)")
    return errors


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with a circle in them (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def path_through(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One circle inside the component: from its first module back to it."""
    start, members = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    chain = [v]
                    while chain[-1] != start:
                        chain.append(prev[chain[-1]])
                    return [start, *reversed(chain[:-1]), start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def main(argv: list[str]) -> int:
    files = sorted((ROOT / PKG).rglob("*.py"))
    modules = {module_name(p) for p in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    local: list[str] = []
    for path in files:
        for target, line, inside in imports(path, modules):
            if target in modules:
                graph[module_name(path)].add(target)
            if inside:
                local.append(f"{path.relative_to(ROOT)}:{line}: {target}")
    found = cycles(graph)
    for comp in found:
        print("import circle: " + " -> ".join(path_through(graph, comp)))
        if len(comp) > 2:
            print("  (all of: " + ", ".join(comp) + ")")
    if "--local" in argv:
        print(f"{len(local)} function-local imports of tlt_rt modules:")
        print("\n".join(local))
    layered = layer_errors(graph)
    for line in layered:
        print(line)
    if found:
        print(f"{len(found)} import circle(s) in {PKG}/")
    if found or layered:
        return 1
    print(f"no import circles among {len(modules)} modules of {PKG}/, and no package imports one above it "
          f"({len(KNOWN)} known exceptions)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
