"""Path confinement: specs may only name files inside the configured roots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jobs.paths import PathRoots, confine, data_files


def test_relative_paths_resolve_against_the_first_root(tmp_path: Path) -> None:
    (tmp_path / "a" / "file.txt").parent.mkdir()
    (tmp_path / "a" / "file.txt").write_text("x")
    assert confine("a/file.txt", [tmp_path], "data") == tmp_path / "a" / "file.txt"


@pytest.mark.parametrize("raw", ["../etc/passwd", "/etc/passwd", "a/../../x"])
def test_escapes_are_refused(tmp_path: Path, raw: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(ValueError) as refused:
        confine(raw, [root], "data")
    assert str(refused.value) == (
        f"'{raw}' leads outside every data root (data root 1); give a path relative to a data root, and copy "
        "the files in rather than linking to them"
    )
    assert str(tmp_path) not in str(refused.value) and "/etc/passwd" not in str(refused.value).replace(raw, "")


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


def test_a_relative_path_is_looked_up_under_each_root(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    (second / "corpus.txt").write_text("x")
    assert confine("corpus.txt", [first, second], "data") == second / "corpus.txt"


def test_a_link_inside_a_data_directory_may_not_lead_out(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "secret.txt"
    (root / "corpus").mkdir(parents=True)
    outside.write_text("not for training")
    (root / "corpus" / "a.txt").write_text("fine")
    (root / "corpus" / "b.txt").symlink_to(outside)
    with pytest.raises(ValueError) as refused:
        confine("corpus", [root], "data")
    assert str(refused.value) == "b.txt in 'corpus' links outside it; copy the file in instead of linking to it"
    with pytest.raises(ValueError, match="outside"):
        confine(".", [root], "data")


def test_data_files_follow_links_inside_and_skip_fifos(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub" / "b.txt").symlink_to(tmp_path / "a.txt")
    os.mkfifo(tmp_path / "pipe.txt")  # reading it would block the job for ever
    assert data_files(tmp_path, (".txt",)) == [tmp_path / "a.txt", tmp_path / "sub" / "b.txt"]
    with pytest.raises(ValueError, match="not a regular file or a directory"):
        confine("pipe.txt", [tmp_path], "data")


def test_link_loops_and_overlong_names_are_problems_not_crashes(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ValueError, match="'loop' cannot be used: it is a symbolic link loop"):
        confine("loop", [tmp_path], "data")
    with pytest.raises(ValueError, match="longer than the filesystem allows"):
        confine("a" * 300, [tmp_path], "data")


def test_not_found_names_every_root_searched_and_near_names_never_absolute_paths(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    (first / "sub").mkdir(parents=True), second.mkdir()
    (first / "chat.jsonl").write_text("x")
    (first / "sub" / "train.jsonl").write_text("x")
    (second / "chats.jsonl").write_text("x")
    expected = {
        "chat.json": "'chat.json' does not exist in data root 1 or data root 2; did you mean 'chat.jsonl' in "
        "data root 1 or 'chats.jsonl' in data root 2?",
        "sub/trian.jsonl": "'sub/trian.jsonl' does not exist in data root 1 or data root 2; did you mean "
        "'sub/train.jsonl' in data root 1?",
        "nothing-like-it": "'nothing-like-it' does not exist in data root 1 or data root 2",
    }
    for raw, message in expected.items():
        with pytest.raises(ValueError) as refused:
            confine(raw, [first, second], "data")
        assert str(refused.value) == message
    with pytest.raises(ValueError) as refused:  # an absolute path: only the root it lies in was searched
        confine(first / "chat.jsonx", [first, second], "data")
    assert str(refused.value).endswith("does not exist in data root 1; did you mean 'chat.jsonl' in data root 1?")


def test_the_bundled_data_root_is_named_so() -> None:
    from jobs.paths import BUNDLED_DATA, root_labels

    assert root_labels([Path("/srv/x"), BUNDLED_DATA], "data") == [
        "data root 1",
        "data root 2 (the bundled example data)",
    ]


def test_without_roots_names_paths_relative_to_the_root_holding_them(tmp_path: Path) -> None:
    from jobs.paths import without_roots

    outer, inner = tmp_path / "data", tmp_path / "data" / "shared"
    roots = PathRoots(model_roots=[tmp_path / "models"], data_roots=[outer, inner])
    text = f"cannot read {inner}/a.jsonl nor {outer}/b/c.csv; {tmp_path / 'models'} is empty"
    assert without_roots(text, roots) == "cannot read a.jsonl nor b/c.csv; model root 1 is empty"
