"""OpenAI's reinforcement fine-tuning on Ferry, driven by OpenAI's own client: prompt rows with the columns the
grader reads, ``method: reinforcement`` with its grader and hyperparameters, the rewards per step in the events
and checkpoints; every grader or hyperparameter Ferry cannot honour refused naming its path in the request."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.jobs.llm_helpers import chat_record
from tests.service.api.test_openai_fine_tuning import TINY, ferry, follow, jsonl  # noqa: F401 (the fixture)

GRADER = {
    "type": "string_check",
    "name": "has the answer",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "like",
}
# Ferry's settings for a tiny CPU job: a few new tokens per completion.
SHORT = {**TINY, "training": {"grpo": {"max_new_tokens": 4}}}
GRPO = {**SHORT, "checkpoint": {"every_steps": 1}}


def prompts(count: int) -> bytes:
    """OpenAI's reinforcement rows: a conversation ending before the reply, and the column the grader reads."""
    return jsonl(
        [
            {"messages": [{"role": "user", "content": f"what is {i} plus {i}?"}], "answer": str(2 * i)}
            for i in range(count)
        ]
    )


def reinforcement(grader: Any = GRADER, **hyperparameters: Any) -> dict[str, Any]:
    return {"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": hyperparameters}}


def test_a_reinforcement_job_runs_to_succeeded_and_reports_rewards(ferry: openai.OpenAI) -> None:  # noqa: F811
    upload = ferry.files.create(file=("prompts.jsonl", prompts(4)), purpose="fine-tune")
    assert upload.model_extra["format"] == "prompt"
    job = ferry.fine_tuning.jobs.create(
        model="llama",
        training_file=upload.id,
        seed=3,
        method=reinforcement(n_epochs=1, batch_size=2, compute_multiplier=0.25),
        extra_body={"ferry": GRPO},
    )
    assert job.method.type == "reinforcement"
    assert job.method.reinforcement.grader.model_dump(exclude_none=True) == GRADER
    hyper = job.method.reinforcement.hyperparameters
    assert (hyper.n_epochs, hyper.batch_size, hyper.compute_multiplier, hyper.reasoning_effort) == (
        1,
        2,
        0.25,
        "default",
    )

    events = follow(ferry, job.id, "succeeded")
    metrics = [e for e in events if e.type == "metrics"]
    assert [e.data["step"] for e in metrics] == [2, 1]  # 4 prompts, batch 2, one epoch
    for event in metrics:
        mean, std = event.data["train_reward_mean"], event.data["train_reward_std"]
        assert 0 <= mean <= 1 and std >= 0
        assert event.message.endswith(f"reward mean={mean:.4f} std={std:.4f}")
    checkpoints = ferry.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [2, 1]
    assert checkpoints[0].metrics.model_extra["train_reward_mean"] == metrics[0].data["train_reward_mean"]

    spec = ferry.get(f"/jobs/{job.id}", cast_to=dict)["spec"]  # type: ignore[type-var]
    assert spec["data"]["format"] == "prompt" and spec["training"]["objective"] == "grpo"
    assert spec["training"]["grpo"]["num_generations"] == 2  # 8 × compute_multiplier 0.25
    assert spec["training"]["grpo"]["grader"]["reference"] == "{{ item.answer }}"


def test_auto_hyperparameters_are_chosen_from_the_prompts(ferry: openai.OpenAI) -> None:  # noqa: F811
    upload = ferry.files.create(file=("prompts.jsonl", prompts(12)), purpose="fine-tune")
    python = {"type": "python", "name": "exact", "source": "def grade(sample, item):\n    return 1.0\n"}
    job = ferry.fine_tuning.jobs.create(
        model="llama", training_file=upload.id, method=reinforcement(python), extra_body={"ferry": SHORT}
    )
    ferry.fine_tuning.jobs.cancel(job.id)
    hyper = ferry.fine_tuning.jobs.retrieve(job.id).method.reinforcement.hyperparameters
    assert (hyper.n_epochs, hyper.batch_size, hyper.compute_multiplier) == (8, 1, 1.0)  # OpenAI's auto rules


REFUSED = [
    ({**GRADER, "type": "label_model"}, {}, "method.reinforcement.grader.type", "label_model grades evals"),
    (
        {"type": "python", "name": "p", "source": "def grade(s, i):\n    return 1\n", "image_tag": "2025-05-08"},
        {},
        "method.reinforcement.grader.image_tag",
        "not images",
    ),
    (
        {"type": "python", "name": "p", "source": "def grade(:"},
        {},
        "method.reinforcement.grader.source",
        "not valid Python",
    ),
    (
        {**GRADER, "type": "text_similarity", "evaluation_metric": "fuzzy_match"},
        {},
        "method.reinforcement.grader.operation",
        "is no field of a text_similarity grader",
    ),
    (
        {
            k: v
            for k, v in {**GRADER, "type": "text_similarity", "evaluation_metric": "cosine"}.items()
            if k != "operation"
        },
        {},
        "method.reinforcement.grader.embedding_model",
        "cosine compares embeddings, and Ferry embeds locally: give embedding_model",
    ),
    (
        {**GRADER, "input": "{{ sample.choices }}"},
        {},
        "method.reinforcement.grader.input",
        "names nothing a grader can read",
    ),
    (
        {
            "type": "multi",
            "name": "m",
            "graders": {"exact": {**GRADER, "operation": "contains"}},
            "calculate_output": "exact",
        },
        {},
        "method.reinforcement.grader.graders.exact.operation",
        "must be one of eq, ne, like, ilike",
    ),
    (
        {"type": "multi", "name": "m", "graders": {"exact": GRADER}, "calculate_output": "exact + fuzzy"},
        {},
        "method.reinforcement.grader.calculate_output",
        "names 'fuzzy', which is no grader",
    ),
    (
        {"type": "score_model", "name": "judge", "model": "gpt-4o", "input": [{"role": "user", "content": "score"}]},
        {},
        "method.reinforcement.grader.model",
        "'gpt-4o' does not exist",
    ),
    (
        {
            "type": "score_model",
            "name": "judge",
            "model": "llama",
            "input": [{"role": "user", "content": "score"}],
            "sampling_params": {"reasoning_effort": "high"},
        },
        {},
        "method.reinforcement.grader.sampling_params.reasoning_effort",
        "leave reasoning_effort out",
    ),
    (GRADER, {"eval_interval": 5}, "method.reinforcement.hyperparameters.eval_interval", "do not evaluate"),
    (GRADER, {"eval_samples": 2}, "method.reinforcement.hyperparameters.eval_samples", "do not evaluate"),
    (GRADER, {"reasoning_effort": "high"}, "method.reinforcement.hyperparameters.reasoning_effort", "no reasoning"),
    (GRADER, {"compute_multiplier": 0.1}, "method.reinforcement.hyperparameters.compute_multiplier", "at least 2"),
]


def test_what_ferry_cannot_honour_is_refused_naming_its_path(ferry: openai.OpenAI) -> None:  # noqa: F811
    """Each case of REFUSED (one server for them all): a 400 whose param is the request's path."""
    upload = ferry.files.create(file=("prompts.jsonl", prompts(4)), purpose="fine-tune")
    for grader, hyperparameters, param, message in REFUSED:
        with pytest.raises(openai.BadRequestError) as refused:
            ferry.fine_tuning.jobs.create(
                model="llama",
                training_file=upload.id,
                method=reinforcement(grader, **hyperparameters),
                extra_body={"ferry": SHORT},
            )
        body = refused.value.body
        assert body["param"] == param and body["type"] == "invalid_request_error", body
        assert message in body["message"] and body["message"].startswith(f"{param}: "), body
    assert list(ferry.fine_tuning.jobs.list()) == []  # nothing was queued


def test_the_wrong_rows_or_no_grader_are_refused(ferry: openai.OpenAI) -> None:  # noqa: F811
    chats = ferry.files.create(file=("chat.jsonl", jsonl([chat_record(i) for i in range(4)])), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as rows:
        ferry.fine_tuning.jobs.create(model="llama", training_file=chats.id, method=reinforcement())
    assert rows.value.body["message"] == (
        "training_file: holds chat rows; a reinforcement job trains on prompt rows "
        "(messages ending before the assistant's reply, and the columns the grader reads)"
    )
    upload = ferry.files.create(file=("prompts.jsonl", prompts(4)), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as supervised:
        ferry.fine_tuning.jobs.create(model="llama", training_file=upload.id)
    assert supervised.value.body["message"].startswith("training_file: holds prompt rows; a supervised job")
    with pytest.raises(openai.BadRequestError) as none:
        ferry.fine_tuning.jobs.create(model="llama", training_file=upload.id, method={"type": "reinforcement"})
    assert none.value.body["param"] == "method.reinforcement"
    with pytest.raises(openai.BadRequestError) as missing:
        ferry.fine_tuning.jobs.create(
            model="llama", training_file=upload.id, method={"type": "reinforcement", "reinforcement": {}}
        )
    assert missing.value.body["param"] == "method.reinforcement.grader"
    with pytest.raises(openai.BadRequestError) as validation:
        ferry.fine_tuning.jobs.create(
            model="llama", training_file=upload.id, validation_file=upload.id, method=reinforcement()
        )
    assert validation.value.body["param"] == "validation_file"
