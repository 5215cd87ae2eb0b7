"""grpo's bad input: prompt rows checked at submit (a bad row, none fitting the context, fewer than a batch),
OpenAI's reinforcement rows read as prompts, the skipped long prompts said in the job's events, and a step whose
rewards are all equal trains on advantage 0 (logged, no division by zero)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs import PathRoots, load_job_spec
from jobs.errors import SpecProblem
from jobs.spec.preflight import preflight_problems
from tests.jobs.llm_helpers import llm_spec, save_bpe_tokenizer, save_llama, write_jsonl

ANSWER = {"type": "string_check", "reference": "{{item.answer}}", "operation": "like"}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> PathRoots:
    root = tmp_path_factory.mktemp("prompts")
    save_bpe_tokenizer(root / "models" / "tok")
    save_llama(root / "models" / "llama")
    return PathRoots(model_roots=[root / "models"], data_roots=[root / "data"])


def grpo_job(roots: PathRoots, rows: list[dict[str, Any]], *, grader: dict[str, Any] = ANSWER, **training: Any) -> Any:
    write_jsonl(roots.data_roots[0] / "prompts.jsonl", rows)
    spec = llm_spec(
        data={"path": "prompts.jsonl", "format": "prompt"},
        training={
            "objective": "grpo",
            "steps": 2,
            "batch_size": 2,
            "learning_rate": 1e-2,
            "grpo": {"num_generations": 2, "max_new_tokens": 4, "grader": grader},
            **training,
        },
    )
    spec["training"] = {key: value for key, value in spec["training"].items() if value is not None}
    return load_job_spec(yaml.safe_dump(spec), roots)


def sums(count: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"{i} plus {i}?"}], "answer": str(2 * i)} for i in range(count)]


def test_openais_reinforcement_rows_pass_the_submit_check(roots: PathRoots) -> None:
    assert preflight_problems(grpo_job(roots, sums(4))) == []


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"answer": "4"}, "field 'prompt': is missing"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}]}, "messages[1]"),
        ({"prompt": [{"role": "narrator", "content": "hi"}]}, "field 'prompt[0].role'"),
    ],
)
def test_a_bad_prompt_row_is_refused_at_submit_naming_row_and_field(
    roots: PathRoots, row: dict[str, Any], field: str
) -> None:
    [problem] = preflight_problems(grpo_job(roots, [*sums(3), row]))
    assert problem.path == "data.path" and "prompts.jsonl row 4: " in problem.message and field in problem.message


def test_prompts_longer_than_the_context_are_refused_when_none_fits(roots: PathRoots) -> None:
    long = [{"prompt": "a long prompt, longer than the context " * 8, "answer": "x"}] * 3
    assert preflight_problems(grpo_job(roots, long)) == [
        SpecProblem(
            "data.seq_len",
            "none of the 3 prompts read fits in data.seq_len=64 with room for training.grpo.max_new_tokens=4; "
            "raise data.seq_len or lower max_new_tokens",
        )
    ]
    [fewer] = preflight_problems(grpo_job(roots, [*long, *sums(1)]))
    assert fewer.path == "training.batch_size" and fewer.message.startswith("1 prompts fit data.seq_len=64")
    job = grpo_job(roots, sums(2), grpo={"num_generations": 2, "max_new_tokens": 64, "grader": ANSWER})
    assert [p.path for p in preflight_problems(job)] == ["training.grpo.max_new_tokens"]


def test_equal_rewards_train_on_advantage_zero_and_long_prompts_and_grader_errors_are_said(
    roots: PathRoots, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A grader that raises on every completion: each reward is 0, so every group's rewards are equal, every
    advantage is 0 and the loss is 0 (not NaN), and the error is said once in the events; the prompt too long for
    the context is skipped, and the events say so."""
    from jobs.events import event_to_wire
    from jobs.train.runner import run_job

    never = {"type": "python", "source": "def grade(sample, item):\n    raise ValueError('bad grader')\n"}
    long = {"prompt": "a long prompt, longer than the context " * 8, "answer": "x"}
    events: list[dict[str, Any]] = []
    caplog.set_level(logging.INFO, logger="jobs.objectives.grpo")
    run_job(
        grpo_job(roots, [*sums(4), long], grader=never),
        output_dir=tmp_path,
        report=lambda e: events.append(event_to_wire(e)),
    )
    assert events[-1]["status"] == "succeeded"
    steps = [e for e in events if e["type"] == "step"]
    assert [s["grpo"]["frac_reward_zero_std"] for s in steps] == [1.0, 1.0]
    assert all(s["grpo"]["reward_std"] == 0 and s["loss"] == 0.0 for s in steps)
    notes = [e["message"] for e in events if e["type"] == "log" and e["level"] == "warning"]
    assert "grpo: 4 prompts; 1 skipped: longer than data.seq_len - max_new_tokens" in notes
    assert [n for n in notes if "bad grader" in n] == [
        "grader 'python' (python): RuntimeError: ValueError: bad grader; reward 0"
    ]
    equal = "grpo: a group's rewards are all equal; its advantages are 0 (no update from it)"
    assert [r.getMessage() for r in caplog.records].count(equal) == 1  # said once, not once per step


def test_auto_batch_and_epochs_count_the_prompts_that_fit(roots: PathRoots) -> None:
    from jobs.data.auto_size import choose_auto

    long = {"prompt": "a long prompt, longer than the context " * 8, "answer": "x"}
    job = grpo_job(roots, [*sums(12), long], batch_size="auto", epochs="auto", steps=None)
    assert preflight_problems(job) == []
    chosen, notes = choose_auto(job)
    assert (chosen.training.batch_size, chosen.training.epochs) == (1, 8)  # OpenAI's rules over 12 prompts
    assert notes[0].endswith(
        "the data makes 12 prompt(s) with room for training.grpo.max_new_tokens in data.seq_len=64"
    )
