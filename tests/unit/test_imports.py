"""The import graph of weft's own modules: no cycles, and the layering DESIGN.md promises.

Every import counts, at module level, inside a function or under `if TYPE_CHECKING:` (a cycle of
annotations is still two modules that cannot be read apart), except where a rule below says
otherwise. Modules are found through pyproject's package-dir mapping, read from the files."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# import name -> folder (pyproject.toml [tool.setuptools.package-dir]; checked below)
PACKAGE_DIRS = {
    "weft": "weft",
    "weft.lang": "lang",
    "weft.runtime": "runtime",
    "weft.radix": "radix",
    "weft.constrain": "constrain",
    "weft.kernels": "kernels",
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # an imported weft module, or a third-party top-level name
    type_only: bool  # under `if TYPE_CHECKING:`
    line: int


def modules() -> dict[str, Path]:
    """weft's module names -> files."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if package == "weft" and parts[0] in {
                p.split(".")[1] for p in PACKAGE_DIRS if "." in p
            }:
                continue  # (no such folders under weft/; guards a future mistake)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> Iterator[Import]:
    """Every import in `path`: weft modules by name (a `from package import module` names the
    module), anything else by its top-level name."""
    is_package = path.name == "__init__.py"

    def walk(node: ast.AST, type_only: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from walk(ast.Module(body=child.body, type_ignores=[]), True)
                yield from walk(ast.Module(body=child.orelse, type_ignores=[]), type_only)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(name, _resolve(alias.name, known), type_only, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                subs = [f"{target}.{a.name}" for a in child.names if f"{target}.{a.name}" in known]
                if len(subs) < len(child.names):  # names from the module itself
                    yield Import(name, _resolve(target, known), type_only, child.lineno)
                for sub in subs:
                    yield Import(name, sub, type_only, child.lineno)
            yield from walk(child, type_only)

    yield from walk(ast.parse(path.read_text()), False)


def _resolve(target: str, known: set[str]) -> str:
    if target in known or not target.startswith("weft"):
        return target if target in known else target.split(".")[0]
    return target


@pytest.fixture(scope="module")
def graph() -> list[Import]:
    found = modules()
    known = set(found)
    return [i for name, path in found.items() for i in imports(name, path, known)]


def test_the_package_dirs_match_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["package-dir"] == PACKAGE_DIRS


def test_there_are_no_import_cycles(graph: list[Import]) -> None:
    edges: dict[str, set[str]] = {}
    for i in graph:
        if i.target.startswith("weft.") or i.target == "weft":
            edges.setdefault(i.source, set()).add(i.target)
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _weft(i: Import) -> bool:
    return _under(i.target, "weft")


def _stdlib(name: str) -> bool:
    return name in sys.stdlib_module_names or name == "__future__"


# (who, what it may not import, why): each a rule of DESIGN.md or of runtime/'s layout
RULES = [
    ("weft.radix", lambda i: _weft(i) and not _under(i.target, "weft.radix"),
     "radix/ is a plain data structure: it imports no other part of weft"),
    ("weft.constrain", lambda i: _under(i.target, "weft.runtime", "weft.lang", "weft.kernels")
     or i.target == "weft", "constrain/ imports nothing from runtime/, lang/ or kernels/"),
    ("weft.kernels", lambda i: (_weft(i) and not _under(i.target, "weft.kernels"))
     or (not _weft(i) and not _stdlib(i.target) and i.target not in ("torch", "triton")),
     "kernels/ imports only torch, triton and the standard library"),
    ("weft.lang", lambda i: _under(i.target, "weft.runtime", "weft.kernels", "weft.radix")
     and i.target not in ("weft.runtime.server.engine", "weft.runtime.sampling_params"),
     "lang/ reaches the runtime only through its backends (the Engine, HTTP or ZMQ clients)"),
    ("weft.runtime", lambda i: _under(i.target, "weft.lang", "weft.cli") or i.target == "weft",
     "runtime/ never imports the DSL or the public face"),
    ("weft.runtime.server", lambda i: _under(i.target, "weft.runtime.scheduler",
                                             "weft.runtime.executor"),
     "the front (server/) reaches the scheduler only over IPC"),
    ("weft.runtime.scheduler", lambda i: _under(i.target, "weft.runtime.server"),
     "the scheduler answers over IPC; it imports nothing of the front"),
    ("weft.runtime.executor", lambda i: _under(i.target, "weft.runtime.server")
     or (_under(i.target, "weft.runtime.scheduler") and not i.type_only),
     "the executor runs what the scheduler hands it (its Req, Batch: for types only)"),
    ("weft.runtime.ipc", lambda i: _under(i.target, "weft.runtime.executor")
     or (_under(i.target, "weft.runtime.scheduler", "weft.runtime.server")
         and i.source != "weft.runtime.ipc.child_main"),
     "ipc/ is the wires; only a child process's entry point starts the scheduler or detokenizer"),
]  # fmt: skip


@pytest.mark.parametrize("who, forbidden, why", RULES, ids=[r[0] for r in RULES])
def test_the_layering_holds(graph: list[Import], who: str, forbidden: object, why: str) -> None:
    assert callable(forbidden)
    bad = [i for i in graph if _under(i.source, who) and forbidden(i)]
    assert not bad, why + ":\n" + "\n".join(f"{i.source}:{i.line} imports {i.target}" for i in bad)


def test_the_checker_sees_cycles_and_type_only_imports(tmp_path: Path) -> None:
    """The checker itself: a cycle through a function-level import and one through TYPE_CHECKING
    are both found, and a type-only import is marked as such."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from weft.x import b\n")
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import weft.x.a\n")
    known = {"weft.x.a", "weft.x.b"}
    found = [*imports("weft.x.a", a, known), *imports("weft.x.b", b, known)]
    assert [(i.source, i.target, i.type_only) for i in found] == [
        ("weft.x.a", "weft.x.b", False), ("weft.x.b", "typing", False),
        ("weft.x.b", "weft.x.a", True),
    ]  # fmt: skip
    edges = {"weft.x.a": {"weft.x.b"}, "weft.x.b": {"weft.x.a"}}
    assert _cycles(edges) == [["weft.x.a", "weft.x.b"]]
