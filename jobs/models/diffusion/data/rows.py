"""One sample of an image/video + caption dataset, whichever layout it came from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Row:
    """One sample: its position in the dataset, the media path, the caption, and its repeats per epoch."""

    index: int
    media: Path
    prompt: str
    is_video: bool
    repeats: int = 1
