"""Graders as OpenAI's RFT names them; a failing grader gives reward 0 and one log line per distinct error."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.errors import JobSpecError
from jobs.objectives.graders import Graders
from jobs.paths import PathRoots
from jobs.spec.llm import GRPOSpec
from jobs.spec.loading import load_job_spec
from tests.jobs.llm_helpers import llm_spec, write_jsonl

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


def load_grader(root: Path, grader_spec: dict[str, Any]) -> Any:
    """The grader of a grpo job spec loaded as a submission is (paths under ``root``'s data and model roots)."""
    for name in ("llama", "tok"):
        (root / "models" / name).mkdir(parents=True, exist_ok=True)
    write_jsonl(root / "data" / "prompts.jsonl", [ROW])
    spec = llm_spec(
        data={"path": "prompts.jsonl", "format": "prompt"},
        training={"objective": "grpo", "steps": 1, "grpo": {"num_generations": 2, "grader": grader_spec}},
    )
    roots = PathRoots(model_roots=[root / "models"], data_roots=[root / "data"])
    return load_job_spec(yaml.safe_dump(spec), roots).training.grpo.grader


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


def test_templates_read_nested_columns_and_the_completions_json() -> None:
    grade = grader(type="string_check", input="{{sample.output_json.answer}}", reference="{{item.meta.answer}}")
    row = {"meta": {"answer": "4"}}
    assert grade(['{"answer": "4"}', '{"answer": "5"}', "not json"], [row] * 3) == [1.0, 0.0, 0.0]
    assert any("sample.output_json.answer: not in the sample" in e for e in grade.errors)


@pytest.mark.parametrize("template", ["{{answer}}", "{{sample.choices}}", "{{ row.answer }}"])
def test_a_template_naming_nothing_a_grader_reads_is_refused_at_load(template: str) -> None:
    with pytest.raises(ValueError, match="names nothing a grader can read"):
        grader(type="string_check", reference=template)


def test_math_answer_compares_answers_mathematically() -> None:
    pytest.importorskip("math_verify")
    grade = grader(type="math_answer", reference="{{item.answer}}")
    row = {"answer": "\\frac{1}{2}"}
    completions = ["so the answer is $\\boxed{0.5}$", "1/2", "the answer is 0.4", "no idea"]
    assert grade(completions, [row] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_multi_calculate_output_is_openais_formula() -> None:
    grade = grader(
        type="multi",
        graders=[
            {"type": "string_check", "name": "exact", "reference": "{{item.answer}}"},
            {"type": "text_similarity", "name": "fuzzy", "reference": "{{item.answer}}"},
        ],
        calculate_output="max(exact, 0.5 * fuzzy ^ 2) - log(1)",
    )
    assert grade(["4", "44", "zz"], [ROW] * 3) == [1.0, pytest.approx(0.5 * (2 / 3) ** 2), 0.0]


@pytest.mark.parametrize(
    ("formula", "message"),
    [
        ("exact + other", "names 'other', which is no grader"),
        ("__import__('os')", "calls something other than"),
        ("exact if exact else 0", "may hold numbers, grader names"),
        ("exact +", "is no formula"),
    ],
)
def test_a_formula_that_is_not_arithmetic_over_the_graders_is_refused(
    tmp_path: Path, formula: str, message: str
) -> None:
    multi = {"type": "multi", "graders": [{"type": "string_check", "name": "exact", "reference": "x"}]}
    with pytest.raises(JobSpecError, match=r"training\.grpo\.grader\.calculate_output.*" + re.escape(message)):
        load_grader(tmp_path, {**multi, "calculate_output": formula})


def test_a_formula_that_fails_on_a_completion_gives_zero_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    grade = grader(
        type="multi",
        graders=[{"type": "string_check", "name": "exact", "reference": "4"}],
        calculate_output="1 / exact",
    )
    with caplog.at_level(logging.WARNING):
        assert grade(["4", "5", "6"], [ROW] * 3) == [1.0, 0.0, 0.0]
    assert len([r for r in caplog.records if "ZeroDivisionError" in r.getMessage()]) == 1
