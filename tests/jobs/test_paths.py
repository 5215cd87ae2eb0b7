"""Path confinement: specs may only name files inside the configured roots."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.paths import PathRoots, confine


def test_relative_paths_resolve_against_the_first_root(tmp_path: Path) -> None:
    (tmp_path / "a" / "file.txt").parent.mkdir()
    (tmp_path / "a" / "file.txt").write_text("x")
    assert confine("a/file.txt", [tmp_path], "data") == tmp_path / "a" / "file.txt"


@pytest.mark.parametrize("raw", ["../etc/passwd", "/etc/passwd", "a/../../x"])
def test_escapes_are_refused(tmp_path: Path, raw: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(ValueError, match="outside the allowed data roots"):
        confine(raw, [root], "data")


def test_symlink_out_of_a_root_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(ValueError, match="outside"):
        confine("link", [root], "model")


def test_missing_path_and_no_roots(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        confine("nope", [tmp_path], "model")
    with pytest.raises(ValueError, match="no model roots are configured"):
        confine("x", [], "model")


def test_roots_are_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    roots = PathRoots(model_roots=["."], data_roots=[tmp_path / "d" / ".."])
    assert roots.model_roots == [tmp_path] and roots.data_roots == [tmp_path]
    assert PathRoots.here().model_roots == [tmp_path]
