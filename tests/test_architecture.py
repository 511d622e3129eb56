"""The package's shape, checked: layers import only downwards, nothing imports in a circle, methods are
named in one table, and files stay of a readable size.

Read from the source with ``ast`` (module-level *and* in-function imports, which a runtime import graph
would miss), so the check costs no imports and holds for code paths the other tests never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from specdec.runtime.methods import METHOD_NAMES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specdec"
#: where the repository's Python lives: the package, its tests, the benchmarks and the scripts
SOURCE_DIRS = ("specdec", "tests", "benchmarks", "scripts")
#: bottom to top; a module may import its own layer and the layers below it
LAYERS: tuple[tuple[str, ...], ...] = (
    ("plugins",),
    ("models",),
    ("runtime",),
    ("serving", "export", "distill", "bench"),
    ("deploy",),
    ("cli",),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["specdec", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _python_files() -> dict[str, Path]:
    """Every Python file of the repository by its path from the root (the top level's and ``SOURCE_DIRS``')."""
    files = sorted(ROOT.glob("*.py"))
    for folder in SOURCE_DIRS:
        files += sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return {path.relative_to(ROOT).as_posix(): path for path in files}


PYTHON_FILES = _python_files()


def _imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported specdec module, line) for every import statement anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, level - 1 packages up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *filter(None, [base])])
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            if target in MODULES and target != name:
                yield target, node.lineno


GRAPH = {name: sorted(set(_imports(name, path))) for name, path in MODULES.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return None if len(parts) == 1 else parts[1]


def test_every_module_belongs_to_a_layer() -> None:
    assert not [m for m in MODULES if _layer(m) is not None and _layer(m) not in RANK]


def test_layers_import_only_downwards() -> None:
    upward = [
        f"{MODULES[a].relative_to(PACKAGE.parent)}:{line} imports {b}"
        for a, edges in GRAPH.items()
        for b, line in edges
        if _layer(a) and _layer(b) and RANK[_layer(b)] > RANK[_layer(a)]
    ]
    assert not upward, "a lower layer imports a higher one:\n" + "\n".join(upward)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in GRAPH[v]:
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

    for module in GRAPH:
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles() -> None:
    assert not _cycles()


def test_the_cycle_check_finds_a_cycle() -> None:
    """Negative control: the same check on a graph with a circle reports it."""
    saved = dict(GRAPH)
    try:
        GRAPH["specdec.runtime.packed"] = [*GRAPH["specdec.runtime.packed"], ("specdec.runtime.engine", 0)]
        assert any("specdec.runtime.packed" in c and "specdec.runtime.engine" in c for c in _cycles())
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def _method_comparisons(path: Path) -> Iterator[int]:
    """Lines comparing a value against a method name literal (``x == "ems"``, ``m in ("ar", "beam")``)."""

    def names(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in METHOD_NAMES
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(names(e) for e in node.elts)
        return False

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(names(n) for n in [node.left, *node.comparators]):
            yield node.lineno


def test_method_names_are_compared_only_in_the_method_table() -> None:
    table = PACKAGE / "runtime" / "methods.py"
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in MODULES.values()
        if path != table
        for line in _method_comparisons(path)
    ]
    assert not found, "ask specdec.runtime.methods instead of comparing method names:\n" + "\n".join(found)


def test_the_size_guard_sees_every_python_file() -> None:
    """The guard below reads tests, benchmarks and scripts too, not only the package."""
    assert {f"specdec/{p.relative_to(PACKAGE).as_posix()}" for p in MODULES.values()} <= set(PYTHON_FILES)
    assert {"tests/conftest.py", "tests/test_architecture.py"} <= set(PYTHON_FILES)
    assert any(name.startswith("benchmarks/") for name in PYTHON_FILES)


@pytest.mark.parametrize("name", sorted(PYTHON_FILES))
def test_files_stay_readable(name: str) -> None:
    lines = PYTHON_FILES[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{name} has {lines} lines: split it by concern"
