"""Opening a row's images: a local path under the data's folder or a ``data:`` URL, checked, and shrunk when huge.

An image is decoded once when the data is prepared (a missing or corrupt file refuses its row there, naming it)
and again when its batch is built; neither time does a huge image reach the processor at full size. Above
``data.max_image_pixels`` it is resized down (aspect kept) with a note in the job's log, or refused with
``data.huge_images: refuse``; above Pillow's decompression-bomb limit it is refused before it is decoded.

OpenAI's ``image_url.detail`` is acted on as OpenAI documents it for vision fine-tuning: ``low`` shows the model a
low-resolution version of the image, at most 512x512 (aspect kept here, as the model's processor then sizes it);
``high`` and ``auto`` (OpenAI's default, which picks by the image's size) the image at full resolution, within
``data.max_image_pixels`` and the processor's own limits.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.data.formats.examples import RecordError

DETAILS = ("auto", "low", "high")  # OpenAI's image_url.detail
LOW_DETAIL_SIDE = 512  # OpenAI's low detail: the model sees a 512x512 version of the image


@dataclass(frozen=True)
class ImageRef:
    """Where one image of a row comes from: a resolved file, or the bytes of a ``data:`` URL; and the
    ``image_url.detail`` it was given (None when the row names none)."""

    field: str  # the row's field that named it, for errors: messages[0].content[0].image_url.url
    path: Path | None = None
    data: bytes | None = None
    detail: str | None = None

    @property
    def label(self) -> str:
        """How samples and logs name it: the file's name, or ``data: URL``."""
        return self.path.name if self.path is not None else "data: URL"


@dataclass(frozen=True)
class OpenedImage:
    """An image as the processor gets it (RGB), and what was done to it, for the job's events."""

    image: Any
    resized: str | None = None  # shrunk to data.max_image_pixels
    low_detail: str | None = None  # shown at most 512x512 for image_url.detail=low


def image_ref(value: Any, field: str, folder: Path, detail: Any = None, detail_field: str = "") -> ImageRef:
    """The image a row names at ``field``: a path (relative to ``folder``, the data's folder, and inside it) or a
    ``data:image/...;base64,`` URL; ``detail`` is its ``image_url.detail`` (at ``detail_field``), if any.

    Raises:
        RecordError: not a string, a remote URL, a path outside ``folder``, a missing file, a bad data URL or a
            ``detail`` OpenAI does not name.
    """
    if detail is not None and detail not in DETAILS:
        raise RecordError(detail_field, f"must be one of {', '.join(DETAILS)} (OpenAI's detail); got {_shown(detail)}")
    if not isinstance(value, str) or not value.strip():
        raise RecordError(field, f"must be a local image path or a data: URL; got {_shown(value)}")
    if value.startswith("data:"):
        return ImageRef(field, data=_data_url_bytes(value, field), detail=detail)
    if value.startswith(("http://", "https://")):
        raise RecordError(
            field, "is a web URL; jobs read no network: download the image next to the data and give its path"
        )
    path = Path(value.removeprefix("file://"))
    resolved = (path if path.is_absolute() else folder / path).resolve()
    if not resolved.is_relative_to(folder.resolve()):
        raise RecordError(field, f"{value!r} lies outside the data's folder; keep images beside the data")
    if not resolved.is_file():
        raise RecordError(field, f"image {value!r} not found beside the data (paths are relative to its folder)")
    return ImageRef(field, path=resolved, detail=detail)


def open_image(ref: ImageRef, *, max_pixels: int, refuse_huge: bool) -> OpenedImage:
    """The image as RGB, at most ``max_pixels`` pixels (and within 512x512 for ``detail: low``), with a note on
    each change made to it.

    Raises:
        RecordError: the file is no image Pillow reads (corrupt, truncated, another format), or too large
            (``refuse_huge``, or past Pillow's decompression-bomb limit).
    """
    from PIL import Image

    try:
        source: Any = io.BytesIO(ref.data) if ref.data is not None else ref.path
        with Image.open(source) as image:  # reads the header only: the size is known before decoding
            width, height = image.size
            if width * height > max_pixels and refuse_huge:
                raise RecordError(
                    ref.field,
                    f"image {ref.label} is {width}x{height} ({width * height} pixels), above data.max_image_pixels="
                    f"{max_pixels}; shrink it, raise data.max_image_pixels or set data.huge_images: resize",
                )
            scale = math.sqrt(max_pixels / (width * height)) if width * height > max_pixels else 1.0
            if scale < 1.0:
                image.draft("RGB", (max(1, int(width * scale)), max(1, int(height * scale))))  # JPEG: decode smaller
            rgb = image.convert("RGB")
    except RecordError:
        raise
    except Image.DecompressionBombError as error:
        raise RecordError(ref.field, f"image {ref.label} is too large to open safely ({error})") from None
    except Exception as error:  # PIL's UnidentifiedImageError, a truncated file's OSError, ...
        raise RecordError(ref.field, f"image {ref.label} cannot be read: {type(error).__name__}: {error}") from None
    resized = None
    if scale < 1.0:
        size = (max(1, int(width * scale)), max(1, int(height * scale)))
        resized = f"{ref.label} {width}x{height} resized to {size[0]}x{size[1]} (data.max_image_pixels={max_pixels})"
        rgb = rgb.resize(size, Image.Resampling.BICUBIC)
    if ref.detail != "low" or max(rgb.size) <= LOW_DETAIL_SIDE:
        return OpenedImage(rgb, resized)
    low = rgb.copy()
    low.thumbnail((LOW_DETAIL_SIDE, LOW_DETAIL_SIDE), Image.Resampling.BICUBIC)  # aspect kept, within the square
    note = f"{ref.label} {width}x{height} shown at {low.size[0]}x{low.size[1]}"
    return OpenedImage(low, resized, note)


def _data_url_bytes(url: str, field: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.startswith("data:image/") or not header.endswith(";base64") or not payload:
        raise RecordError(field, f"a data URL must read data:image/<type>;base64,<data>; got {_shown(url)}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RecordError(field, "the data URL's base64 payload is not valid base64") from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
