"""A refused fine-tuning request speaks in the request's own fields: the spec Ferry generated from it is not the
user's, so neither its paths (``training.batch_size``, ``ferry.training.batch_size``) nor its YAML lines
(``line 23``) may show; the model and its tokenizer (one directory) are refused once. OpenAI's client, in process."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.jobs.llm_helpers import chat_record, save_bpe_tokenizer, save_llama
from tests.service.api.openai_client import idle_ferry_client

TINY = {"device": "cpu", "model": {"dtype": "float32"}, "data": {"seq_len": 64}, "lora": {"rank": 4}}
SPEC_WORDS = re.compile(r"(?<![\w.])(training|model|data|eval|lora)\.\w|\(line \d+\)|ferry\.training\.batch_size")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    save_llama(root / "llama")
    save_bpe_tokenizer(root / "llama")
    return root


@pytest.fixture
def ferry(tmp_path: Path, models: Path) -> Iterator[openai.OpenAI]:
    with idle_ferry_client(tmp_path, model_roots=[models]) as client:
        yield client


def two_chats(ferry: openai.OpenAI) -> str:
    body = "".join(json.dumps(chat_record(i)) + "\n" for i in range(2)).encode()
    return ferry.files.create(file=("train.jsonl", body), purpose="fine-tune").id


def refusal(ferry: openai.OpenAI, **request: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as refused:
        ferry.fine_tuning.jobs.create(**request)
    return refused.value.body


def test_data_too_small_for_the_batch_names_the_hyperparameter(ferry: openai.OpenAI) -> None:
    body = refusal(
        ferry,
        model="llama",
        training_file=two_chats(ferry),
        hyperparameters={"batch_size": 64},
        extra_body={"ferry": TINY},
    )
    assert body["param"] == "hyperparameters.batch_size" and body["code"] == "invalid_spec"
    message = body["message"]
    assert message.startswith("hyperparameters.batch_size: ")
    assert "fewer than hyperparameters.batch_size=64" in message and "ferry.data.seq_len=64" in message
    assert not SPEC_WORDS.search(message), message  # old code: "training.batch_size (line 23): ..."


def test_the_methods_hyperparameters_are_named_where_the_request_gave_them(ferry: openai.OpenAI) -> None:
    method = {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 64}}}
    body = refusal(ferry, model="llama", training_file=two_chats(ferry), method=method, extra_body={"ferry": TINY})
    assert body["param"] == "method.supervised.hyperparameters.batch_size"  # old code: hyperparameters.batch_size
    assert body["message"].startswith("method.supervised.hyperparameters.batch_size: ")


def test_a_model_not_found_is_said_once_as_model(ferry: openai.OpenAI) -> None:
    body = refusal(ferry, model="lama", training_file=two_chats(ferry))
    assert body["param"] == "model"
    assert body["message"].startswith("model: 'lama' does not exist") and body["message"].count("'lama'") == 1
    assert not SPEC_WORDS.search(body["message"]), body["message"]  # old code: model.path ...; data.tokenizer.path


def test_what_the_user_set_through_ferry_is_named_under_ferry(ferry: openai.OpenAI) -> None:
    body = refusal(
        ferry,
        model="llama",
        training_file=two_chats(ferry),
        extra_body={"ferry": {**TINY, "training": {"batch_sise": 2}}},
    )
    assert body["param"] == "ferry.training.batch_sise"
    assert body["message"].startswith("ferry.training.batch_sise: unknown key") and "(line" not in body["message"]
