"""The floors of the house: imports point down, never up (docs/architecture.md draws them).

``service → jobs → offload``; inside ``jobs``, ``train/`` is the top floor (only the CLI and the package's
face import it) and ``recompute/`` the ground floor (it imports nothing else from ``jobs``); inside
``service``, the queue and the checker sit below the web layer. Every import statement counts, at module
level or inside a function (a call-time import ties the modules as firmly), except those under
``if TYPE_CHECKING:``, which run nothing. Run as a script to print every broken rule:
``python tests/test_layers.py``.
"""

from __future__ import annotations

import ast
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("offload", "jobs", "service")

# (importer prefix, imported prefix, why): an importer at or under the first may not import the second.
RULES = [
    ("offload", "jobs", "offload/ is the engine alone: it knows no job"),
    ("offload", "service", "offload/ is the engine alone: it knows no service"),
    ("jobs", "service", "jobs/ runs without the service (CLI, tests, a Ray worker)"),
    *(
        (f"jobs.{room}", "jobs.train", "jobs/train/ is the top floor: the rooms below never import it")
        for room in ("models", "recompute", "checkpoints", "evaluate", "distributed", "data", "spec", "objectives")
    ),
    *(
        ("jobs.recompute", f"jobs.{room}", "jobs/recompute/ is the ground floor: it imports nothing else from jobs")
        for room in ("models", "checkpoints", "evaluate", "distributed", "data", "spec", "objectives", "fit")
    ),
    ("service.queue", "service.api", "the queue sits below the web layer"),
    ("service.checking", "service.api", "the checker sits below the web layer"),
]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module) for every absolute import outside ``if TYPE_CHECKING:`` blocks, at any depth."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        yield from _imports(node)


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def broken_rules(root: Path = ROOT) -> list[str]:
    """Every import under ``root``'s packages that a rule forbids, as ``file:line: a imports b (why)``."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            importer = _module_name(path, root)
            seen = set()
            for line, imported in _imports(ast.parse(path.read_text(), str(path))):
                for source, target, why in RULES:
                    key = (line, source, target)
                    if key not in seen and _under(importer, source) and _under(imported, target):
                        seen.add(key)
                        found.append(f"{path.relative_to(root)}:{line}: {importer} imports {imported} ({why})")
    return found


def test_imports_point_down_the_floors() -> None:
    assert broken_rules() == []


def _copy_of_the_packages(destination: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, destination / package, ignore=shutil.ignore_patterns("node_modules", "*.pyc"))
    return destination


def test_a_planted_upward_import_is_caught(tmp_path: Path) -> None:
    """The rules can fail: an import of the trainer planted in a model file (inside a function, as a lazy import
    would be) and one of the web layer planted in the queue are each reported, with their file and line."""
    root = _copy_of_the_packages(tmp_path)
    model = root / "jobs" / "models" / "toy_mlp.py"
    model.write_text(model.read_text() + "\n\ndef _planted() -> None:\n    from jobs.train.runner import run_job\n")
    queue = root / "service" / "queue" / "store.py"
    queue.write_text("import service.api.errors\n" + queue.read_text())
    found = broken_rules(root)
    lines = len(model.read_text().splitlines())
    assert f"jobs/models/toy_mlp.py:{lines}: jobs.models.toy_mlp imports jobs.train.runner" in "\n".join(found)
    assert any(line.startswith("service/queue/store.py:1: service.queue.store imports service.api") for line in found)
    assert len(found) == 2  # one finding per planted import (a from-import names its module and its name)


def test_a_type_only_import_is_allowed(tmp_path: Path) -> None:
    root = _copy_of_the_packages(tmp_path)
    model = root / "jobs" / "models" / "toy_mlp.py"
    planted = "\nif TYPE_CHECKING:\n    from jobs.train.session import TrainingSession\n"
    model.write_text("from typing import TYPE_CHECKING\n" + model.read_text() + planted)
    assert broken_rules(root) == []


if __name__ == "__main__":
    problems = broken_rules()
    print("\n".join(problems) or "every import points down")
    sys.exit(1 if problems else 0)
