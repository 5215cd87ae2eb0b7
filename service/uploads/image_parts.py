"""The image parts of an uploaded fine-tuning row, in OpenAI's vision fine-tuning format: a user turn's ``content``
holds ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": "auto"}}`` parts beside
its text parts.

Checked at upload without decoding anything (the API process reads JSON, no Pillow, no torch): the part's shape,
``detail``, that the URL is a ``data:`` URL of a PNG, JPEG, WEBP or GIF whose base64 decodes and whose first bytes
are that format's signature. ``detail`` is checked but not acted on: the model's own processor sizes each image
(within ``data.max_image_pixels``), as it does for every image Ferry trains on. OpenAI's format also allows ``https://`` URLs, but a Ferry job reads no network, and
an uploaded file has no folder beside it for local paths: both are refused, naming the row's field and the fix.
What needs the image decoded (a corrupt body, a huge image) is found when the job is created, by the
``image_chat`` data check of the vision-language base model, again naming the row.

Example:
    found = image_fields(messages, "messages")   # ["messages[0].content[1]"]
    check_image_parts(messages, "messages")      # raises UploadImageError naming the field
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
DETAILS = ("auto", "low", "high")  # OpenAI's image_url.detail
# Each image format OpenAI's vision fine-tuning takes, by the first bytes of its file.
SIGNATURES = {
    "png": (b"\x89PNG\r\n\x1a\n",),
    "jpeg": (b"\xff\xd8\xff",),
    "webp": (b"RIFF",),  # and "WEBP" at byte 8, checked below
    "gif": (b"GIF87a", b"GIF89a"),
}


class UploadImageError(ValueError):
    """An image part that cannot train: the row's field (``messages[0].content[1].image_url.url``) and why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


def image_fields(messages: Any, field: str) -> list[str]:
    """Where ``messages`` holds image parts (``messages[0].content[1]``), in order; ``[]`` for a text row."""
    found = []
    for index, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for number, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                found.append(f"{field}[{index}].content[{number}]")
    return found


def check_image_parts(messages: list[Any], field: str) -> list[Any]:
    """Check every image part of ``messages``; the messages with their image parts left out, for the text check.

    Raises:
        UploadImageError: naming the part's field: an image in a turn that is not the user's, an ``image_url``
            that is no ``{url, detail}`` object, a ``detail`` OpenAI does not name, a web URL or a path, or a
            ``data:`` URL that is not a base64 PNG, JPEG, WEBP or GIF.
    """
    text_only = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            text_only.append(message)
            continue
        kept = []
        for number, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES):
                kept.append(part)
                continue
            where = f"{field}[{index}].content[{number}]"
            if message.get("role") != "user":
                raise UploadImageError(
                    where, f"images belong in user messages (OpenAI's rule); this one is {message.get('role')!r}"
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
    if not header.startswith("data:image/") or not header.endswith(";base64") or kind not in SIGNATURES:
        raise UploadImageError(
            where, f"must read data:image/<png|jpeg|webp|gif>;base64,<data>; got {_shown(header + ',')}"
        )
    try:
        head = base64.b64decode(payload, validate=True)[:12]  # a line is at most FERRY_MAX_UPLOAD_LINE_BYTES
    except (binascii.Error, ValueError) as error:
        raise UploadImageError(where, f"the data URL's base64 payload does not decode ({error})") from None
    if not head.startswith(SIGNATURES[kind]) or (kind == "webp" and head[8:12] != b"WEBP"):
        raise UploadImageError(where, f"says image/{kind} but its bytes are no {kind.upper()} file: {head[:8]!r}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
