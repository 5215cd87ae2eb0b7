"""OpenAI's fine-tuning API on Ferry, driven by OpenAI's own Python client: upload, create, follow the events to
``succeeded``, list checkpoints, cancel; OpenAI's error envelope; a DPO job on preference pairs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from jobs.spec.job import TrainingSpec
from tests.jobs.llm_helpers import chat_record, corpus_lines, save_bpe_tokenizer, save_llama
from tests.service.conftest import TOKEN

# Ferry's settings for a tiny CPU job; everything else is what the OpenAI request says.
TINY = {"device": "cpu", "model": {"dtype": "float32"}, "data": {"seq_len": 64}, "lora": {"rank": 4}}


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def ferry(tmp_path: Path, make_server) -> openai.OpenAI:
    models = tmp_path / "models"
    save_llama(models / "llama")
    save_bpe_tokenizer(models / "llama")  # the tokenizer beside the weights, as a Hugging Face model ships
    server = make_server(FERRY_MODEL_ROOTS=str(models))
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0)


def follow(client: openai.OpenAI, job_id: str, status: str, timeout: float = 180) -> list[Any]:
    """The job's events, newest first, once one says it reached ``status``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = list(client.fine_tuning.jobs.list_events(job_id, limit=100))  # the client pages with `after`
        if any(e.data and e.data.get("type") == "status" and e.data["status"] == status for e in events):
            return events
        time.sleep(0.2)
    raise TimeoutError(f"{job_id} did not reach {status}: {client.fine_tuning.jobs.retrieve(job_id)}")


def test_chat_job_through_openais_client(ferry: openai.OpenAI) -> None:
    upload = ferry.files.create(file=("train.jsonl", jsonl([chat_record(i) for i in range(16)])), purpose="fine-tune")
    assert (upload.object, upload.purpose, upload.filename) == ("file", "fine-tune", "train.jsonl")

    job = ferry.fine_tuning.jobs.create(
        model="llama",
        training_file=upload.id,
        suffix="tiny",
        seed=7,
        hyperparameters={"n_epochs": 1, "batch_size": 2},
        extra_body={"ferry": {**TINY, "checkpoint": {"every_steps": 4}}},
    )
    assert (job.object, job.model, job.training_file, job.seed) == ("fine_tuning.job", "llama", upload.id, 7)
    assert job.status in ("queued", "running") and job.fine_tuned_model is None
    assert job.method.type == "supervised"
    assert job.hyperparameters.model_dump() == {"n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 1.0}

    events = follow(ferry, job.id, "succeeded")
    assert events[0].message == "The job has successfully completed"
    assert [e.created_at for e in events] == sorted((e.created_at for e in events), reverse=True)
    metrics = [e for e in events if e.type == "metrics"]
    assert [e.data["step"] for e in metrics] == list(range(8, 0, -1))  # 16 chats, batch 2, one epoch
    assert all(e.data["train_loss"] > 0 and e.message.startswith(f"Step {e.data['step']}/8") for e in metrics)
    older = ferry.fine_tuning.jobs.list_events(job.id, after=events[0].id, limit=2)
    assert [e.id for e in older.data] == [e.id for e in events[1:3]] and older.has_more

    done = ferry.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded" and done.fine_tuned_model == f"ft:llama:tiny:{job.id}"
    assert done.finished_at >= done.created_at and done.error is None

    checkpoints = ferry.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [8, 4]
    assert checkpoints[0].fine_tuned_model_checkpoint == f"ft:llama:tiny:{job.id}:ckpt-step-8"
    assert checkpoints[0].metrics.train_loss == next(e.data["train_loss"] for e in metrics if e.data["step"] == 8)
    assert [j.id for j in ferry.fine_tuning.jobs.list()] == [job.id]

    # The same job is an ordinary Ferry job.
    ferry_job = ferry.get(f"/jobs/{job.id}", cast_to=dict)  # type: ignore[type-var]
    assert ferry_job["status"] == "succeeded" and ferry_job["spec"]["training"]["seed"] == 7

    other = ferry.fine_tuning.jobs.create(
        model="llama", training_file=upload.id, hyperparameters={"n_epochs": 50}, extra_body={"ferry": TINY}
    )
    cancelled = ferry.fine_tuning.jobs.cancel(other.id)
    assert cancelled.status in ("cancelled", "running")
    follow(ferry, other.id, "cancelled")
    assert ferry.fine_tuning.jobs.retrieve(other.id).status == "cancelled"
    page = ferry.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in page.data] == [other.id] and page.has_more
    assert [j.id for j in page] == [other.id, job.id]  # the client follows `after`
    with pytest.raises(openai.ConflictError, match="cancelled"):
        ferry.fine_tuning.jobs.resume(other.id)


def test_refusals_are_openais_error_envelope(ferry: openai.OpenAI) -> None:
    upload = ferry.files.create(file=("train.jsonl", jsonl([chat_record(i) for i in range(4)])), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as missing:
        ferry.fine_tuning.jobs.create(model="llama", training_file="file-0123456789ab")
    assert missing.value.body == {
        "message": "training_file: no uploaded file 'file-0123456789ab'; upload it with POST /v1/files first.",
        "type": "invalid_request_error",
        "param": "training_file",
        "code": "invalid_request",
    }
    with pytest.raises(openai.BadRequestError) as model:
        ferry.fine_tuning.jobs.create(model="nope", training_file=upload.id, extra_body={"ferry": TINY})
    assert model.value.body["param"] == "model" and model.value.body["code"] == "invalid_spec"
    assert "'nope' does not exist" in model.value.body["message"]
    with pytest.raises(openai.BadRequestError) as dpo:
        ferry.fine_tuning.jobs.create(model="llama", training_file=upload.id, method={"type": "dpo"})
    assert dpo.value.body["message"] == (
        "training_file: holds chat rows; a dpo job trains on preference rows "
        "(input, preferred_output, non_preferred_output)"
    )
    with pytest.raises(openai.NotFoundError, match="No job with id 'job-nothing'"):
        ferry.fine_tuning.jobs.retrieve("job-nothing")
    with pytest.raises(openai.BadRequestError) as limit:
        ferry.fine_tuning.jobs.list(limit=1000)
    assert limit.value.body["param"] == "limit" and limit.value.body["type"] == "invalid_request_error"
    wrong = openai.OpenAI(base_url=str(ferry.base_url), api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.fine_tuning.jobs.list()


@pytest.mark.skipif("objective" not in TrainingSpec.model_fields, reason="needs training.objective (DPO) in jobs")
def test_dpo_job_on_preference_pairs(ferry: openai.OpenAI) -> None:
    words = corpus_lines(60)
    pairs = [
        {
            "input": {"messages": [{"role": "user", "content": words[3 * i]}]},
            "preferred_output": [{"role": "assistant", "content": words[3 * i + 1]}],
            "non_preferred_output": [{"role": "assistant", "content": words[3 * i + 2]}],
        }
        for i in range(8)
    ]
    upload = ferry.files.create(file=("pairs.jsonl", jsonl(pairs)), purpose="fine-tune")
    job = ferry.fine_tuning.jobs.create(
        model="llama",
        training_file=upload.id,
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 1, "batch_size": 2}}},
        extra_body={"ferry": TINY},
    )
    assert job.method.type == "dpo"
    assert job.method.dpo.hyperparameters.beta == 0.2
    follow(ferry, job.id, "succeeded")
    spec = ferry.get(f"/jobs/{job.id}", cast_to=dict)["spec"]  # type: ignore[type-var]
    assert spec["training"]["objective"] == "dpo" and spec["training"]["dpo"]["beta"] == 0.2
    assert spec["data"]["format"] == "preference"


def test_twelve_chats_with_no_hyperparameters_succeed(ferry: openai.OpenAI) -> None:
    """OpenAI's minimum (10 examples, here 12) and no hyperparameters: ``auto`` picks a batch and epochs the
    packed data fills, and the job's events say what was chosen."""
    upload = ferry.files.create(file=("train.jsonl", jsonl([chat_record(i) for i in range(12)])), purpose="fine-tune")
    settings = {"device": "cpu", "model": {"dtype": "float32"}, "lora": {"rank": 4}}  # no data.seq_len, no batch
    job = ferry.fine_tuning.jobs.create(model="llama", training_file=upload.id, extra_body={"ferry": settings})
    events = follow(ferry, job.id, "succeeded")
    chosen = [e.message for e in events if "auto ->" in e.message]
    assert any(m.startswith("batch_size auto -> 1 because") for m in chosen), chosen
    assert any(m.startswith("epochs auto -> 8 because") for m in chosen), chosen
    done = ferry.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded"
    assert done.hyperparameters.model_dump() == {"n_epochs": 8, "batch_size": 1, "learning_rate_multiplier": 1.0}
