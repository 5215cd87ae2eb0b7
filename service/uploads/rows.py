"""The row check of a fine-tuning upload: every JSONL row a chat conversation, every row a preference pair, or every
row a prompt (OpenAI's reinforcement rows: ``messages`` that end before the assistant's reply, and the columns its
graders read, ``{"messages": [...], "answer": "4"}``). Chat rows may hold images in OpenAI's vision fine-tuning
format (``image_parts.py``): the file's format is then ``image_chat``, which trains a vision-language base model
and is refused, naming its first image row, for a text-only one.

It runs in the API process, so it reads JSON and nothing else (no tokenizer, no torch). The lines are read by the
job's own JSONL reader (``jobs/data/jsonl.py``: one parse, one refusal of a duplicate key or a row nested too deep)
and checked by the rules the job's data check applies at submit (``jobs/data/formats/chat.py``,
``jobs/data/formats/preference.py``), so a file accepted here is not refused there for its layout. What needs the
tokenizer (the chat template) is checked at job creation.

Example:
    checked = check_fine_tuning_rows(Path("train.jsonl"))   # FileRows(format="chat", rows=120)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jobs.data.formats.chat import check_messages
from jobs.data.formats.examples import RecordError
from jobs.data.jsonl import JsonlError, LineTooLong, read_jsonl
from jobs.fit.sizes import human_bytes
from service.uploads.image_parts import VIDEO_PART_TYPES, UploadImageError, check_image_parts, image_fields

OPENAI_PAIR = ("input", "preferred_output", "non_preferred_output")  # OpenAI's DPO layout
TRL_PAIR = ("prompt", "chosen", "rejected")  # TRL's preference layout

Format = Literal["chat", "image_chat", "preference", "prompt"]
DEFAULT_MAX_LINE_BYTES = 4 << 20  # Settings.max_upload_line_bytes (FERRY_MAX_UPLOAD_LINE_BYTES)
MAX_IMAGE_EXAMPLES = 50_000  # OpenAI's vision fine-tuning: examples with images a file (text rows not counted)
# The version of the upload rules (this file, image_parts.py, image_header.py and the job's row checks they call),
# stored with each file they check. Bump it whenever a rule changes: a file checked by older rules is checked again
# by the new ones before a job trains on it (recheck.py). 1: OpenAI's vision limits (10 images and 10 MB an
# example's image, JPEG/PNG/WEBP in RGB/RGBA, 50,000 image examples, no video parts). Files stored before versions
# were recorded have none and are checked again too.
RULES_VERSION = 1


class RowProblem(ValueError):
    """A row that does not fit: its 1-based line, the offending field and why."""

    def __init__(self, row: int, field: str, message: str) -> None:
        where = f"field '{field}'" if field else "the row"
        super().__init__(f"row {row}: {where}: {message}")
        self.row, self.field, self.message = row, field, message


@dataclass(frozen=True)
class FileRows:
    """A checked fine-tuning file: the layout of its rows and how many there are."""

    format: Format
    rows: int


def check_fine_tuning_rows(path: Path, *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> FileRows:
    """Check every row of the JSONL file at ``path``; the first bad one raises.

    Read line by line through the job's own JSONL reader (jobs/data/jsonl.py), never more than
    ``max_line_bytes`` of a line at once, so the check's memory stays near that limit whatever the file's size.

    Raises:
        RowProblem: naming the row (its line) and the field, e.g. ``row 3: field 'messages[1].role': ...``.
    """
    layout: Format | None = None
    count = 0
    image_rows = 0  # chat rows with an image part: the file is image_chat
    rows = read_jsonl(path, max_line_bytes=max_line_bytes)
    try:
        for number, record in rows:
            kind = _layout(record, number)
            if layout is not None and kind != layout:
                raise RowProblem(
                    number, "", f"is a {kind} row in a file whose first row is a {layout} row" + _WHY[kind]
                )
            layout = kind
            try:
                if kind == "preference":
                    _check_pair(record)
                else:  # a chat trains on its assistant turns; a prompt's reply is sampled and graded
                    messages = record.get("messages")
                    found = image_fields(messages, "messages")
                    if found or image_fields(messages, "messages", VIDEO_PART_TYPES):
                        messages = _image_messages(messages, kind)
                    if found:
                        image_rows += 1
                        _count_image_rows(image_rows, found[0])
                    _messages(messages, "messages", need_assistant=kind == "chat")
            except _FieldError as error:
                raise RowProblem(number, error.field, error.message) from None
            count += 1
    except LineTooLong as long:
        raise RowProblem(long.line, "", _too_long(long.limit)) from None
    except JsonlError as error:
        raise RowProblem(error.line, "", error.message) from None
    finally:
        rows.close()
    if layout is None:
        raise RowProblem(1, "", "the file holds no rows; upload one JSON object per line")
    return FileRows("image_chat" if image_rows else layout, count)


def first_image_row(path: Path, *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> tuple[int, str] | None:
    """The first row of an uploaded file with an image part, and the part's field; None when there is none."""
    rows = read_jsonl(path, max_line_bytes=max_line_bytes)
    try:
        for number, record in rows:
            found = image_fields(record.get("messages"), "messages")
            if found:
                return number, found[0]
    finally:
        rows.close()
    return None


def _count_image_rows(image_rows: int, field: str) -> None:
    if image_rows > MAX_IMAGE_EXAMPLES:
        raise _FieldError(
            field,
            f"is in the file's example {image_rows} with images; OpenAI's vision fine-tuning takes at most "
            f"{MAX_IMAGE_EXAMPLES:,} examples with images a file (text rows not counted): split the file",
        )


def _image_messages(messages: list[Any], kind: Format) -> list[Any]:
    """A chat row's messages with their image (and video) parts checked and left out, for the text check."""
    if kind != "chat" and image_fields(messages, "messages"):
        field = image_fields(messages, "messages")[0]
        raise _FieldError(f"{field}.type", "images train in supervised chat rows, which end with the assistant's reply")
    try:
        return check_image_parts(messages, "messages")
    except UploadImageError as error:
        raise _FieldError(error.field, error.message) from None


# How a chat row and a prompt row differ, where a file mixes them.
_WHY = {
    "chat": " (its last message is the assistant's: a reinforcement file's rows end before the reply)",
    "prompt": " (its last message is not the assistant's: a chat row ends with the reply to train on)",
    "preference": "",
}


class _FieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


def _too_long(limit: int) -> str:
    return (
        f"is longer than {human_bytes(limit)} (FERRY_MAX_UPLOAD_LINE_BYTES); a fine-tuning file is JSON Lines, "
        "one row per line. A .json array converts with: jq -c '.[]' train.json > train.jsonl; "
        "for rows this long, raise FERRY_MAX_UPLOAD_LINE_BYTES"
    )


def _layout(record: dict[str, Any], number: int) -> Format:
    if "messages" in record:
        messages = record["messages"]
        last = messages[-1] if isinstance(messages, list) and messages else None
        return "chat" if not isinstance(last, dict) or last.get("role") == "assistant" else "prompt"
    if any(key in record for key in (*OPENAI_PAIR, *TRL_PAIR)):
        return "preference"
    raise RowProblem(
        number,
        "messages",
        "is missing; a fine-tuning row is a chat ({messages: [{role, content}]}) or a preference pair "
        "({input: {messages}, preferred_output, non_preferred_output})",
    )


def _check_pair(record: dict[str, Any]) -> None:
    if any(key in record for key in OPENAI_PAIR):
        source = record.get("input")
        if not isinstance(source, dict):
            raise _FieldError("input", f"must be an object with messages (OpenAI's DPO layout); got {_shown(source)}")
        _messages(source.get("messages"), "input.messages", need_assistant=False)
        names = OPENAI_PAIR[1:]
    else:
        prompt = record.get("prompt")
        if not isinstance(prompt, str):
            _messages(prompt, "prompt", need_assistant=False)
        names = TRL_PAIR[1:]
    for name in names:
        value = record.get(name)
        if not isinstance(value, str) or name in OPENAI_PAIR:
            _messages(value, name)


def _messages(messages: Any, field: str, *, need_assistant: bool = True) -> None:
    """The training data's own check of a conversation (torch-free), its error as this module's."""
    try:
        check_messages(messages, field, need_assistant=need_assistant)
    except RecordError as error:
        raise _FieldError(error.field, error.message) from None


def _shown(value: Any) -> str:
    text = repr(value)  # as jobs/data/formats/chat.py shows a value
    return text if len(text) <= 60 else text[:57] + "..."
