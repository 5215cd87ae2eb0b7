"""A checkpoint's ``manifest.json``, validated: a file of the wrong shape marks its checkpoint damaged, with why,
instead of breaking every reader of the job's checkpoints.

Example:
    >>> manifest = read_manifest_file(Path("out/checkpoints/step-00000010"))
    >>> manifest.step, [f.name for f in manifest.files]
    (10, ['adapter_model.safetensors', 'training_state.pt'])
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """A ``manifest.json`` that cannot be read or has the wrong shape; the message says why."""


class ManifestFile(BaseModel):
    """One file of a checkpoint: its path relative to the checkpoint directory, size and SHA-256."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("name")
    @classmethod
    def _check_relative(cls, name: str) -> str:
        # The download routes serve exactly these names: none may leave the checkpoint directory.
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts or "\\" in name or "\0" in name:
            raise ValueError(f"{name!r} is not a path inside the checkpoint directory")
        return name


class Manifest(BaseModel):
    """What `save_checkpoint` writes: the step, when, the resolved spec, every file and the eval loss."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # a newer writer's extra keys are not damage

    step: int = Field(ge=0)
    created: str
    spec: dict[str, Any] = Field(default_factory=dict)
    files: list[ManifestFile]
    eval_loss: float | None = None


def read_manifest_file(directory: Path) -> Manifest:
    """The manifest of the checkpoint in ``directory``.

    Raises:
        FileNotFoundError: The directory has no manifest (a save in progress elsewhere, or a foreign copy).
        ManifestError: The manifest is unreadable, not JSON, or of the wrong shape; the message says which.
    """
    path = Path(directory) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as error:
        raise ManifestError(f"{MANIFEST} cannot be read: {error}") from error
    try:
        return Manifest.model_validate(json.loads(text))
    except ValueError as error:  # json.JSONDecodeError and pydantic's ValidationError are both ValueErrors
        raise ManifestError(f"{MANIFEST} is damaged: {_why(error)}") from error


def _why(error: ValueError) -> str:
    if not isinstance(error, ValidationError):
        return f"not JSON ({error})"
    problems = [
        f"{'.'.join(str(part) for part in problem['loc']) or 'the top level'}: {problem['msg']}"
        for problem in error.errors(include_url=False)
    ]
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more
