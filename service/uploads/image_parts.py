"""The image parts of an uploaded fine-tuning row, in OpenAI's vision fine-tuning format: a user turn's ``content``
holds ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": "auto"}}`` parts beside
its text parts.

Checked at upload without decoding any image (the API process reads JSON, no Pillow, no torch), by OpenAI's rules
for vision fine-tuning files: images only in user turns, at most 10 images an example, each at most 10 MB, JPEG,
PNG or WEBP, in RGB or RGBA (read from the file's header: image_header.py); and the part's shape, ``detail``
(acted on by the job: ``low`` shows the model the image within 512x512), and that the URL is a ``data:`` URL whose
base64 decodes to the format it names. OpenAI's format also allows ``https://`` URLs, but a Ferry job reads no
network, and an uploaded file has no folder beside it for local paths: both are refused, naming the row's field
and the fix. Videos are no part of OpenAI's format and are refused too. What needs the image decoded (a corrupt
body, a huge image) is found when the job is created, by the ``image_chat`` data check of the vision-language
base model, again naming the row. (At most 50,000 examples with images a file: rows.py counts them.)

Example:
    found = image_fields(messages, "messages")   # ["messages[0].content[1]"]
    check_image_parts(messages, "messages")      # raises UploadImageError naming the field
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from jobs.fit.sizes import human_bytes
from service.uploads.image_header import image_format, image_mode

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
VIDEO_PART_TYPES = ("video", "video_url", "input_video")
DETAILS = ("auto", "low", "high")  # OpenAI's image_url.detail
# OpenAI's rules for the images of a vision fine-tuning file.
FORMATS = ("png", "jpeg", "webp")
MODES = ("RGB", "RGBA")
MAX_IMAGES_PER_EXAMPLE = 10
MAX_IMAGE_BYTES = 10 << 20  # "10 MB"


class UploadImageError(ValueError):
    """An image part that cannot train: the row's field (``messages[0].content[1].image_url.url``) and why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


def image_fields(messages: Any, field: str, types: tuple[str, ...] = IMAGE_PART_TYPES) -> list[str]:
    """Where ``messages`` holds image parts (``messages[0].content[1]``), in order; ``[]`` for a text row.
    ``types``: the part types looked for (`VIDEO_PART_TYPES` finds videos)."""
    found = []
    for index, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for number, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in types:
                found.append(f"{field}[{index}].content[{number}]")
    return found


def check_image_parts(messages: list[Any], field: str) -> list[Any]:
    """Check every image part of ``messages``; the messages with their image parts left out, for the text check.

    Raises:
        UploadImageError: naming the part's field: an image in a turn that is not the user's, more than 10
            images in the row, an ``image_url`` that is no ``{url, detail}`` object, a ``detail`` OpenAI does not
            name, a web URL or a path, a ``data:`` URL that is not a base64 PNG, JPEG or WEBP in RGB or RGBA of at
            most 10 MB, or a video part.
    """
    text_only = []
    images = 0
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            text_only.append(message)
            continue
        kept = []
        for number, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"{field}[{index}].content[{number}]"
            if kind in VIDEO_PART_TYPES:
                raise UploadImageError(
                    f"{where}.type",
                    f"is a {kind!r} part; OpenAI's fine-tuning files hold text and images, and Ferry trains on "
                    "images, not videos: give the frames you want trained as image_url parts, or leave it out",
                )
            if kind not in IMAGE_PART_TYPES:
                kept.append(part)
                continue
            if message.get("role") != "user":
                raise UploadImageError(
                    where, f"images belong in user messages (OpenAI's rule); this one is {message.get('role')!r}"
                )
            images += 1
            if images > MAX_IMAGES_PER_EXAMPLE:
                raise UploadImageError(
                    where,
                    f"is the row's image {images}; OpenAI's vision fine-tuning takes at most "
                    f"{MAX_IMAGES_PER_EXAMPLE} images an example: split the row or leave images out",
                )
            _check_part(part, where)
        text_only.append({**message, "content": kept})
    return text_only


def _check_part(part: dict[str, Any], where: str) -> None:
    if part["type"] != "image_url":
        raise UploadImageError(
            f"{where}.type",
            f"is {part['type']!r}; OpenAI's fine-tuning rows write an image as "
            '{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}',
        )
    image_url = part.get("image_url")
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise UploadImageError(
            f"{where}.image_url", f'must be an object {{"url": "data:image/...;base64,..."}}; got {_shown(image_url)}'
        )
    extra = sorted(set(image_url) - {"url", "detail"})
    if extra:
        raise UploadImageError(f"{where}.image_url.{extra[0]}", "is not a field of image_url (url and detail are)")
    detail = image_url.get("detail")
    if detail is not None and detail not in DETAILS:
        raise UploadImageError(
            f"{where}.image_url.detail", f"must be one of {', '.join(DETAILS)}; got {_shown(detail)}"
        )
    _check_url(image_url["url"], f"{where}.image_url.url")


def _check_url(url: str, where: str) -> None:
    if url.startswith(("http://", "https://")):
        raise UploadImageError(
            where,
            f"is a web URL ({_shown(url)}); Ferry's jobs read no network: embed the image in the row as a data "
            "URL (data:image/png;base64,<the file's bytes in base64>)",
        )
    if not url.startswith("data:"):
        raise UploadImageError(
            where,
            f"is {_shown(url)}, not a data URL; an uploaded file carries its images inside it as "
            "data:image/png;base64,... (images beside the data on the server train through POST /v1/jobs with "
            "data.kind: image_chat)",
        )
    header, _, payload = url.partition(",")
    kind = header.removeprefix("data:image/").removesuffix(";base64")
    kind = "jpeg" if kind == "jpg" else kind
    if not header.startswith("data:image/") or not header.endswith(";base64"):
        raise UploadImageError(where, f"must read data:image/<png|jpeg|webp>;base64,<data>; got {_shown(header + ',')}")
    if kind not in FORMATS:
        raise UploadImageError(
            where,
            f"is image/{_shown(kind)[1:-1]}; OpenAI's vision fine-tuning takes JPEG, PNG and WEBP images: convert "
            "it (e.g. to PNG) and write data:image/png;base64,<data>",
        )
    try:
        data = base64.b64decode(payload, validate=True)  # a line is at most FERRY_MAX_UPLOAD_LINE_BYTES
    except (binascii.Error, ValueError) as error:
        raise UploadImageError(where, f"the data URL's base64 payload does not decode ({error})") from None
    if image_format(data) != kind:
        raise UploadImageError(where, f"says image/{kind} but its bytes are no {kind.upper()} file: {data[:8]!r}")
    if len(data) > MAX_IMAGE_BYTES:
        raise UploadImageError(
            where,
            f"is a {human_bytes(len(data))} image; OpenAI's vision fine-tuning takes images of at most "
            f"{human_bytes(MAX_IMAGE_BYTES)}: shrink or recompress it",
        )
    mode = image_mode(kind, data)
    if mode is not None and mode not in MODES:
        raise UploadImageError(
            where,
            f"is a {kind.upper()} in mode {mode}; OpenAI's vision fine-tuning takes RGB or RGBA images: convert it "
            "(Pillow: image.convert('RGB'))",
        )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
