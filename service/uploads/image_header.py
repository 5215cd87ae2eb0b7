"""What an image file's first bytes say, read without decoding it: its format and its colour mode.

The API process checks uploads with no image library (it reads JSON), so the colour mode OpenAI's vision
fine-tuning asks for (RGB or RGBA) is read from the header each format defines: a PNG's ``IHDR`` colour type, a
JPEG's frame header (``SOFn``: its number of components), a WEBP's first chunk (alpha or none).
The modes are named as Pillow names what it opens, since that is how OpenAI's rule is stated.

Example:
    image_format(data)     # "png", "jpeg", "webp", "gif" or None
    image_mode("png", data)  # "RGB", "RGBA", "L", "LA", "P", ... or None where the header is cut short
"""

from __future__ import annotations

# Each format by the first bytes of its file.
SIGNATURES = {
    "png": (b"\x89PNG\r\n\x1a\n",),
    "jpeg": (b"\xff\xd8\xff",),
    "webp": (b"RIFF",),  # and "WEBP" at byte 8, checked below
    "gif": (b"GIF87a", b"GIF89a"),
}
PNG_MODES = {0: "L", 2: "RGB", 3: "P", 4: "LA", 6: "RGBA"}  # IHDR's colour type, as Pillow opens it
JPEG_MODES = {1: "L", 3: "RGB", 4: "CMYK"}  # the frame's components (YCbCr opens as RGB)
# The JPEG markers that start a frame header (SOF0..SOF15 but DHT, JPG and DAC, which share the range).
JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def image_format(data: bytes) -> str | None:
    """The format whose signature ``data`` starts with (``png``, ``jpeg``, ``webp``, ``gif``), None for none."""
    for kind, signatures in SIGNATURES.items():
        if data.startswith(signatures) and (kind != "webp" or data[8:12] == b"WEBP"):
            return kind
    return None


def image_mode(kind: str, data: bytes) -> str | None:
    """The colour mode of an image of format ``kind``: Pillow's name for it; None where the header is cut short
    (the job's own check, which decodes the image, then names it corrupt)."""
    if kind == "png":
        if len(data) < 26 or data[12:16] != b"IHDR":  # IHDR comes first; its colour type is byte 25
            return None
        return PNG_MODES.get(data[25], f"colour type {data[25]}")
    if kind == "jpeg":
        return _jpeg_mode(data)
    if kind == "webp":
        return _webp_mode(data)
    return None


def _webp_mode(data: bytes) -> str | None:
    """RGBA where the first chunk says the image has alpha, else RGB: a WEBP opens in no other mode."""
    chunk = data[12:16]
    if chunk == b"VP8X" and len(data) > 20:
        return "RGBA" if data[20] & 0x10 else "RGB"  # the extended header's alpha flag
    if chunk == b"VP8L" and len(data) >= 25:
        return "RGBA" if int.from_bytes(data[21:25], "little") >> 28 & 1 else "RGB"  # lossless: alpha_is_used
    return "RGB" if chunk == b"VP8 " else None  # lossy without an extended header: no alpha


def _jpeg_mode(data: bytes) -> str | None:
    """The mode a JPEG's frame header gives, walking the marker segments before it."""
    at = 2  # past the start-of-image marker
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None  # no marker where one must be: a broken file, left to the job's check
        marker = data[at + 1]
        if marker == 0xFF or marker == 0x01 or 0xD0 <= marker <= 0xD8:  # fill byte, TEM, RSTn, SOI: no length
            at += 1 if marker == 0xFF else 2
            continue
        if marker in JPEG_FRAMES:
            if at + 10 > len(data):
                return None
            components = data[at + 9]
            return JPEG_MODES.get(components, f"{components} components")
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return None
