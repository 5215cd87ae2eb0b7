"""FERRY_ALLOW_PYTHON_GRADERS=false: a spec with a python grader, a multi's too, is refused at submit on both the
YAML route and OpenAI's reinforcement route, naming the grader's path and the fix, and nothing is stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from service.checking.check import PYTHON_GRADERS_OFF
from tests.jobs.llm_helpers import llm_spec, save_bpe_tokenizer, save_llama, write_jsonl
from tests.service.api.test_openai_reinforcement import GRADER, SHORT, prompts, reinforcement
from tests.service.conftest import TOKEN, Server

PYTHON = {"type": "python", "name": "code", "source": "def grade(sample, item):\n    return 1.0\n"}
STRING = {"type": "string_check", "name": "exact", "reference": "{{item.answer}}"}


@pytest.fixture
def locked(tmp_path: Path, make_server: Any) -> Server:
    """A server that runs no python graders, with the tiny Llama and a file of prompt rows under its roots."""
    models = tmp_path / "models"
    save_llama(models / "llama")
    save_bpe_tokenizer(models / "llama")
    write_jsonl(
        tmp_path / "datasets" / "prompts.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(4)]
    )
    return make_server(
        FERRY_MODEL_ROOTS=str(models), FERRY_DATA_ROOTS=str(tmp_path / "datasets"), FERRY_ALLOW_PYTHON_GRADERS="false"
    )


def grpo_yaml(grader: dict[str, Any]) -> str:
    spec = llm_spec(
        data={"path": "prompts.jsonl", "format": "prompt", "tokenizer": {"kind": "hf", "path": "llama"}},
        training={
            "objective": "grpo",
            "steps": 1,
            "grpo": {"grader": grader, "num_generations": 2, "max_new_tokens": 2},
        },
    )
    return yaml.safe_dump(spec)


@pytest.mark.parametrize(
    ("grader", "path"),
    [
        (PYTHON, "training.grpo.grader"),
        ({"type": "multi", "graders": [STRING, PYTHON]}, "training.grpo.grader.graders.1"),
    ],
)
def test_a_yaml_spec_with_a_python_grader_is_refused(locked: Server, grader: dict[str, Any], path: str) -> None:
    with locked.client() as client:
        refused = client.post("/v1/jobs", content=grpo_yaml(grader), headers={"Content-Type": "application/yaml"})
        assert refused.status_code == 422, refused.text
        (problem,) = refused.json()["error"]["problems"]
        assert (problem["path"], problem["message"]) == (path, PYTHON_GRADERS_OFF)
        assert "FERRY_ALLOW_PYTHON_GRADERS=false" in PYTHON_GRADERS_OFF and "string_check" in PYTHON_GRADERS_OFF
        assert client.get("/v1/jobs").json()["data"] == []  # nothing stored
        # The same job without the python grader passes the check.
        valid = client.post("/v1/jobs/validate", content=grpo_yaml(STRING), headers={"Content-Type": "text/yaml"})
        assert valid.status_code == 200, valid.text


def test_an_openai_reinforcement_job_with_a_python_grader_is_refused(locked: Server) -> None:
    ferry = openai.OpenAI(base_url=f"{locked.url}/v1", api_key=TOKEN, max_retries=0)
    upload = ferry.files.create(file=("prompts.jsonl", prompts(4)), purpose="fine-tune")
    nested = {"type": "multi", "name": "m", "graders": {"exact": GRADER, "code": PYTHON}, "calculate_output": "exact"}
    for grader, param in [
        (PYTHON, "method.reinforcement.grader"),
        (nested, "method.reinforcement.grader.graders.code"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            ferry.fine_tuning.jobs.create(
                model="llama", training_file=upload.id, method=reinforcement(grader), extra_body={"ferry": SHORT}
            )
        body = refused.value.body
        assert body["param"] == param and body["message"] == f"{param}: {PYTHON_GRADERS_OFF}", body
    assert list(ferry.fine_tuning.jobs.list()) == []
