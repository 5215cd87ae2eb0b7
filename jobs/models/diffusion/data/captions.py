"""Caption folders, the kohya / ai-toolkit layout: images with a caption sidecar each, and repeats per folder.

A dataset without a metadata file is a folder of images (``.png .jpg .jpeg .webp .bmp``, in it or in its
subfolders), each beside a caption file of the same name with ``data.caption_extension`` (``.txt``):
``cat_01.png`` + ``cat_01.txt``. A subfolder named ``<N>_<name>`` (kohya's ``10_sks dog``) serves its images N
times per epoch, on top of ``data.repeat``. A caption may hold ``[trigger]``, replaced by ``data.trigger_word``;
otherwise the trigger word is put in front of the caption (``"sks dog, a photo on a beach"``).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.models.diffusion.data.rows import Row

if TYPE_CHECKING:
    from jobs.models.diffusion.spec import ImageCaptionDataSpec

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_REPEATS = re.compile(r"^(\d+)_.+")  # kohya's "10_name" folder prefix
TRIGGER = "[trigger]"


def with_trigger(caption: str, trigger_word: str | None) -> str:
    """``caption`` with ``[trigger]`` replaced by the trigger word, or the word put in front (ai-toolkit's rule)."""
    if not trigger_word:
        return caption
    if TRIGGER in caption:
        return caption.replace(TRIGGER, trigger_word)
    return f"{trigger_word}, {caption}" if caption else trigger_word


def folder_repeats(image: Path, root: Path) -> int:
    """The repeats of the first folder under ``root`` on the image's path named ``<N>_<name>``, else 1."""
    for part in image.relative_to(root).parts[:-1]:
        match = _REPEATS.match(part)
        if match:
            return max(1, int(match.group(1)))
    return 1


def scan_caption_folder(spec: ImageCaptionDataSpec) -> tuple[list[Row], list[str]]:
    """The folder's images with their captions as rows (sorted by path), and each image without a caption file
    named (``dogs/cat_01.png: no caption file cat_01.txt``)."""
    root = Path(spec.path)
    images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    rows: list[Row] = []
    missing: list[str] = []
    for image in images:
        caption = image.with_suffix(spec.caption_extension)
        if not caption.is_file():
            missing.append(f"{image.relative_to(root)}: no caption file {caption.name}")
            continue
        text = caption.read_text(encoding="utf-8", errors="replace").strip()
        rows.append(Row(len(rows), image, text, False, folder_repeats(image, root)))
    return rows, missing


def caption_rows(spec: ImageCaptionDataSpec) -> list[Row]:
    """Every captioned image (raises ValueError when there is none, or when an image lacks its caption)."""
    rows, missing = scan_caption_folder(spec)
    if missing:
        raise ValueError(f"{len(missing)} images in {spec.path} have no caption: {'; '.join(missing[:10])}")
    if not rows:
        raise ValueError(
            f"{spec.path} holds no metadata.csv or metadata.json and no images ({'/'.join(IMAGE_SUFFIXES)}) with "
            f"{spec.caption_extension} captions; give one of the two layouts"
        )
    return rows


def captions_sha256(spec: ImageCaptionDataSpec) -> str:
    """SHA-256 over every row's relative path, caption and repeats: a cache fingerprint's metadata hash."""
    from jobs.models.diffusion.data.images import read_rows

    rows = [[str(r.media.relative_to(spec.path)), r.prompt, r.repeats] for r in read_rows(spec)]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()
