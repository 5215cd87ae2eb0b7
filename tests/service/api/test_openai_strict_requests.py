"""OpenAI's fine-tuning request is read strictly, in the request's own words: ``true`` is no number of epochs,
batch size or learning-rate multiplier, and ``param`` is the request's field path (never pydantic's
``hyperparameters.n_epochs.int``). Driven by OpenAI's client over the app in this process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.checking.check import InlineSpecChecker
from service.settings import Settings
from tests.service.api.openai_client import idle_ferry_client
from tests.service.checking.test_one_parse import IdleExecutor


@pytest.fixture
def ferry(tmp_path: Path) -> Iterator[openai.OpenAI]:
    with idle_ferry_client(tmp_path) as client:
        yield client


@pytest.mark.parametrize("name", ["n_epochs", "batch_size", "learning_rate_multiplier"])
def test_true_is_no_number(ferry: openai.OpenAI, name: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:  # old code: accepted as 1
        ferry.fine_tuning.jobs.create(model="m", training_file="file-0a", hyperparameters={name: True})
    body = refused.value.body
    assert body["param"] == f"hyperparameters.{name}" and body["type"] == "invalid_request_error"
    assert body["message"].startswith(f"hyperparameters.{name}: must be") and "got true" in body["message"]


def test_param_is_the_requests_field_path(ferry: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        ferry.fine_tuning.jobs.create(model="m", training_file="file-0a", hyperparameters={"n_epochs": "x"})
    assert refused.value.body["param"] == "hyperparameters.n_epochs"  # old code: hyperparameters.n_epochs.int
    assert "Input should be" not in refused.value.body["message"]
    method = {"type": "dpo", "dpo": {"hyperparameters": {"beta": True}}}
    with pytest.raises(openai.BadRequestError) as beta:
        ferry.fine_tuning.jobs.create(model="m", training_file="file-0a", method=method)
    assert beta.value.body["param"] == "method.dpo.hyperparameters.beta"


def test_refusals_before_the_routes_are_in_openais_envelope(tmp_path: Path) -> None:
    token = "t" * 32
    settings = Settings(data_dir=tmp_path, devices="cpu", _env_file=None, api_token=token, max_body_bytes=1024)
    app = create_app(settings, executor=IdleExecutor(), spec_checker=InlineSpecChecker())
    with TestClient(app, raise_server_exceptions=False) as http:
        wrong = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as unauthorized:  # old code: Ferry's envelope
            wrong.fine_tuning.jobs.list()
        assert set(unauthorized.value.body) == {"message", "type", "param", "code"}
        assert unauthorized.value.body["type"] == "authentication_error"
        assert unauthorized.value.response.headers["WWW-Authenticate"] == "Bearer"
        right = openai.OpenAI(base_url="http://testserver/v1", api_key=token, http_client=http, max_retries=0)
        with pytest.raises(openai.APIStatusError) as large:
            right.fine_tuning.jobs.create(model="m" * 2000, training_file="file-0a")
        assert large.value.status_code == 413
        assert large.value.body["type"] == "invalid_request_error" and large.value.body["code"] == "body_too_large"
        # Ferry's own routes keep Ferry's envelope.
        assert set(http.get("/v1/jobs").json()["error"]) == {"code", "message"}


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/fine_tuning/nothing", 404),
        ("GET", "/v1/fine_tuning/jobs/job-1/nothing", 404),
        ("DELETE", "/v1/fine_tuning/jobs/job-1", 405),
        ("PUT", "/v1/fine_tuning/jobs", 405),
        ("GET", "/v1/fine_tuning/jobs/job-1/cancel", 405),
    ],
)
def test_unknown_paths_and_methods_are_in_openais_envelope(
    ferry: openai.OpenAI, method: str, path: str, status: int
) -> None:
    http = ferry._client
    answer = http.request(method, path)
    assert answer.status_code == status
    error = answer.json()["error"]  # old code: Ferry's {"error": {"code", "message"}}
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["code"] == ("not_found" if status == 404 else "method_not_allowed")
    if status == 405:
        assert answer.headers["Allow"] and answer.headers["Allow"] in error["message"]
    with pytest.raises(openai.APIStatusError) as refused:  # and OpenAI's client reads it
        getattr(ferry, method.lower())(path.removeprefix("/v1"), cast_to=dict)
    assert refused.value.status_code == status and refused.value.body["code"] == error["code"]


def test_ferrys_routes_keep_ferrys_404_and_405(ferry: openai.OpenAI) -> None:
    http = ferry._client
    assert set(http.get("/v1/nothing").json()["error"]) == {"code", "message"}
    assert set(http.put("/v1/jobs").json()["error"]) == {"code", "message"}
