"""Confine user-supplied paths to configured roots: specs arrive over HTTP and must not read anywhere."""

from __future__ import annotations

import difflib
import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

# Example data shipped in a source checkout (configs/data): a data root by default, so the example
# configs that name it run as shipped, from the command line and through the service.
BUNDLED_DATA = Path(__file__).resolve().parents[1] / "configs" / "data"


@dataclass(frozen=True)
class PathRoots:
    """Directories that model and data paths in a spec must stay inside.

    Relative paths in a spec are looked up under each root of their kind in turn. Symlinks are resolved
    before the check, so a link pointing out of a root is refused too.

    Example:
        >>> roots = PathRoots(model_roots=["/srv/models"], data_roots=["/srv/data"])
    """

    model_roots: list[Path] = field(default_factory=list)
    data_roots: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_roots", [Path(r).resolve() for r in self.model_roots])
        object.__setattr__(self, "data_roots", [Path(r).resolve() for r in self.data_roots])

    @classmethod
    def here(cls) -> PathRoots:
        """Both roots at the current directory: the default for local command-line use."""
        return cls(model_roots=[Path.cwd()], data_roots=[Path.cwd(), *bundled_data_roots()])


def bundled_data_roots() -> list[Path]:
    """``[configs/data]`` in a source checkout, else nothing."""
    return [BUNDLED_DATA] if BUNDLED_DATA.is_dir() else []


DEFAULT_STORAGE_DIR = Path("ferry-data")  # the service's data directory unless FERRY_DATA_DIR says otherwise


def default_model_roots(storage_dir: Path = DEFAULT_STORAGE_DIR) -> list[Path]:
    """The service's model roots when none is configured: ``<storage_dir>/models``."""
    return [Path(storage_dir) / "models"]


def default_data_roots(storage_dir: Path = DEFAULT_STORAGE_DIR) -> list[Path]:
    """The service's data roots when none is configured: ``<storage_dir>/datasets`` and the bundled example
    data (`bundled_data_roots`), so the example configs run as shipped."""
    return [Path(storage_dir) / "datasets", *bundled_data_roots()]


def confine(raw: str | Path, roots: list[Path], kind: str) -> Path:
    """Resolve ``raw`` and check that it exists inside one of ``roots``.

    A relative path is looked up under each root in turn (the first root when none holds it). A data path
    must be a regular file or a directory whose files and links all stay inside it (`data_files`): no FIFO
    that would hang a worker, no link that reads outside the roots.

    Args:
        raw: The path as written in the spec.
        roots: Allowed directories (already resolved).
        kind: "model" or "data", for the error message.

    Returns:
        The resolved absolute path.

    Raises:
        ValueError: The path escapes every root, no root is configured, does not exist, is a link loop,
            has a name the filesystem refuses, or (data) is not a regular file or a clean directory.
    """
    if not roots:
        raise ValueError(f"no {kind} roots are configured, so no {kind} path is allowed")
    path = Path(raw).expanduser()
    try:
        candidates = [path] if path.is_absolute() else [root / path for root in roots]
        chosen = next((c for c in candidates if c.exists()), candidates[0])
        resolved = chosen.resolve()
        exists = resolved.exists()
    except (OSError, RuntimeError) as error:  # a link loop, a name over 255 bytes, a path over PATH_MAX
        raise ValueError(f"'{raw}' cannot be used: {_reason(error)}") from None
    # Messages name roots by label and paths relative to them: the server's directory layout is not the user's.
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        raise ValueError(
            f"'{raw}' leads outside every {kind} root ({', '.join(root_labels(roots, kind))}); give a path "
            f"relative to a {kind} root, and copy the files in rather than linking to them"
        )
    if not exists:
        raise ValueError(_not_found(raw, path, roots, kind))
    if kind == "data":
        if resolved.is_dir():
            data_files(resolved, shown=str(raw))  # raises on a link out of the directory
        elif not resolved.is_file():
            raise ValueError(f"'{raw}' is not a regular file or a directory (a FIFO, socket or device is never read)")
    return resolved


def root_labels(roots: list[Path], kind: str) -> list[str]:
    """How messages name each root: ``data root 1``, ``data root 2 (the bundled example data)``."""
    bundled = BUNDLED_DATA.resolve()
    return [
        f"{kind} root {i}" + (" (the bundled example data)" if r == bundled else "") for i, r in enumerate(roots, 1)
    ]


def without_roots(text: str, roots: PathRoots) -> str:
    """``text`` with the server's layout taken out of the paths in it: a path under a root becomes the path
    relative to that root (as the spec wrote it), a root itself its label (``data root 1``).

    Messages built from a spec's resolved paths, and those of libraries that name the files they read
    (transformers, datasets), reach the user through this.

    Example:
        >>> without_roots("cannot read /srv/data/chats.jsonl", PathRoots(data_roots=["/srv/data"]))
        'cannot read chats.jsonl'
    """
    labelled = [
        *zip(roots.model_roots, root_labels(roots.model_roots, "model"), strict=True),
        *zip(roots.data_roots, root_labels(roots.data_roots, "data"), strict=True),
    ]
    for root, label in sorted(labelled, key=lambda pair: len(str(pair[0])), reverse=True):  # nested roots first
        prefix = str(root)
        if prefix == "/":
            continue  # a root at / would turn every absolute path relative; its paths are the user's own
        text = text.replace(prefix + "/", "").replace(prefix, label)
    return text


NEAR_NAMES_SCANNED = 5000  # entries looked at under the roots for near matches: a large root is not walked whole


def _not_found(raw: str | Path, path: Path, roots: list[Path], kind: str) -> str:
    """``'x' does not exist in data root 1 or data root 2``, with the names under the roots closest to ``x``."""
    labels = root_labels(roots, kind)
    searched = [(root, label) for root, label in zip(roots, labels, strict=True)]
    if path.is_absolute():
        searched = [(r, label) for r, label in searched if path.is_relative_to(r)] or searched
    wanted = next((path.relative_to(r).as_posix() for r, _ in searched if path.is_relative_to(r)), path.as_posix())
    names = _names_under(searched, wanted)
    near = [
        f"'{name}' in {names[name]}" if len(roots) > 1 else f"'{name}'"
        for name in difflib.get_close_matches(wanted, list(names), n=3, cutoff=0.6)
    ]
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    return f"'{raw}' does not exist in {' or '.join(label for _, label in searched)}{hint}"


def _names_under(searched: list[tuple[Path, str]], wanted: str) -> dict[str, str]:
    """Relative names of the entries under each root, as deep as ``wanted`` is, mapped to their root's label."""
    depth = wanted.count("/") + 1
    names: dict[str, str] = {}
    for root, label in searched:
        for parent, dirs, files in os.walk(root, followlinks=False):
            relative = Path(parent).relative_to(root)
            if len(relative.parts) + 1 >= depth:
                dirs.clear()  # deeper entries cannot be a near match of a name this deep
            for name in [*dirs, *files]:
                names.setdefault((relative / name).as_posix(), label)
            if len(names) >= NEAR_NAMES_SCANNED:
                return names
    return names


def data_files(directory: Path, suffixes: tuple[str, ...] | None = None, *, shown: str | None = None) -> list[Path]:
    """The regular files under ``directory`` (sorted), never following a link out of it.

    Links that stay inside are followed; one that leads outside is refused (it would read a file the roots
    exclude). FIFOs, sockets and devices are skipped: reading one hangs or never ends.

    Args:
        directory: The directory to list.
        suffixes: Only files with these suffixes; None: every regular file.
        shown: How messages name ``directory`` (the path as the spec wrote it); default: its name.

    Raises:
        ValueError: A link under ``directory`` leads outside it, or loops (named relative to ``directory``).
    """
    directory = directory.resolve()
    label = shown if shown is not None else directory.name
    found = []
    for parent, dirs, files in os.walk(directory, followlinks=False):
        for name in [*dirs, *files]:
            entry = Path(parent) / name
            if entry.is_symlink():
                try:
                    target = entry.resolve(strict=True)
                except (OSError, RuntimeError) as error:
                    where = entry.relative_to(directory).as_posix()
                    raise ValueError(
                        f"{where} in '{label}' is a broken link or a link loop ({_reason(error)})"
                    ) from None
                if not target.is_relative_to(directory):
                    raise ValueError(
                        f"{entry.relative_to(directory).as_posix()} in '{label}' links outside it; copy the file in "
                        "instead of linking to it"
                    )
                if target.is_dir():
                    continue  # its files are under `directory` already, or will be walked there
            if name in files and _is_regular(entry) and (suffixes is None or entry.suffix in suffixes):
                found.append(entry)
    return sorted(found)


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.errno == errno.ENAMETOOLONG:
        return "a name in it is longer than the filesystem allows (255 bytes per name)"
    if isinstance(error, RuntimeError) or (isinstance(error, OSError) and error.errno == errno.ELOOP):
        return "it is a symbolic link loop"
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error)
