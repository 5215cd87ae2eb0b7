"""Import cycles inside jobs/: none may span more than three files, and no module imports another's private name.

Every import counts, at module level and inside functions (a call-time import still ties the two modules
together); imports under ``if TYPE_CHECKING:`` do not (a type-only reference runs nothing).
Run as a script to print every cycle: ``python tests/jobs/test_import_cycles.py``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "jobs"


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """``jobs.x.y`` → its file, for every module of the package (``__init__`` as the package's name)."""
    names = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement outside ``if TYPE_CHECKING:`` blocks, at any depth."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _runtime_imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _runtime_imports(node)


def _target(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _outer_packages(importer: str, imported: str, modules: dict[str, Path]) -> set[str]:
    """The packages whose ``__init__`` importing ``imported`` runs first, less those ``importer`` sits in
    (already imported by then): ``jobs.a`` importing ``jobs.b.c`` also runs ``jobs.b``'s ``__init__``."""
    parts = imported.split(".")
    outer = {".".join(parts[:i]) for i in range(2, len(parts))}
    return {p for p in outer if p in modules and not (importer + ".").startswith(p + ".")}


def import_graph(modules: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """The runtime import edges between the package's modules, and every import of a private name."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    private = []
    for name, path in modules.items():
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.module is None or node.level:
                continue
            else:
                targets = []
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.append(submodule if submodule in modules else node.module)
                    is_private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if is_private and node.module.startswith(PACKAGE + "."):
                        private.append(f"{name} imports {node.module}.{alias.name}")
            for target in targets:
                found = _target(target, modules) if target.startswith(PACKAGE + ".") else None
                if found and found != name:
                    graph[name].add(found)
                    graph[name].update(_outer_packages(name, found, modules))
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found, key=lambda c: (-len(c), c))


def test_no_import_cycle_spans_more_than_three_files() -> None:
    graph, _ = import_graph(module_names())
    assert [c for c in cycles(graph) if len(c) > 3] == []


def test_no_module_imports_a_private_name() -> None:
    assert import_graph(module_names())[1] == []


if __name__ == "__main__":
    graph, private = import_graph(module_names())
    found = cycles(graph)
    print(f"{len(found)} import cycle(s) over {PACKAGE}/ (strongly connected modules):")
    for component in found:
        print(f"  {len(component)} files: {', '.join(component)}")
    print(f"{len(private)} import(s) of a private name:")
    for line in private:
        print(f"  {line}")
