"""The code's shape: no import cycles between edgeinfer's modules, no source file over 700 lines.

The import graph is read with `ast` from every module under edgeinfer/ and the packages
installed inside it (kernels_cpu, kernels_cuda, models, tui): top-level, function-level and
type-only (`if TYPE_CHECKING:`) imports of `edgeinfer.*` names, relative ones resolved. A
type-only import never runs, but it still ties the two modules together for a reader: a
circle of them is a circle all the same (a Protocol in the lower module opens one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package name -> folder, as [tool.setuptools.package-dir] maps them
PACKAGES = {
    "edgeinfer": ROOT / "edgeinfer",
    "edgeinfer.kernels_cpu": ROOT / "kernels_cpu",
    "edgeinfer.kernels_cuda": ROOT / "kernels_cuda",
    "edgeinfer.models": ROOT / "models",
    "edgeinfer.tui": ROOT / "tui",
}
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the mapped packages."""
    out: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if any(name.startswith(other + ".") or name == other
                   for other in PACKAGES if other != pkg and other.startswith(pkg + ".")):
                continue  # a folder mapped as its own package wins
            out[name] = path
    return out


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Absolute `edgeinfer.*` names imported anywhere in `tree`, TYPE_CHECKING blocks included."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import module` imports pkg.module; `from module import name`, module
            found.update(f"{prefix}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name == "edgeinfer" or name.startswith("edgeinfer.")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        targets = set()
        for imported in _imports(tree, name, path.name == "__init__.py"):
            # the module itself, else the longest known module it lies in (`pkg.function`)
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_graph_sees_relative_and_function_level_imports():
    tree = ast.parse("from . import a\nfrom .b import c\ndef f():\n    import edgeinfer.d\n"
                     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import edgeinfer.e\n")
    # `from .b import c` names edgeinfer.kv.b.c, which _graph resolves to the module kv.b
    assert _imports(tree, "edgeinfer.kv.x", False) == {"edgeinfer.kv.a", "edgeinfer.kv.b.c", "edgeinfer.d",
                                                         "edgeinfer.e"}
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    graph = _graph()
    assert "edgeinfer.kv.paged" in graph and "edgeinfer.models.base" in graph
    assert "edgeinfer.kv.sequence" in graph["edgeinfer.kv.paged"]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "modules importing each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def _long_files() -> dict[str, int]:
    out = {}
    for folder in PACKAGES.values():
        for path in folder.rglob("*.py"):
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > MAX_LINES:
                out[path.relative_to(ROOT).as_posix()] = n
    return out


def test_no_source_file_over_700_lines():
    long = _long_files()
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_every_source_folder_is_a_package_the_wheel_ships():
    """A folder of modules missing from pyproject's `packages` is left out of the wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for name, folder in PACKAGES.items():
        for sub in [folder, *(p.parent for p in folder.rglob("*.py"))]:
            if "__pycache__" in sub.parts:
                continue
            rel = sub.relative_to(folder).parts
            package = ".".join((name, *rel))
            assert (sub / "__init__.py").is_file(), f"{sub} has modules but no __init__.py"
            assert package in listed, f"{package} is not in pyproject's packages"
