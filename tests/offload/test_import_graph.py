"""The engine's modules import one another one way: no import cycle (a reference under ``if TYPE_CHECKING:``
may close one of at most three modules) and no private name imported from another module. Every ``import``
and ``from`` statement counts, at module level or inside a function."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "offload"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST, modules: set[str], type_only: bool = False) -> Iterator[tuple[str, str | None, bool]]:
    """(module imported, name imported from it or None, whether under ``if TYPE_CHECKING:``) for each import
    of an engine module anywhere in ``tree``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                yield from imports(ast.Module(body=[child], type_ignores=[]), modules, True)
            for child in node.orelse:
                yield from imports(ast.Module(body=[child], type_ignores=[]), modules, type_only)
        elif isinstance(node, ast.Import):
            yield from ((alias.name, None, type_only) for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    yield f"{node.module}.{alias.name}", None, type_only
                elif node.module in modules:
                    yield node.module, alias.name, type_only
        else:
            yield from imports(node, modules, type_only)


def graph() -> tuple[dict[str, dict[str, bool]], list[str]]:
    """Edges (importer -> imported -> type-only for every import of it) and the private names imported."""
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    edges: dict[str, dict[str, bool]] = {}
    private = []
    for path in files:
        source = module_name(path)
        for target, name, type_only in imports(ast.parse(path.read_text()), modules):
            if target != source:
                edges.setdefault(source, {})[target] = edges.get(source, {}).get(target, True) and type_only
            if name is not None and name.startswith("_"):
                private.append(f"{source} imports {target}.{name}")
    return edges, private


def cycles(edges: dict[str, dict[str, bool]]) -> list[tuple[list[str], bool]]:
    """Every elementary cycle once (from its smallest module), and whether it runs through a type-only edge."""
    found = []
    for start in sorted(edges):
        stack = [(start, [start], False)]
        while stack:
            node, path, typed = stack.pop()
            for target, type_only in edges.get(node, {}).items():
                if target == start:
                    found.append((path, typed or type_only))
                elif target > start and target not in path:
                    stack.append((target, [*path, target], typed or type_only))
    return found


def test_no_module_imports_a_private_name_of_another() -> None:
    assert graph()[1] == []


def test_no_import_cycle_but_short_type_only_ones() -> None:
    found = cycles(graph()[0])
    assert [" -> ".join(path) for path, typed in found if not typed] == []
    assert [" -> ".join(path) for path, typed in found if len(path) > 3] == []
