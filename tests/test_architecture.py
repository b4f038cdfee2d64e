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


@pytest.mark.parametrize("folder", ["sampler", "ops", "triton", "timm", "train", "evaluate", "reproduce"])
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


def _assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    """Fails with the path of the first circle found in ``graph`` (module -> the modules it imports)."""
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            assert state.get(target) != "open", f"{what}: " + " -> ".join([*path, module, target])
            if target not in state:
                visit(target, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


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
    _assert_acyclic(graph, "import cycle")


def _all_import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere, function-level imports included."""
    return {
        module: {target for target in _file_imports(path, modules) if target in modules and target != module}
        for module, path in modules.items()
    }


def test_no_import_circle_even_through_function_level_imports():
    # A function-level import does not fail at import time, but two modules that each reach into the other are one
    # module split in two: what both need belongs below both. Packages import their own submodules to re-export
    # them (a package's __init__ is its index, not a layer), so edges out of an __init__ do not count.
    modules = _modules()
    graph = _all_import_graph(modules)
    for module, path in modules.items():
        if path.name == "__init__.py":
            graph[module] = set()
    _assert_acyclic(graph, "import circle")


def test_train_and_evaluate_import_one_way():
    # The training loop evaluates (train -> evaluate); evaluation may build a run's model and data from its config
    # only when called (a function-level import), never when imported: the floors stay one above the other.
    modules = _modules()
    evaluate_uses_train = []
    for module, path in modules.items():
        if not module.startswith("mjp_fast.evaluate"):
            continue
        body = [
            node for node in ast.parse(path.read_text()).body if isinstance(node, (ast.Import, ast.ImportFrom, ast.If))
        ]
        evaluate_uses_train += [f"{module} -> {target}" for target in _imports(body, modules) if ".train" in target]
    assert not evaluate_uses_train, evaluate_uses_train


def test_no_function_over_100_lines_outside_triton_kernels():
    # A function a reader can hold in one sitting; a Triton kernel is one GPU program and may be longer.
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any("triton.jit" in ast.unparse(decorator) for decorator in node.decorator_list):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > 100:
                long.append(f"{path.relative_to(ROOT)}::{node.name} ({lines} lines)")
    assert not long, long
