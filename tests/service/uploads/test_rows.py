"""The upload row check's layouts: a chat ends with the assistant's reply, a prompt (OpenAI's reinforcement row)
before it; a file mixing them is refused at the first row of the other kind, saying how they differ."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.uploads.rows import FileRows, RowProblem, check_fine_tuning_rows

PROMPT = {"messages": [{"role": "developer", "content": "add"}, {"role": "user", "content": "2+2?"}], "answer": "4"}
CHAT = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


def upload(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_reinforcement_rows_are_prompt_rows(tmp_path: Path) -> None:
    assert check_fine_tuning_rows(upload(tmp_path, [PROMPT, PROMPT])) == FileRows("prompt", 2)
    assert check_fine_tuning_rows(upload(tmp_path, [CHAT])) == FileRows("chat", 1)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [CHAT, PROMPT],
            "row 2: the row: is a prompt row in a file whose first row is a chat row (its last message is not the assistant's",
        ),
        (
            [PROMPT, CHAT],
            "row 2: the row: is a chat row in a file whose first row is a prompt row (its last message is the assistant's",
        ),
        ([{"messages": [{"role": "human", "content": "hi"}]}], "row 1: field 'messages[0].role': must be one of"),
    ],
)
def test_a_file_mixing_chats_and_prompts_is_refused_saying_how_they_differ(
    tmp_path: Path, rows: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(RowProblem) as refused:
        check_fine_tuning_rows(upload(tmp_path, rows))
    assert str(refused.value).startswith(message)
