"""Checks at submit time against the files a spec names: the data's first rows, the model's module names."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jobs import PathRoots, load_job_spec
from jobs.cli import main
from jobs.errors import SpecProblem
from jobs.spec.preflight import preflight_problems
from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, save_llama, write_jsonl


@pytest.fixture
def llm_roots(tmp_path: Path) -> PathRoots:
    models, data = tmp_path / "models", tmp_path / "data"
    save_bpe_tokenizer(models / "tok")
    save_bpe_tokenizer(models / "tok-plain", chat_template=None)
    save_llama(models / "llama")
    write_jsonl(data / "chat.jsonl", [chat_record(i) for i in range(8)])
    return PathRoots(model_roots=[models], data_roots=[data])


def problems(roots: PathRoots, **sections: object) -> list[SpecProblem]:
    return preflight_problems(load_job_spec(yaml.safe_dump(llm_spec(**sections)), roots), roots)


def test_good_chat_data_and_targets_pass(llm_roots: PathRoots) -> None:
    assert problems(llm_roots) == []


def test_a_wrong_role_names_the_row_and_field(llm_roots: PathRoots) -> None:
    rows = [chat_record(i) for i in range(8)]
    rows[2]["messages"][2] = {"role": "assistant", "text": "no content key"}
    write_jsonl(llm_roots.data_roots[0] / "chat.jsonl", rows)
    assert problems(llm_roots) == [
        SpecProblem(
            "data.path", "chat.jsonl row 3: field 'messages[2].content': must be a string; got None (data.format: chat)"
        )
    ]


def test_a_wrong_format_names_the_missing_field(llm_roots: PathRoots) -> None:
    (found,) = problems(llm_roots, data={"format": "instruction"})
    assert found.path == "data.path"
    assert found.message == (
        "chat.jsonl row 1: field 'instruction': is missing: the record is in TRL's conversational language modeling "
        "layout (it has messages), which data.format: instruction does not read as set; train it with "
        "data.format: chat (data.format: instruction)"
    )


def test_a_tokenizer_without_chat_template_needs_one_in_the_spec(llm_roots: PathRoots) -> None:
    (found,) = problems(llm_roots, data={"tokenizer": {"kind": "hf", "path": "tok-plain"}})
    # The path as the spec wrote it, never the server's layout (old code: the tokenizer at /tmp/.../models/tok-plain).
    assert found == SpecProblem(
        "data.chat_template",
        "the tokenizer at 'tok-plain' has no chat template; set data.chat_template (a Jinja template, or 'chatml')",
    )
    assert problems(llm_roots, data={"tokenizer": {"kind": "hf", "path": "tok-plain"}, "chat_template": "chatml"}) == []


def test_a_broken_template_in_the_spec_is_refused(llm_roots: PathRoots) -> None:
    (found,) = problems(llm_roots, data={"chat_template": "{{ messages[0]['nope'] + 1 }}"})
    assert found.path == "data.path" and "the chat template failed" in found.message


def test_lora_targets_are_checked_against_the_models_config_without_weights(llm_roots: PathRoots) -> None:
    (found,) = problems(llm_roots, lora={"target_modules": ["q_proj", "to_q"], "modules_to_save": ["lm_head"]})
    assert found.path == "lora.target_modules"
    assert found.message.startswith("['to_q'] match no module of llama (names end in: ")
    assert "q_proj" in found.message and "down_proj" in found.message

    assert not any(ending.isdigit() for ending in found.message.split("names end in: ")[1].rstrip(")").split(", "))


@pytest.mark.parametrize(
    ("target", "matched", "inside"),
    [("mlp", "model.layers.0.mlp (and 1 more)", "down_proj, gate_proj, up_proj"), ("1", "model.layers.1", "down_proj")],
)
def test_a_lora_target_peft_cannot_wrap_is_refused_with_the_layers_inside_it(
    llm_roots: PathRoots, target: str, matched: str, inside: str
) -> None:
    # A container (`mlp`) or a layer index (`1`) matched names, so it passed, and peft raised in the worker.
    (found,) = problems(llm_roots, lora={"target_modules": ["q_proj", target]})
    assert found.path == "lora.target_modules"
    assert found.message.startswith(
        f"{target!r} matches {matched}, which holds other modules and LoRA cannot wrap (it wraps Linear, Embedding "
        f"and convolution layers); name the layers inside it instead (e.g. {inside}"
    )


def test_unreadable_data_is_a_problem_not_a_crash(llm_roots: PathRoots) -> None:
    (llm_roots.data_roots[0] / "chat.jsonl").write_text('{"messages": [\n')
    (found,) = problems(llm_roots)
    assert found.path == "data.path" and found.message.startswith("cannot read 'chat.jsonl': ")
    assert str(llm_roots.data_roots[0]) not in found.message


def test_a_directory_without_a_tokenizer_is_one_line_naming_it(llm_roots: PathRoots) -> None:
    (llm_roots.model_roots[0] / "empty").mkdir()
    (found,) = problems(llm_roots, data={"tokenizer": {"kind": "hf", "path": "empty"}})
    # Old code: transformers' five lines ("Couldn't instantiate the backend tokenizer ..."), no path.
    assert found == SpecProblem(
        "data.tokenizer.path",
        "'empty' holds no tokenizer (tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json); point "
        "data.tokenizer.path at a directory written by save_pretrained (the model's own directory usually holds "
        "its tokenizer)",
    )


def test_a_librarys_error_naming_a_file_shows_it_relative_to_its_root(llm_roots: PathRoots) -> None:
    broken = llm_roots.model_roots[0] / "broken"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text("{not json")
    (found,) = problems(llm_roots, data={"tokenizer": {"kind": "hf", "path": "broken"}})
    assert found.path == "data.tokenizer.path" and found.message.startswith("cannot load the tokenizer at 'broken': ")
    assert str(llm_roots.model_roots[0]) not in found.message and "\n" not in found.message


def test_validate_command_reports_data_problems(
    llm_roots: PathRoots, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(llm_spec(data={"format": "instruction"})))
    roots = ["--model-root", str(llm_roots.model_roots[0]), "--data-root", str(llm_roots.data_roots[0])]
    assert main(["validate", str(spec), *roots]) == 2
    assert "chat.jsonl row 1: field 'instruction': is missing" in capsys.readouterr().err


def test_spec_rules_for_chat(llm_roots: PathRoots) -> None:
    from jobs.errors import JobSpecError

    data = llm_spec(data={"tokenizer": {"kind": "byte"}, "packing": "packed"}, lora=None)
    data["model"] = {"kind": "transformer_lm", "vocab_size": 257, "hidden_size": 32, "num_layers": 1, "num_heads": 4}
    with pytest.raises(JobSpecError) as error:
        load_job_spec(yaml.safe_dump(data), llm_roots)
    assert {(p.path, p.message) for p in error.value.problems} == {
        ("data.tokenizer", "data.format: chat renders messages with a chat template; use {kind: hf, path: ...}"),
        (
            "data.packing",
            "transformer_lm cannot keep packed documents apart (no position ids); use packing: padded or auto",
        ),
    }


def test_a_bad_sharegpt_row_names_the_file_row_and_turn(llm_roots: PathRoots) -> None:
    rows = [
        {"conversations": [{"from": "human", "value": "the fox"}, {"from": "gpt", "value": "jumps"}]} for _ in range(4)
    ]
    write_jsonl(llm_roots.data_roots[0] / "share.jsonl", rows)
    assert problems(llm_roots, data={"path": "share.jsonl"}) == []
    rows[3]["conversations"][1]["from"] = "bot"
    write_jsonl(llm_roots.data_roots[0] / "share.jsonl", rows)
    assert problems(llm_roots, data={"path": "share.jsonl"}) == [
        SpecProblem(
            "data.path",
            "share.jsonl row 4: field 'conversations[1].from': must be one of human, gpt, system, user, assistant, "
            "tool; got 'bot' (data.format: chat)",
        )
    ]


CONVERSATION = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "the quick fox"}]


def test_chat_sample_prompts_are_checked_at_submit(llm_roots: PathRoots) -> None:
    from jobs.errors import JobSpecError

    assert problems(llm_roots, text_samples={"prompts": ["the fox", CONVERSATION]}) == []
    bad = [
        [{"role": "narrator", "content": "x"}],
        [{"role": "user", "content": "  "}],
        [],
        [*CONVERSATION, {"role": "assistant", "content": "jumps"}],
    ]
    with pytest.raises(JobSpecError) as error:
        load_job_spec(yaml.safe_dump(llm_spec(text_samples={"prompts": bad})), llm_roots)
    assert {(p.path, p.message) for p in error.value.problems} == {
        (
            "text_samples.prompts.0.0.role",
            "must be one of system, user, assistant, tool, developer; got 'narrator'",
        ),
        ("text_samples.prompts.1.0.content", "must be non-empty text"),
        ("text_samples.prompts.2", "a chat prompt needs at least one message, e.g. [{role: user, content: ...}]"),
        (
            "text_samples.prompts.3.2.role",
            "the model writes the next assistant turn; end a chat prompt with a user turn",
        ),
    }


def test_chat_sample_prompts_need_a_chat_template(llm_roots: PathRoots) -> None:
    plain = {"tokenizer": {"kind": "hf", "path": "tok-plain"}, "format": "text", "path": "chat.jsonl"}
    write_jsonl(llm_roots.data_roots[0] / "chat.jsonl", [{"text": "the quick fox"}] * 80)  # enough rows for a batch
    (found,) = problems(llm_roots, data=plain, text_samples={"prompts": [CONVERSATION]})
    assert found == SpecProblem(
        "text_samples.prompts",
        "chat messages need a chat template and the tokenizer at 'tok-plain' has none; "
        "set data.chat_template (a Jinja template, or 'chatml')",
    )
    # A template given in the spec serves the prompts even though the data is plain text.
    assert (
        problems(llm_roots, data={**plain, "chat_template": "chatml"}, text_samples={"prompts": [CONVERSATION]}) == []
    )
    refuses_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    (found,) = problems(
        llm_roots, data={**plain, "chat_template": refuses_system}, text_samples={"prompts": ["a", CONVERSATION]}
    )
    assert found.path == "text_samples.prompts.1" and "no system role" in found.message


def test_chat_sample_prompts_need_an_hf_tokenizer(llm_roots: PathRoots) -> None:
    from jobs.errors import JobSpecError

    data = llm_spec(data={"format": "text", "tokenizer": {"kind": "byte"}}, text_samples={"prompts": [CONVERSATION]})
    data["model"] = {"kind": "transformer_lm", "vocab_size": 257, "hidden_size": 32, "num_layers": 1, "num_heads": 4}
    data.pop("lora")
    with pytest.raises(JobSpecError) as error:
        load_job_spec(yaml.safe_dump(data), llm_roots)
    assert [(p.path, p.message) for p in error.value.problems] == [
        (
            "text_samples.prompts",
            "chat messages are rendered with a chat template; set data.tokenizer: {kind: hf, path: ...}",
        )
    ]


def test_a_tool_call_the_template_cannot_render_is_refused_at_submit(llm_roots: PathRoots) -> None:
    rows = [chat_record(i) for i in range(8)]
    rows[4]["messages"][2] = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}],
    }
    write_jsonl(llm_roots.data_roots[0] / "chat.jsonl", rows)
    (found,) = problems(llm_roots)  # tok's template is plain ChatML: it writes content only
    assert found.path == "data.path"
    assert found.message.startswith(
        "chat.jsonl row 5: field 'messages[2].tool_calls[0]': the chat template does not render this tool call "
        "(the text is the same without it), so it would train as an empty answer; set data.chat_template to one "
        "that renders tool_calls"
    )
    qwen = (Path(__file__).parents[1] / "data" / "templates" / "qwen2_5.jinja").read_text()
    assert problems(llm_roots, data={"chat_template": qwen}) == []


def test_a_batch_the_packed_data_cannot_fill_is_refused_with_the_count(llm_roots: PathRoots) -> None:
    """8 short chats pack into fewer 512-token rows than a batch of 4: refused at submit, not in the queue."""
    (found,) = problems(llm_roots, data={"seq_len": 512}, training={"steps": 6, "batch_size": 4})
    assert found.path == "training.batch_size"
    assert found.message == (
        "the data makes 2 packed row(s) of data.seq_len=512 tokens from 8 example(s), fewer than "
        "training.batch_size=4, so no batch can be filled; lower training.batch_size to 2 or less (or set it to "
        "auto), lower data.seq_len or add data"
    )
    assert problems(llm_roots, data={"seq_len": 512}, training={"steps": 6, "batch_size": "auto"}) == []


def test_batch_size_and_epochs_auto_are_chosen_from_the_rows(llm_roots: PathRoots) -> None:
    from jobs.data.auto_size import choose_auto

    text = yaml.safe_dump(
        llm_spec(data={"seq_len": 64}, training={"steps": None, "epochs": "auto", "batch_size": "auto"})
    )
    spec = load_job_spec(text, llm_roots)
    assert spec.training.auto == ["batch_size", "epochs"]
    chosen, notes = choose_auto(spec)
    assert (chosen.training.batch_size, chosen.training.epochs, chosen.training.auto) == (1, 12, [])
    assert notes[0].startswith("batch_size auto -> 1 because 0.2% of 8 example(s), 1 to 256, is 1; the data makes ")
    assert notes[1].startswith("epochs auto -> 12 because 8 example(s) x 12 epoch(s) is 96 examples seen")


def test_auto_on_synthetic_data_asks_for_a_number() -> None:
    text = (
        "name: x\nmodel: {kind: toy_mlp}\ndata: {kind: synthetic_regression}\ntraining: {steps: 2, batch_size: auto}\n"
    )
    (found,) = preflight_problems(load_job_spec(text))
    assert found.path == "training.batch_size" and "give a number" in found.message


def test_init_random_on_an_architecture_automodelforcausallm_cannot_build_is_one_line(llm_roots: PathRoots) -> None:
    """T5 is an encoder-decoder: refused at validate, in one line, not in the worker with transformers' 3 KB list."""
    from transformers import T5Config

    T5Config(d_model=8, num_layers=1, num_heads=1, d_ff=8, d_kv=8, vocab_size=320).save_pretrained(
        llm_roots.model_roots[0] / "t5"
    )
    model = {"kind": "hf_causal_lm", "path": "t5", "dtype": "float32", "init": "random"}
    (found,) = problems(llm_roots, model=model)
    assert found.path == "model.path"
    assert found.message == (
        "t5/config.json: model_type 't5' is not a causal LM that AutoModelForCausalLM "
        "builds; point model.path at a decoder-only causal LM's directory (model_type e.g. llama, qwen2, mistral, "
        "gemma, phi3)"
    )


def test_an_unknown_architecture_is_one_line(llm_roots: PathRoots) -> None:
    (llm_roots.model_roots[0] / "ferret").mkdir()
    (llm_roots.model_roots[0] / "ferret" / "config.json").write_text('{"model_type": "ferret", "hidden_size": 8}')
    for init in ("random", "checkpoint"):
        model = {"kind": "hf_causal_lm", "path": "ferret", "dtype": "float32", "init": init}
        (found,) = problems(llm_roots, model=model)
        assert found.path == "model.path" and "\n" not in found.message and len(found.message) < 300
        assert found.message.startswith("ferret/config.json: model_type 'ferret' is not an architecture this")


def test_grpo_prompt_rows_pass_the_submit_check(llm_roots: PathRoots) -> None:
    from tests.jobs.objectives.test_grpo_spec import GRADER

    rows = [{"prompt": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(6)]
    rows.append({"prompt": [{"role": "user", "content": "say hi"}], "answer": "hi"})
    write_jsonl(llm_roots.data_roots[0] / "prompts.jsonl", rows)
    grpo = {
        "data": {"path": "prompts.jsonl", "format": "prompt"},
        "training": {
            "objective": "grpo",
            "steps": 2,
            "grpo": {"grader": GRADER, "num_generations": 4, "max_new_tokens": 16},
        },
    }
    # Old code: "prompts.jsonl row 1: field 'messages': must be a non-empty list ..." (read as chat rows).
    assert problems(llm_roots, **grpo) == []
    write_jsonl(llm_roots.data_roots[0] / "prompts.jsonl", [{"question": "what is 1 plus 1?"}])
    (found,) = problems(llm_roots, **grpo)
    assert found.path == "data.path" and "field 'prompt': is missing; a prompt row is" in found.message
