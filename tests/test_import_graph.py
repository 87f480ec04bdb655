"""The front ends' import rules: server modules share helpers without going through the app
module, and commands share flags without going through `edgeinfer run`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "edgeinfer"


def _imported(path: Path, package: str) -> set[str]:
    """Every dotted name a module imports, top-level or inside functions, relative ones resolved
    (`from a import b` counts as both `a` and `a.b`: b may be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def _importers(folder: str, target: str) -> list[str]:
    package = "edgeinfer." + folder
    return sorted(p.name for p in (ROOT / folder).glob("*.py") if target in _imported(p, package))


def test_the_import_reader_sees_function_level_and_relative_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from . import app\nfrom ..commands.run import x\ndef f():\n    import edgeinfer.server.app\n")
    assert {"edgeinfer.server", "edgeinfer.server.app", "edgeinfer.commands.run",
            "edgeinfer.commands.run.x"} <= _imported(f, "edgeinfer.server")
    g = tmp_path / "n.py"
    g.write_text("def f():\n    from edgeinfer.commands.run_model import y\n")
    assert "edgeinfer.commands.run" not in _imported(g, "edgeinfer.commands")


def test_only_the_server_package_imports_the_app_module():
    assert _importers("server", "edgeinfer.server.app") == ["__init__.py"]


def test_commands_other_than_run_do_not_import_it():
    assert _importers("commands", "edgeinfer.commands.run") == []
