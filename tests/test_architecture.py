"""docs/architecture.md stays true: its "uses" columns are the package's imports, computed from the source."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mjp_fast"
DOC = ROOT / "docs" / "architecture.md"


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package by its ``__init__``)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(nodes: list[ast.AST], modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``nodes`` import, anywhere inside them (function-level imports too); ``from A
    import b`` counts as ``A.b`` when that is a module (or the compiled ``mjp_fast._C``), else as ``A``."""
    found = set()
    for node in (inner for outer in nodes for inner in ast.walk(outer)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules or name == "mjp_fast._C" else node.module)
    return {name for name in found if name.split(".")[0] == "mjp_fast"}


def _file_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    return _imports([ast.parse(path.read_text())], modules)


def _unit(module: str) -> str:
    """A module's row in the package table: its top-level file or folder, ``mjp_fast`` for the package's own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "mjp_fast"


def _tables() -> dict[str, dict[str, set[str]]]:
    """``{section: {first column: uses}}`` of the doc's tables; section ``""`` is the package table, else the
    folder (``sampler``, ``ops``, ``triton``)."""
    tables: dict[str, dict[str, set[str]]] = defaultdict(dict)
    section = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            folder = re.match(r"## `mjp_fast/(\w+)/`", line)
            section = folder.group(1) if folder else ""
        elif section is not None and line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            name = re.match(r"`([^`]+)`", cells[0]).group(1)
            tables[section][name] = set(re.findall(r"`([\w.]+)`", cells[2]))
    return tables


def _row_name(first_column: str) -> str:
    """``mjp_fast/nn.py`` -> ``nn``, ``mjp_fast/train/`` -> ``train``, ``mjp_fast/__init__.py`` -> ``mjp_fast``,
    ``csrc/`` -> ``_C``."""
    if first_column == "csrc/":
        return "_C"
    if first_column == "mjp_fast/__init__.py":
        return "mjp_fast"
    return first_column.removeprefix("mjp_fast/").removesuffix("/").removesuffix(".py")


def test_the_package_table_is_the_import_graph():
    modules = _modules()
    actual: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        unit = _unit(module)
        actual[unit] |= {_unit(target) for target in _file_imports(path, modules)} - {unit}
    documented = {_row_name(name): uses for name, uses in _tables()[""].items()}
    assert set(documented) == {_unit(module) for module in modules} | {"_C"}
    for unit, uses in documented.items():
        assert uses == actual.get(unit, set()), f"{unit}: documented {sorted(uses)}, imports {sorted(actual[unit])}"


@pytest.mark.parametrize("folder", ["sampler", "ops", "triton", "timm"])
def test_each_folder_table_is_its_import_graph(folder):
    modules = _modules()
    prefix = f"mjp_fast.{folder}."
    documented = _tables()[folder]
    files = {module.removeprefix(prefix): path for module, path in modules.items() if module.startswith(prefix)}
    assert {name.removesuffix(".py") for name in documented} == set(files)
    for name, path in files.items():
        uses = set()
        for target in _file_imports(path, modules):
            uses.add(target.removeprefix(prefix) if target.startswith(prefix) else _unit(target))
        assert documented[f"{name}.py"] == uses, f"{folder}/{name}.py: documented {documented[f'{name}.py']}"


def test_the_package_has_no_import_cycle():
    # Only module-level imports (an ``if`` around them included) can make a cycle: function-level ones (train and
    # evaluate, the cli's subcommands) run at call time. ``from mjp_fast.sampler import reference`` is an edge to
    # the submodule, which Python reaches through the package's __init__ (run first, so not an edge).
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        body = [
            node for node in ast.parse(path.read_text()).body if isinstance(node, (ast.Import, ast.ImportFrom, ast.If))
        ]
        graph[module] = {target for target in _imports(body, modules) if target in modules and target != module}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            assert state.get(target) != "open", "import cycle: " + " -> ".join([*path, module, target])
            if target not in state:
                visit(target, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
