"""Graders as OpenAI's RFT names them; a failing grader gives reward 0 and one log line per distinct error."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from jobs.objectives.graders import Graders
from jobs.spec.llm import GRPOSpec

ROW = {"prompt": "2+2=", "answer": "4"}


def grader(**spec: object) -> Graders:
    return Graders(GRPOSpec.model_validate({"grader": spec}).grader)


@pytest.mark.parametrize(
    ("operation", "expected"), [("eq", [1, 0, 0]), ("ne", [0, 1, 1]), ("like", [1, 1, 0]), ("ilike", [1, 1, 1])]
)
def test_string_check_operations(operation: str, expected: list[float]) -> None:
    grade = grader(type="string_check", reference="{{item.answer}}x", operation=operation)
    assert grade(["4x", "it is 4x", "4X"], [ROW] * 3) == expected


def test_text_similarity_fuzzy_match() -> None:
    grade = grader(type="text_similarity", reference="{{item.answer}}", evaluation_metric="fuzzy_match")
    exact, near, far = grade(["4", "45", "zzz"], [ROW] * 3)
    assert exact == 1.0 and 0 < near < 1 and far == 0.0


def test_a_missing_column_gives_zero_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    grade = grader(type="string_check", reference="{{item.solution}}")
    with caplog.at_level(logging.WARNING):
        assert grade(["4", "4", "4"], [ROW] * 3) == [0.0, 0.0, 0.0]
    assert len([r for r in caplog.records if "item.solution" in r.getMessage()]) == 1


def test_multi_is_the_weighted_sum() -> None:
    grade = grader(
        type="multi",
        graders=[
            {"type": "string_check", "name": "exact", "reference": "{{item.answer}}"},
            {"type": "string_check", "name": "has", "reference": "{{item.answer}}", "operation": "like"},
        ],
        weights={"exact": 0.75, "has": 0.25},
    )
    assert grade(["4", "a 4", "no"], [ROW] * 3) == [1.0, 0.25, 0.0]


def test_multi_weights_must_name_graders() -> None:
    with pytest.raises(ValueError, match="weights name no grader"):
        grader(type="multi", graders=[{"type": "string_check", "reference": "x"}], weights={"other": 1.0})


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "grader" / "grade.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(body)
    return path


def test_python_grader_reads_the_completion_and_the_row_in_its_folder(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "import os\n"
        "def grade(sample, item):\n"
        "    here = os.path.basename(os.getcwd())\n"
        "    return float(sample['output_text'].strip() == item['answer']) + (here == 'grader')\n",
    )
    assert grader(type="python", file=str(path))(["4", "5"], [ROW, ROW]) == [2.0, 1.0]


def test_python_grader_timeout_nan_raise_give_zero_each_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(
        tmp_path,
        "def grade(sample, item):\n"
        "    text = sample['output_text']\n"
        "    if text == 'loop':\n"
        "        while True: pass\n"
        "    if text == 'nan': return float('nan')\n"
        "    if text == 'raise': raise RuntimeError('bad grader')\n"
        "    if text == 'big': return len(bytearray(10**10))\n"
        "    return 1.0\n",
    )
    grade = grader(type="python", file=str(path), timeout_s=0.5, memory_mb=256)
    with caplog.at_level(logging.WARNING):
        rewards = grade(["ok", "loop", "nan", "raise", "raise", "big"], [ROW] * 6)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    messages = [r.getMessage() for r in caplog.records]
    for reason in ("longer than 0.5 s", "returned nan", "bad grader", "MemoryError"):
        assert len([m for m in messages if reason in m]) == 1, (reason, messages)


def test_a_python_grader_file_without_grade_gives_zero(tmp_path: Path) -> None:
    path = write(tmp_path, "x = 1\n")
    grade = grader(type="python", file=str(path))
    assert grade(["a", "b"], [ROW, ROW]) == [0.0, 0.0]
    assert any("KeyError" in e for e in grade.errors)
