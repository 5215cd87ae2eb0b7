"""Reading data records: JSONL line by line (jobs/data/jsonl.py); JSON, CSV, Parquet, text files and a
``save_to_disk`` dir through ``datasets``.

Records are read as streams (``streaming=True``): nothing is cached on disk, rows of mixed shapes reach
the format check (which names the row) instead of failing Arrow's schema inference, and reading the
first rows at submit time costs only those rows.
"""

from __future__ import annotations

import glob
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.data.jsonl import JsonlError, read_jsonl
from jobs.paths import data_files as safe_data_files

# suffix -> (file_type, datasets builder)
_SUFFIXES = {
    ".jsonl": ("jsonl", "json"),
    ".json": ("json", "json"),
    ".csv": ("csv", "csv"),
    ".parquet": ("parquet", "parquet"),
    ".txt": ("txt", "text"),
    ".text": ("txt", "text"),
    ".md": ("txt", "text"),
}
_BUILDERS = {file_type: builder for file_type, builder in _SUFFIXES.values()}
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Record:
    """One row and where it came from, so a problem can name the file and the 1-based row (in a JSONL file
    its line, blank lines counted, as an editor and the upload check number it)."""

    file: str
    row: int
    fields: dict[str, Any]


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any((path / marker).is_file() for marker in _SAVED_MARKERS)


def data_files(path: Path, file_type: str) -> list[tuple[Path, str]]:
    """The (file, file type) pairs under ``path``: the file itself, or every data file of a directory.

    Raises:
        ValueError: nothing readable is there, or a suffix does not tell the type (set data.file_type).
    """
    if file_type == "saved" or (file_type == "auto" and is_saved_dataset(path)):
        return [(path, "saved")]
    if path.is_dir():
        # Only regular files, and no link out of the directory (a FIFO would hang the job, a link read outside).
        files = safe_data_files(path, tuple(_SUFFIXES) if file_type == "auto" else None)
        files = [p for p in files if not p.name.startswith(".")]
    else:
        files = [path]
    if not files:
        raise ValueError(f"'{path}' holds no data files ({', '.join(_SUFFIXES)}); set data.path to a file or directory")
    typed = []
    for file in files:
        kind = file_type if file_type != "auto" else _SUFFIXES.get(file.suffix, (None, None))[0]
        if kind is None:
            raise ValueError(f"cannot tell the type of '{file}' from its suffix; set data.file_type (e.g. jsonl)")
        typed.append((file, kind))
    return typed


def iter_records(path: Path, file_type: str = "auto", *, limit_per_file: int | None = None) -> Iterator[Record]:
    """Every record under ``path`` in a stable order (files sorted), or the first ``limit_per_file`` of each.

    A text file (``txt``) is one record ``{"text": <the whole file>}``, as plain-text corpora are read.
    """
    for file, kind in data_files(path, file_type):
        if kind == "jsonl":
            yield from _jsonl_records(file, limit_per_file)
            continue
        rows = _rows(file, kind)
        if limit_per_file is not None:
            rows = itertools.islice(rows, limit_per_file)
        number = 0
        try:
            for number, fields in enumerate(rows, start=1):
                yield Record(str(file), number, fields)
        except Exception as error:  # pyarrow's parse errors and the like: name the file and the row
            raise ValueError(
                f"cannot read '{file}' as {kind} after row {number}: {type(error).__name__}: {error}; "
                "check the file or set data.file_type"
            ) from None


def _jsonl_records(file: Path, limit: int | None) -> Iterator[Record]:
    """JSON Lines through the reader the upload check uses (jobs/data/jsonl.py), not ``datasets``: its JSON
    reader splits a row with a key twice into other rows, which the job then trained on. ``row`` is the line."""
    rows = read_jsonl(file)
    try:
        for number, fields in itertools.islice(rows, limit):
            yield Record(str(file), number, fields)
    except JsonlError as error:
        raise ValueError(f"cannot read '{file}': {error}") from None
    finally:
        rows.close()  # closes the file at once when the caller stops early


def _rows(file: Path, kind: str) -> Iterator[dict[str, Any]]:
    import datasets  # slow to import; only text data needs it

    datasets.disable_progress_bars()
    if kind == "saved":
        loaded = datasets.load_from_disk(str(file))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"'{file}' is a DatasetDict without a 'train' split (it has {list(loaded)})")
            loaded = loaded["train"]
        yield from loaded
        return
    options: dict[str, Any] = {"sample_by": "document"} if kind == "txt" else {}
    # `datasets` reads data_files as glob patterns: a `[` in a path is escaped, or the file matches nothing.
    stream = datasets.load_dataset(
        _BUILDERS[kind], data_files=[glob.escape(str(file))], split="train", streaming=True, **options
    )
    yield from stream
