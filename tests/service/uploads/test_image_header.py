"""The format and colour mode read from an image file's first bytes, with Pillow (which decodes the file) as the
oracle, over the files Pillow writes: every PNG colour type, baseline and progressive JPEGs with EXIF and ICC
segments before the frame, WEBP; a header cut short says nothing rather than failing."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from service.uploads.image_header import image_format, image_mode


def saved(mode: str, kind: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (30, 20)).save(buffer, format=kind, **options)
    return buffer.getvalue()


CASES = [
    (saved("RGB", "PNG"), "png"),
    (saved("RGBA", "PNG"), "png"),
    (saved("L", "PNG"), "png"),
    (saved("LA", "PNG"), "png"),
    (saved("P", "PNG"), "png"),
    (saved("RGB", "JPEG"), "jpeg"),
    (saved("L", "JPEG"), "jpeg"),
    (saved("CMYK", "JPEG"), "jpeg"),
    (saved("RGB", "JPEG", progressive=True), "jpeg"),
    (saved("RGB", "JPEG", exif=b"Exif\x00\x00" + bytes(64), icc_profile=bytes(300)), "jpeg"),
    (saved("RGB", "WEBP"), "webp"),
    (saved("RGBA", "WEBP"), "webp"),
    (saved("RGB", "WEBP", lossless=True), "webp"),
    (saved("RGBA", "WEBP", lossless=True), "webp"),
    (saved("P", "GIF"), "gif"),
]


@pytest.mark.parametrize(("data", "kind"), CASES, ids=[f"{i}-{k}" for i, (_, k) in enumerate(CASES)])
def test_the_header_names_the_format_and_the_mode_pillow_opens(data: bytes, kind: str) -> None:
    assert image_format(data) == kind
    with Image.open(io.BytesIO(data)) as image:
        expected = image.mode
    if kind != "gif":  # a GIF's mode is not read: OpenAI's vision fine-tuning takes no GIF
        assert image_mode(kind, data) == expected


@pytest.mark.parametrize("kind", ["png", "jpeg", "webp"])
def test_a_header_cut_short_gives_no_mode(kind: str) -> None:
    data = saved("RGB", kind.upper())
    for length in (0, 3, 8, 12):
        assert image_mode(kind, data[:length]) is None
    assert image_format(b"not an image") is None
