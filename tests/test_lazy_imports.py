"""``jobs`` and ``offload`` import their names on first use, so their torch-free modules stay torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

import jobs
import offload

HEAVY = ("torch", "transformers", "diffusers", "peft", "datasets")


@pytest.mark.parametrize(
    "module",
    [
        "jobs.events",
        "jobs.checkpoints.directory",
        "jobs.spec.text",
        "jobs.data.formats.chat",
        "offload.stats",
        "offload",
    ],
)
def test_light_modules_do_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import {module} pulled in {out.strip()}"


@pytest.mark.parametrize("package", [jobs, offload])
def test_every_public_name_resolves(package: object) -> None:
    names = package.__all__  # type: ignore[attr-defined]
    assert sorted(names) == sorted(package._HOME)  # type: ignore[attr-defined]
    for name in names:
        assert getattr(package, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        package.nothing_here  # type: ignore[attr-defined]  # noqa: B018
