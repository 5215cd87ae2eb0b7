"""Image/video + caption datasets, resized to a pixel budget, in aspect buckets.

Two layouts: DiffSynth-Studio's, a folder with ``metadata.csv`` (or ``metadata.json``: a list of objects) whose
rows name an ``image`` (or ``video``) path relative to the folder and a ``prompt``; or, without a metadata file,
kohya's and ai-toolkit's caption folders (captions.py). Rows are checked when the spec is loaded (every
unreadable row and every image without a caption is named then), pixels are read only when a sample is encoded.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jobs.errors import Problem
from jobs.models.diffusion.data.captions import caption_rows, scan_caption_folder, with_trigger
from jobs.models.diffusion.data.rows import Row

if TYPE_CHECKING:
    from jobs.models.diffusion.spec import ImageCaptionDataSpec

SIDE_MULTIPLE = 16  # VAE factor 8 x patch 2, for Qwen-Image and Wan alike
_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def metadata_file(spec: ImageCaptionDataSpec) -> Path:
    """The metadata file: ``data.metadata``, else ``metadata.csv`` or ``metadata.json`` in the folder."""
    if spec.metadata is not None:
        return spec.path / spec.metadata
    for name in ("metadata.csv", "metadata.json"):
        if (spec.path / name).is_file():
            return spec.path / name
    return spec.path / "metadata.csv"


def uses_caption_files(spec: ImageCaptionDataSpec) -> bool:
    """The caption-folder layout: no ``data.metadata`` and no metadata file in the folder."""
    return spec.metadata is None and not any((spec.path / n).is_file() for n in ("metadata.csv", "metadata.json"))


def read_rows(spec: ImageCaptionDataSpec) -> list[Row]:
    """Every sample, its caption with the trigger word (raises ValueError naming the file and what is missing)."""
    rows = caption_rows(spec) if uses_caption_files(spec) else _metadata_rows(spec)
    if not spec.trigger_word:
        return rows
    return [Row(r.index, r.media, with_trigger(r.prompt, spec.trigger_word), r.is_video, r.repeats) for r in rows]


def _metadata_rows(spec: ImageCaptionDataSpec) -> list[Row]:
    file = metadata_file(spec)
    if not file.is_file():
        raise ValueError(f"{file} not found; put metadata.csv or metadata.json in data.path, or set data.metadata")
    if file.suffix == ".json":
        records = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise ValueError(f"{file} must hold a JSON list of objects with 'image' (or 'video') and 'prompt'")
    else:
        with file.open(newline="", encoding="utf-8") as handle:
            records = list(csv.DictReader(handle))
    if not records:
        raise ValueError(f"{file} has no rows")
    column = "video" if "video" in records[0] and "image" not in records[0] else "image"
    missing = {column, "prompt"} - set(records[0])
    if missing:
        raise ValueError(
            f"{file} lacks column(s) {sorted(missing)}; DiffSynth's layout has 'image' (or 'video') and 'prompt'"
        )
    return [
        Row(i, spec.path / str(r[column]), str(r["prompt"] or ""), column == "video") for i, r in enumerate(records)
    ]


def metadata_problems(spec: ImageCaptionDataSpec) -> list[Problem]:
    """Submit-time checks: the metadata reads, and every image opens (each bad row named, up to 10); in a caption
    folder every image has its caption file and opens (each bad file named, up to 10)."""
    if uses_caption_files(spec):
        return _caption_folder_problems(spec)
    try:
        rows = read_rows(spec)
    except (OSError, ValueError) as exc:
        return [("metadata" if spec.metadata else "path", str(exc))]
    bad = [f"row {row.index} ({row.media.name}): {problem}" for row, problem in _unopened(rows)]
    if bad:
        shown = "; ".join(bad[:10]) + (f"; and {len(bad) - 10} more" if len(bad) > 10 else "")
        return [("path", f"{len(bad)} of {len(rows)} rows of {metadata_file(spec).name} do not open: {shown}")]
    return []


def _caption_folder_problems(spec: ImageCaptionDataSpec) -> list[Problem]:
    rows, missing = scan_caption_folder(spec)
    if not rows and not missing:
        try:
            caption_rows(spec)
        except ValueError as exc:
            return [("path", str(exc))]
    bad = missing + [f"{row.media.relative_to(spec.path)}: {problem}" for row, problem in _unopened(rows)]
    if bad:
        shown = "; ".join(bad[:10]) + (f"; and {len(bad) - 10} more" if len(bad) > 10 else "")
        images = len(rows) + len(missing)
        return [("path", f"{len(bad)} of {images} images in {spec.path} cannot be used: {shown}")]
    return []


def _unopened(rows: list[Row]) -> list[tuple[Row, str]]:
    """Each row whose media does not open, with why."""
    from PIL import Image, UnidentifiedImageError

    bad = []
    for row in rows:
        try:
            if row.is_video:
                _check_video(row.media)
            else:
                with Image.open(row.media) as image:
                    image.verify()  # reads the header and structure, not the pixels
        except (OSError, ValueError, UnidentifiedImageError) as exc:
            bad.append((row, f"{type(exc).__name__}: {exc}"))
    return bad


def _check_video(path: Path) -> None:
    if path.is_dir():
        if not _frame_files(path):
            raise ValueError(f"frame folder {path} holds no {'/'.join(_FRAME_SUFFIXES)} files")
    elif not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")


def _frame_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in _FRAME_SUFFIXES)


def target_size(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) after scaling down to ``max_pixels`` (never up) and flooring to multiples of 16."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    w = max(SIDE_MULTIPLE, int(width * scale) // SIDE_MULTIPLE * SIDE_MULTIPLE)
    h = max(SIDE_MULTIPLE, int(height * scale) // SIDE_MULTIPLE * SIDE_MULTIPLE)
    return w, h


def image_size(row: Row) -> tuple[int, int]:
    """(width, height) of the row's image or first frame, from its header."""
    from PIL import Image

    with Image.open(_frame_files(row.media)[0] if row.is_video and row.media.is_dir() else row.media) as image:
        return image.size


def load_pixels(row: Row, size: tuple[int, int], num_frames: int) -> torch.Tensor:
    """The row as ``[3, frames, height, width]`` in [-1, 1]: resized to cover ``size``, center-cropped."""
    from PIL import Image

    if row.is_video:
        frames = _video_frames(row.media, num_frames)
    else:
        with Image.open(row.media) as image:
            frames = [image.convert("RGB")]
    return torch.stack([_to_tensor(_cover_crop(frame, size)) for frame in frames], dim=1)


def _cover_crop(image: Any, size: tuple[int, int]) -> Any:
    from PIL import Image

    w, h = size
    scale = max(w / image.width, h / image.height)
    resized = image.resize(
        (max(w, round(image.width * scale)), max(h, round(image.height * scale))), Image.Resampling.BICUBIC
    )
    left, top = (resized.width - w) // 2, (resized.height - h) // 2
    return resized.crop((left, top, left + w, top + h))


def _to_tensor(image: Any) -> torch.Tensor:
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(image.height, image.width, 3)
    return data.permute(2, 0, 1).float() / 127.5 - 1.0


def _video_frames(path: Path, num_frames: int) -> list:
    """The first ``num_frames`` frames of a frame folder, or of a video file through imageio."""
    from PIL import Image

    if path.is_dir():
        files = _frame_files(path)
        frames = [Image.open(f).convert("RGB") for f in files[:num_frames]]
    else:
        try:
            import imageio.v3 as iio
        except ImportError as exc:
            raise ValueError(
                f"reading {path.name} needs imageio: pip install 'ferry[video]', or use frame folders"
            ) from exc
        frames = [Image.fromarray(f) for _, f in zip(range(num_frames), iio.imiter(path), strict=False)]
    if len(frames) < num_frames:
        raise ValueError(f"{path} has {len(frames)} frames; data.num_frames asks for {num_frames}")
    return frames


def bucketed_batches(sizes: list[tuple[int, ...]], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches of sample indices: a seeded shuffle, then each batch filled from one size bucket.

    A bucket's leftover (fewer than ``batch_size`` samples at the end of the epoch) is dropped, so every
    batch stacks into one tensor.
    """
    order = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    pending: dict[tuple[int, ...], list[int]] = {}
    batches = []
    for index in order:
        bucket = pending.setdefault(sizes[index], [])
        bucket.append(index)
        if len(bucket) == batch_size:
            batches.append(bucket.copy())
            bucket.clear()
    return batches
