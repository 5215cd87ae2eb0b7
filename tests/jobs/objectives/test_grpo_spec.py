"""The ``training.grpo`` section and its rules: G >= 2, a grader, prompt-only data, beta needs LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.errors import JobSpecError
from jobs.paths import PathRoots
from jobs.spec.loading import load_job_spec
from tests.jobs.llm_helpers import llm_spec, write_jsonl

GRADER = {"type": "string_check", "reference": "{{item.answer}}", "operation": "eq"}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "models" / "llama").mkdir(parents=True)
    (tmp_path / "models" / "tok").mkdir(parents=True)
    write_jsonl(tmp_path / "data" / "prompts.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    return tmp_path


def grpo_spec(grpo: dict[str, Any], **sections: Any) -> dict[str, Any]:
    base = llm_spec(
        data={"path": "prompts.jsonl", "format": "prompt"},
        training={"objective": "grpo", "steps": 2, "grpo": {"grader": GRADER, "num_generations": 4, **grpo}},
    )
    return llm_spec(**{**base, **sections})


def load(data: dict[str, Any], root: Path) -> Any:
    roots = PathRoots(model_roots=[root / "models"], data_roots=[root / "data"])
    return load_job_spec(yaml.safe_dump(data), roots)


def test_a_grpo_spec_loads_with_trls_defaults(root: Path) -> None:
    grpo = load(grpo_spec({}), root).training.grpo
    assert (grpo.loss_type, grpo.beta, grpo.epsilon, grpo.temperature) == ("dapo", 0.0, 0.2, 1.0)
    assert grpo.grader.type == "string_check"


def test_one_generation_is_refused_naming_the_field(root: Path) -> None:
    with pytest.raises(JobSpecError, match="num_generations"):
        load(grpo_spec({"num_generations": 1}), root)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"grpo": {"grader": None}}, "training.grpo.grader"),
        ({"grpo": {"beta": 0.04}, "lora": None}, "training.grpo.beta"),
        ({"data": {"format": "chat"}}, "training.objective"),
    ],
)
def test_broken_grpo_setups_are_refused_naming_the_field(root: Path, change: dict[str, Any], field: str) -> None:
    data = grpo_spec(change.get("grpo", {}))
    if change.get("grpo", {}).get("grader", GRADER) is None:
        data["training"]["grpo"].pop("grader")
    if "lora" in change:
        data.pop("lora")
    if "data" in change:
        data["data"] = {**data["data"], **change["data"]}
    with pytest.raises(JobSpecError, match=field.replace(".", r"\.")):
        load(data, root)


def test_a_python_grader_file_that_is_not_there_is_refused_at_load(root: Path) -> None:
    missing = {"type": "python", "file": "graders/missing.py"}
    with pytest.raises(JobSpecError) as refused:
        load(grpo_spec({"grader": missing}), root)
    (problem,) = refused.value.problems
    assert problem.path == "training.grpo.grader.file" and "missing.py" in problem.message


def test_eval_and_text_samples_are_refused_for_grpo(root: Path) -> None:
    data = grpo_spec({})
    data["text_samples"] = {"prompts": ["hi"], "every_steps": 1}
    with pytest.raises(JobSpecError, match="text_samples"):
        load(data, root)


def test_prompt_rows_without_grpo_are_refused(root: Path) -> None:
    data = grpo_spec({})
    data["training"] = {"steps": 2}
    with pytest.raises(JobSpecError, match="training.objective: grpo"):
        load(data, root)


def test_beta_with_lora_loads(root: Path) -> None:
    assert load(grpo_spec({"beta": 0.04}), root).training.grpo.beta == 0.04


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.jobs.llm_helpers import save_bpe_tokenizer, save_llama

    root = tmp_path_factory.mktemp("grpo")
    save_bpe_tokenizer(root / "models" / "tok")
    save_llama(root / "models" / "llama")
    rows = [{"prompt": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(6)]
    rows += [{"prompt": [{"role": "user", "content": "say hi"}], "answer": "hi"}]
    rows += [{"prompt": "a very long prompt " * 40, "answer": "x"}]  # longer than seq_len: skipped
    write_jsonl(root / "data" / "prompts.jsonl", rows)
    return root


@pytest.mark.parametrize("lora", [True, False])
def test_a_grpo_job_runs_and_reports_its_figures_per_step(tiny: Path, tmp_path: Path, lora: bool) -> None:
    from jobs.events import event_to_wire
    from jobs.train.runner import run_job

    data = grpo_spec(
        {"num_generations": 3, "max_new_tokens": 6, "beta": 0.04 if lora else 0.0, "loss_type": "grpo"},
        training={
            "objective": "grpo",
            "steps": 2,
            "batch_size": 2,
            "gradient_accumulation_steps": 2,
            "learning_rate": 1e-2,
            "grpo": {
                "num_generations": 3,
                "max_new_tokens": 6,
                "beta": 0.04 if lora else 0.0,
                "grader": {"type": "string_check", "reference": "{{item.answer}}", "operation": "like"},
                "samples_every_steps": 2,
                "samples_prompts": 1,
            },
        },
    )
    if not lora:
        data.pop("lora")
    events: list[dict[str, Any]] = []
    run_job(load(data, tiny), output_dir=tmp_path / "out", report=lambda e: events.append(event_to_wire(e)))
    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) == 2 and events[-1]["status"] == "succeeded"
    for step in steps:
        figures = step["grpo"]
        assert 0 <= figures["reward_mean"] <= 1 and 0 < figures["completion_length"] <= 6
        assert (figures["kl"] is not None) == lora
        assert step["loss"] == step["loss"]  # finite, not NaN
        # 2 prompts x 2 micro-batches x 3 completions, sampled together; their throughput apart from training's
        assert figures["generated_tokens"] == round(12 * figures["completion_length"])
        assert figures["generation_tokens_per_s"] == figures["generated_tokens"] / figures["generation_s"]
        assert figures["training_s"] > 0 and figures["training_tokens_per_s"] > 0
    samples = [e for e in events if e["type"] == "sample"]
    assert [s["step"] for s in samples] == [2, 2, 2]  # every 2 steps: one prompt's 3 completions
    assert len({s["prompt"] for s in samples}) == 1 and all(s["reward"] in (0.0, 1.0) for s in samples)
    assert all(isinstance(s["text"], str) for s in samples)


def test_prompts_longer_than_the_context_are_skipped_and_none_fitting_is_refused(root: Path) -> None:
    from jobs.data.tokenizers import ByteTokenizer
    from jobs.objectives.prompts import PromptData

    write_jsonl(root / "data" / "prompts.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "x" * 40}])
    byte = {"data": {"path": "prompts.jsonl", "format": "prompt", "seq_len": 20, "tokenizer": {"kind": "byte"}}}
    spec = load(grpo_spec({"max_new_tokens": 8}, **byte), root)
    data = PromptData.from_spec(spec, ByteTokenizer())
    assert (len(data.rows), data.skipped_long) == (1, 1)
    assert data.rows[0][1]["answer"] == "2" and data.prompts(0)[0][0] == ByteTokenizer().encode("1+1=")
    spec = load(grpo_spec({"max_new_tokens": 18}, **byte), root)
    with pytest.raises(ValueError, match="data.seq_len"):
        PromptData.from_spec(spec, ByteTokenizer())


def test_the_fit_check_sizes_a_grpo_micro_batch_as_its_prompts_times_their_completions(root: Path) -> None:
    from jobs.models.decoder_activations import rows_per_micro_batch

    data = grpo_spec({"num_generations": 8})
    data["training"]["batch_size"] = 2
    spec = load(data, root)
    assert rows_per_micro_batch(spec) == 16  # 2 prompts x 8 completions, trained as one batch (was 4: pairs)


def test_a_grpo_job_under_a_memory_limit_holds_the_streamed_weights_through_generation(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from jobs.events import event_to_wire
    from jobs.train.runner import run_job

    data = grpo_spec(
        {"num_generations": 2, "max_new_tokens": 4},
        # no budget: training streams every frozen unit, each step
        offload={"enable_model_cpu_offload": True, "granularity": "block", "gpu_memory_limit": "2GiB",
                 "gpu_memory_budget": None},
    )  # fmt: skip
    events: list[dict[str, Any]] = []
    with caplog.at_level("INFO", logger="jobs.objectives.grpo"):
        run_job(load(data, tiny), output_dir=tmp_path / "out", report=lambda e: events.append(event_to_wire(e)))
    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) == 2 and events[-1]["status"] == "succeeded"
    kept = [step["grpo"]["generation_units_kept"] for step in steps]
    assert kept[0] > 0 and kept[0] == kept[1]  # every unit the LoRA job streams, held for each step's decode loop
    assert any(f"generation kept {kept[0]} of {kept[0]} streamed units" in r.message for r in caplog.records)
