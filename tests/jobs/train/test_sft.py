"""Chat and instruction fine-tuning end to end on a tiny Llama: eval, samples, best checkpoint, tracking."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs import PathRoots, list_checkpoints, load_job_spec, run_job
from jobs.checkpoints.directory import best_checkpoint
from jobs.events import event_to_wire
from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, save_llama, write_jsonl


@pytest.fixture
def llm_roots(tmp_path: Path) -> PathRoots:
    models, data = tmp_path / "models", tmp_path / "data"
    save_bpe_tokenizer(models / "tok")
    save_llama(models / "llama")
    write_jsonl(data / "chat.jsonl", [chat_record(i) for i in range(24)])
    return PathRoots(model_roots=[models], data_roots=[data])


def run(data: dict[str, Any], roots: PathRoots, output: Path) -> tuple[Any, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    spec = load_job_spec(yaml.safe_dump(data), roots)
    outcome = run_job(spec, output_dir=output, report=lambda event: events.append(event_to_wire(event)))
    return outcome, events


def test_chat_lora_job_evaluates_samples_and_marks_the_best_checkpoint(tmp_path: Path, llm_roots: PathRoots) -> None:
    data = llm_spec(
        eval={"split": 0.25, "every_steps": 2},
        text_samples={"prompts": ["the quick fox", "a lazy dog"], "every_steps": 3, "max_new_tokens": 5},
        checkpoint={"every_steps": 2, "keep_last": 1},
        offload={"enable_model_cpu_offload": True},
    )
    outcome, events = run(data, llm_roots, tmp_path / "out")
    assert outcome.status == "succeeded"
    summary = next(e["message"] for e in events if e["type"] == "log" and e["message"].startswith("data:"))
    assert "24 record(s) held out" not in summary and "6 record(s) held out for eval" in summary
    evals = [e for e in events if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4, 6]  # step 0: the base model, before any training
    assert all(e["perplexity"] == pytest.approx(2.718281828 ** e["eval_loss"]) for e in evals)
    assert all(e["metrics"]["tokens"] > 0 and e["metrics"]["batches"] >= 1 for e in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # it learns the held-out replies' shape
    assert evals[0]["metrics"]["best"] == 1.0 and events.index(evals[0]) < events.index(
        next(e for e in events if e["type"] == "step")
    )
    samples = [e for e in events if e["type"] == "sample"]
    assert [(e["step"], e["prompt"]) for e in samples] == [
        (3, "the quick fox"),
        (3, "a lazy dog"),
        (6, "the quick fox"),
        (6, "a lazy dog"),
    ]
    assert all(isinstance(e["text"], str) for e in samples)

    checkpoints = list_checkpoints(tmp_path / "out")
    best = min(evals, key=lambda e: e["eval_loss"])
    assert best_checkpoint(checkpoints).step == best["step"]  # kept past keep_last: 1, and marked
    assert {c.step for c in checkpoints} == {best["step"], 6}
    assert all(c.eval_loss == next(e["eval_loss"] for e in evals if e["step"] == c.step) for c in checkpoints)


def test_tensorboard_files_are_readable_by_tensorboard(tmp_path: Path, llm_roots: PathRoots) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(llm_spec(eval={"split": 0.25, "every_steps": 3}), llm_roots, tmp_path / "out")
    accumulator = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    assert {"train/loss", "train/lr", "eval/loss", "eval/perplexity"} <= set(scalars)
    assert [e.step for e in accumulator.Scalars("train/loss")] == list(range(1, 7))
    assert [e.step for e in accumulator.Scalars("eval/loss")] == [0, 3, 6]


def test_early_stopping_ends_the_job_when_eval_stops_improving(tmp_path: Path, llm_roots: PathRoots) -> None:
    # A min_delta no step can beat: the first evaluation after the base model's does not improve on it,
    # patience 1 stops there.
    data = llm_spec(
        eval={"split": 0.25, "every_steps": 2, "early_stopping": {"patience": 1, "min_delta": 100.0}},
        training={"steps": 10},
    )
    outcome, events = run(data, llm_roots, tmp_path / "out")
    assert outcome.status == "succeeded" and outcome.step == 2
    assert any(e["type"] == "log" and e["message"].startswith("early stopping at step 2") for e in events)
    assert [c.step for c in list_checkpoints(tmp_path / "out")] == [2]


@pytest.mark.parametrize("file_type", ["jsonl", "json", "csv", "parquet", "saved"])
def test_instruction_data_in_every_file_type(tmp_path: Path, llm_roots: PathRoots, file_type: str) -> None:
    import datasets

    records = [{"instruction": f"say {w}", "input": "", "output": f"{w} fox"} for w in ("a", "the", "lazy") * 4]
    table = datasets.Dataset.from_list(records)
    data_dir = llm_roots.data_roots[0]
    path = {"saved": data_dir / "saved", "jsonl": data_dir / "alpaca.jsonl"}.get(
        file_type, data_dir / f"alpaca.{file_type}"
    )
    {"jsonl": table.to_json, "json": lambda p: table.to_json(p, lines=False), "csv": table.to_csv,
     "parquet": table.to_parquet, "saved": table.save_to_disk}[file_type](str(path))  # fmt: skip
    data = llm_spec(
        data={
            "path": path.name,
            "format": "instruction",
            "prompt_template": "Q: {instruction}\nA: ",
            "packing": "padded",
        },
        training={"steps": 2},
    )
    outcome, events = run(data, llm_roots, tmp_path / "out")
    summary = next(e["message"] for e in events if e["type"] == "log" and e["message"].startswith("data:"))
    assert outcome.status == "succeeded" and summary.startswith("data: 12 record(s) -> 12 example(s)")


def test_a_bad_row_at_run_time_names_file_row_and_field(tmp_path: Path, llm_roots: PathRoots) -> None:
    rows = [chat_record(i) for i in range(30)]
    rows[25]["messages"][1]["role"] = "human"  # past the rows read at submit time
    write_jsonl(llm_roots.data_roots[0] / "chat.jsonl", rows)
    with pytest.raises(ValueError, match=r"chat.jsonl row 26: field 'messages\[1\].role': must be one of"):
        run(llm_spec(), llm_roots, tmp_path / "out")


def test_examples_all_cut_away_by_seq_len_is_an_error_naming_the_fix(tmp_path: Path, llm_roots: PathRoots) -> None:
    with pytest.raises(ValueError, match=r"all 24 example\(s\) were skipped.*raise data.seq_len \(now 8\)"):
        run(llm_spec(data={"seq_len": 8}), llm_roots, tmp_path / "out")


def test_the_loss_ignores_prompt_tokens(tmp_path: Path, llm_roots: PathRoots) -> None:
    """The training loss of a chat row is the cross-entropy over assistant tokens only."""
    import torch
    from transformers import AutoModelForCausalLM

    from jobs.data.prepare import prepare_text_data
    from jobs.models.transformer_lm import lm_loss

    data = load_job_spec(yaml.safe_dump(llm_spec()), llm_roots).data
    text = prepare_text_data(data, batch_size=2, seed=0, packed_path=True)
    batch = text.train.batch(0)
    model = AutoModelForCausalLM.from_pretrained(str(llm_roots.model_roots[0] / "llama")).eval()
    model.config.use_cache = False
    with torch.no_grad():
        loss = lm_loss(model, batch)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    targets = batch["labels"][:, 1:]
    trained = targets != -100
    assert 0 < trained.sum() < targets.numel() / 2  # most tokens are prompt: system, user, headers
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none")
    torch.testing.assert_close(loss, per_token[trained.flatten()].mean())


def test_eval_from_its_own_file(tmp_path: Path, llm_roots: PathRoots) -> None:
    write_jsonl(llm_roots.data_roots[0] / "held-out.jsonl", [chat_record(i) for i in range(30, 34)])
    outcome, events = run(llm_spec(eval={"path": "held-out.jsonl"}, training={"steps": 2}), llm_roots, tmp_path / "o")
    assert outcome.status == "succeeded"
    summary = next(e["message"] for e in events if e["type"] == "log" and e["message"].startswith("data:"))
    assert summary.startswith("data: 24 record(s)") and "4 record(s) held out for eval" in summary
    assert [e["step"] for e in events if e["type"] == "eval"] == [0, 2]


def test_early_stopping_counts_survive_a_pause_and_resume(tmp_path: Path, llm_roots: PathRoots) -> None:
    data = llm_spec(
        eval={"split": 0.25, "every_steps": 2, "early_stopping": {"patience": 3, "min_delta": 100.0}},
        training={"steps": 10},
    )
    spec = load_job_spec(yaml.safe_dump(data), llm_roots)
    polls = iter(range(100))
    paused = run_job(spec, output_dir=tmp_path / "o", should_stop=lambda: "pause" if next(polls) == 4 else None)
    assert (paused.status, paused.step) == ("paused", 4)  # evaluations at 0 (best), 2 and 4 (no better)
    events: list[dict[str, Any]] = []
    resumed = run_job(spec, output_dir=tmp_path / "o", report=lambda e: events.append(event_to_wire(e)))
    assert (resumed.status, resumed.step) == ("succeeded", 6)  # the third evaluation without improvement stops it
    assert [e["step"] for e in events if e["type"] == "eval"] == [6]  # step 0's is not repeated


def test_the_base_model_is_evaluated_once_at_step_0_and_not_again_on_resume(
    tmp_path: Path, llm_roots: PathRoots
) -> None:
    spec = load_job_spec(yaml.safe_dump(llm_spec(eval={"split": 0.25}, training={"steps": 3})), llm_roots)
    first: list[dict[str, Any]] = []
    paused = run_job(
        spec, output_dir=tmp_path / "o", report=lambda e: first.append(event_to_wire(e)), should_stop=lambda: "pause"
    )
    assert (paused.status, paused.step) == ("paused", 0)  # paused before the first step, after the base's eval
    assert [e["step"] for e in first if e["type"] == "eval"] == [0]
    resumed: list[dict[str, Any]] = []
    outcome = run_job(spec, output_dir=tmp_path / "o", report=lambda e: resumed.append(event_to_wire(e)))
    assert (outcome.status, outcome.step) == ("succeeded", 3)
    assert [e["step"] for e in resumed if e["type"] == "eval"] == [3]


def test_eval_at_start_false_skips_the_base_model(tmp_path: Path, llm_roots: PathRoots) -> None:
    data = llm_spec(eval={"split": 0.25, "at_start": False}, training={"steps": 2})
    _, events = run(data, llm_roots, tmp_path / "o")
    assert [e["step"] for e in events if e["type"] == "eval"] == [2]


def test_text_samples_from_chat_messages_render_with_the_template(tmp_path: Path, llm_roots: PathRoots) -> None:
    from jobs.data.tokenizers import HFTokenizer
    from jobs.evaluate.text_samples import prompt_text

    conversation = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "the quick fox"}]
    data = llm_spec(text_samples={"prompts": ["a lazy dog", conversation], "max_new_tokens": 3}, training={"steps": 1})
    spec = load_job_spec(yaml.safe_dump(data), llm_roots)
    tokenizer = HFTokenizer(llm_roots.model_roots[0] / "tok")
    assert spec.text_samples is not None
    assert prompt_text(spec.text_samples.prompts[1], spec.data, tokenizer) == (
        "<|im_start|>system\nanswer briefly<|im_end|>\n<|im_start|>user\nthe quick fox<|im_end|>\n<|im_start|>assistant\n"
    )
    _, events = run(data, llm_roots, tmp_path / "o")
    samples = [(e["step"], e["prompt"]) for e in events if e["type"] == "sample"]
    assert samples == [(1, "a lazy dog"), (1, "system: answer briefly\nuser: the quick fox")]
