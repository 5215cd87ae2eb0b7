"""OpenAI's content parts in a fine-tuning file: text parts train as their text; an audio or file part is refused
at upload naming the row and the field (the old check said only "must be a string", and a message's ``audio`` was
accepted and trained as the text beside it); image parts are OpenAI's vision format (test_openai_vision.py), whose
web URLs no job can read. Driven by OpenAI's client in process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from jobs.data.formats.chat import check_messages
from jobs.data.formats.examples import RecordError
from tests.service.api.openai_client import idle_ferry_client

IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


@pytest.fixture
def ferry(tmp_path: Path) -> Iterator[openai.OpenAI]:
    with idle_ferry_client(tmp_path) as client:
        yield client


def chat(user: Any, assistant: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": user}, assistant or {"role": "assistant", "content": "ok"}]}


def upload(ferry: openai.OpenAI, rows: list[dict[str, Any]]) -> Any:
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    return ferry.files.create(file=("train.jsonl", body), purpose="fine-tune")


@pytest.mark.parametrize(
    ("row", "field", "kind"),
    [
        (chat([AUDIO]), "messages[0].content[0].type", "audio"),
        (chat("hi", {"role": "assistant", "content": "ok", "audio": {"id": "audio_1"}}), "messages[1].audio", "audio"),
    ],
)
def test_media_content_is_refused_naming_row_and_field(
    ferry: openai.OpenAI, row: dict[str, Any], field: str, kind: str
) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as refused:  # old code: accepted (audio) or "must be a string"
        upload(ferry, [chat("fine"), row])
    message = refused.value.body["message"]  # Ferry's envelope: /v1/files is Ferry's route family
    assert f"row 2: field '{field}'" in message
    assert f"{kind}" in message and "cannot be trained" in message and "Ferry fine-tunes text models" in message


def test_an_image_at_a_web_url_is_refused_naming_row_and_field(ferry: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        upload(ferry, [chat("fine"), chat([{"type": "text", "text": "what is this?"}, IMAGE])])
    message = refused.value.body["message"]
    assert "row 2: field 'messages[0].content[1].image_url.url': is a web URL" in message
    assert "Ferry's jobs read no network" in message


def test_text_parts_train_as_their_text(ferry: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "Capital of France? "}, {"type": "text", "text": "One word."}]
    assert upload(ferry, [chat(parts)]).id.startswith("file-")  # old code: 422 "must be a string"
    checked = check_messages(chat(parts)["messages"], "messages")
    assert checked[0]["content"] == "Capital of France? One word."


def test_an_unknown_part_is_refused_by_its_type() -> None:
    with pytest.raises(RecordError) as refused:
        check_messages(chat([{"type": "video", "url": "x"}])["messages"], "messages")
    assert refused.value.field == "messages[0].content[0].type" and "{type: text, text}" in refused.value.message
