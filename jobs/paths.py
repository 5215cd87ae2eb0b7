"""Confine user-supplied paths to configured roots: specs arrive over HTTP and must not read anywhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class PathRoots:
    """Directories that model and data paths in a spec must stay inside.

    Relative paths in a spec are resolved against the first root of their kind. Symlinks are resolved
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
        return cls(model_roots=[Path.cwd()], data_roots=[Path.cwd()])


def confine(raw: str | Path, roots: list[Path], kind: str) -> Path:
    """Resolve ``raw`` and check that it exists inside one of ``roots``.

    Args:
        raw: The path as written in the spec.
        roots: Allowed directories (already resolved).
        kind: "model" or "data", for the error message.

    Returns:
        The resolved absolute path.

    Raises:
        ValueError: The path escapes every root, no root is configured, or the path does not exist.
    """
    if not roots:
        raise ValueError(f"no {kind} roots are configured, so no {kind} path is allowed")
    path = Path(raw).expanduser()
    resolved = (path if path.is_absolute() else roots[0] / path).resolve()
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise ValueError(f"'{raw}' resolves to {resolved}, outside the allowed {kind} roots ({allowed})")
    if not resolved.exists():
        raise ValueError(f"'{raw}' does not exist (looked at {resolved})")
    return resolved
