"""A chat row with images, read as the text chat format reads it, its images kept in order.

Two layouts, as the trainers users come from write them:

- OpenAI's content parts: a user turn's ``content`` is a list of ``{type: text, text}`` and
  ``{type: image_url, image_url: {url}}`` parts (``input_image`` with ``image_url`` as a string, too), the URL a
  local path or a ``data:image/...;base64,`` URL.
- TRL's and axolotl's ``messages`` + ``images``: ``{type: image}`` parts (or ``<image>`` in string contents) stand
  for the row's ``images`` column in order; an ``image`` part may also carry its own ``image``, ``url`` or ``path``.

An image part's ``detail`` (OpenAI's ``image_url.detail``, or ``detail`` beside an ``input_image``'s URL) goes with
its image (images.py acts on ``low``). Videos are refused, naming the row's field: a ``{type: video}`` part (or
``video_url``, ``input_video``) or a ``videos`` column, which TRL and axolotl rows of video models carry. Ferry
trains on images; decoding video frames needs a video reader (PyAV, decord, torchvision) and each model's own
frame sampling, and none of it is here, so a video row is never trained as if it were text.

Each image part stands in the text as one private-use character while the text chat checks run (roles,
weights, tool calls, reasoning: jobs/data/formats/chat.py), then becomes the ``{type: image}`` part chat
templates render as the processor's placeholder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobs.data.formats.chat import check_messages
from jobs.data.formats.examples import RecordError
from jobs.data.formats.trl import Conversation
from jobs.models.vlm.images import ImageRef, image_ref

STAND_IN = "\ue000"  # a private-use character: an image's place in the text while the text checks run
IMAGE_PARTS = ("image_url", "input_image", "image")
TEXT_PLACEHOLDER = "<image>"  # LLaVA's and axolotl's placeholder in string contents, with an images column
VIDEO_PARTS = ("video", "video_url", "input_video")
VIDEOS_FIELD = "videos"  # TRL's and axolotl's column of a video model's rows
NO_VIDEO = (
    "Ferry trains on images, not videos; give the frames you want trained as images (image parts, or the images "
    "column) or leave the video out"
)


def image_conversation(
    fields: dict[str, Any], spec: Any, folder: Path, *, need_assistant: bool = True
) -> tuple[Conversation, list[ImageRef]]:
    """The row's checked messages (image parts as ``{type: image}``) and its images in the order they appear.

    Args:
        fields: The row.
        spec: The ``image_chat`` data section (``messages_field``, ``images_field``).
        folder: The data's folder: relative image paths are read from it, and no image from outside it.
        need_assistant: False for a prompt, which ends before the assistant's reply.

    Raises:
        RecordError: naming the field: a malformed message, a missing or unreadable image reference, images
            in an assistant turn, an ``images`` column that does not match the image parts, more images than
            ``max_images_per_row``, or a video.
    """
    field = spec.messages_field
    messages = fields.get(field)
    if fields.get(VIDEOS_FIELD) not in (None, []):
        raise RecordError(VIDEOS_FIELD, f"holds video(s): {NO_VIDEO}")
    column = _column(fields.get(spec.images_field), spec.images_field, folder)
    if not isinstance(messages, list) or not messages:
        raise RecordError(field, f"must be a non-empty list of {{role, content}} objects; got {_shown(messages)}")
    placeholders = column is not None and not any(_has_image_part(m) for m in messages)
    refs: list[ImageRef] = []
    used = 0
    stood_in = []
    for index, message in enumerate(messages):
        where = f"{field}[{index}]"
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = []
            for number, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in VIDEO_PARTS:
                    raise RecordError(f"{where}.content[{number}].type", f"is a {kind!r} part: {NO_VIDEO}")
                if kind in IMAGE_PARTS:
                    ref, used = _part_image(part, f"{where}.content[{number}]", column, used, spec.images_field, folder)
                    refs.append(ref)
                    parts.append({"type": "text", "text": STAND_IN})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        elif placeholders and isinstance(content, str) and TEXT_PLACEHOLDER in content:
            for _ in range(content.count(TEXT_PLACEHOLDER)):
                ref, used = _next_of_column(column, used, f"{where}.content", spec.images_field)
                refs.append(ref)
            message = {**message, "content": content.replace(TEXT_PLACEHOLDER, STAND_IN)}
        if isinstance(message, dict) and message.get("role") == "assistant" and STAND_IN in _text_of(message):
            raise RecordError(
                f"{where}.content", "images belong in user turns; an assistant turn is what the model writes"
            )
        stood_in.append(message)
    if len(refs) > spec.max_images_per_row:
        raise RecordError(
            refs[spec.max_images_per_row].field,
            f"is the row's image {spec.max_images_per_row + 1}, above data.max_images_per_row="
            f"{spec.max_images_per_row}; raise it for multi-image rows, or split the row",
        )
    if column is not None and used != len(column):
        raise RecordError(
            spec.images_field,
            f"holds {len(column)} image(s) but the messages have {used} image part(s) that take them "
            "({type: image} parts or <image> placeholders, one per image, in order)",
        )
    checked = check_messages(stood_in, field, need_assistant=need_assistant)
    return Conversation([_with_image_parts(m) for m in checked], [f"{field}[{i}]" for i in range(len(checked))]), refs


def _column(value: Any, name: str, folder: Path) -> list[ImageRef] | None:
    """The ``images`` column as references: paths or data URLs, or ``{path}`` / ``{bytes}`` (datasets' Image)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise RecordError(name, f"must be a list of image paths; got {_shown(value)}")
    refs = []
    for index, item in enumerate(value):
        where = f"{name}[{index}]"
        if isinstance(item, dict) and isinstance(item.get("bytes"), bytes | bytearray):
            refs.append(ImageRef(where, data=bytes(item["bytes"])))
        else:
            refs.append(image_ref(item.get("path") if isinstance(item, dict) else item, where, folder))
    return refs


def _part_image(
    part: dict[str, Any], where: str, column: list[ImageRef] | None, used: int, column_name: str, folder: Path
) -> tuple[ImageRef, int]:
    """The image an image part names: its own URL or path, else the next of the ``images`` column."""
    kind = part["type"]
    if kind == "image_url":
        url = part.get("image_url")
        if isinstance(url, dict):
            detail, detail_field = url.get("detail"), f"{where}.image_url.detail"
            return image_ref(url.get("url"), f"{where}.image_url.url", folder, detail, detail_field), used
        return image_ref(url, f"{where}.image_url", folder), used
    if kind == "input_image":  # the Responses API's part: its detail beside the URL
        return image_ref(
            part.get("image_url"), f"{where}.image_url", folder, part.get("detail"), f"{where}.detail"
        ), used
    for key in ("image", "url", "path"):
        if isinstance(part.get(key), str):
            return image_ref(part[key], f"{where}.{key}", folder), used
    return _next_of_column(column, used, where, column_name)


def _next_of_column(column: list[ImageRef] | None, used: int, where: str, column_name: str) -> tuple[ImageRef, int]:
    if column is None:
        raise RecordError(where, f"is an image part without an image: give the row an {column_name} column, or a url")
    if used >= len(column):
        raise RecordError(where, f"takes image {used + 1} but {column_name} holds {len(column)}")
    return column[used], used + 1


def _has_image_part(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in content)


def _text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _with_image_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A checked message whose text holds stand-ins, as content parts: ``{type: image}`` and ``{type: text}``."""
    text = message["content"]
    if STAND_IN not in text:
        return message
    parts: list[dict[str, str]] = []
    for index, piece in enumerate(text.split(STAND_IN)):
        if index:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return {**message, "content": parts}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
