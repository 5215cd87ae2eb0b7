"""TRL's dataset layouts (https://huggingface.co/docs/trl/dataset_formats): read as TRL reads them, or refused
naming the layout and what to convert it to."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from jobs.data.formats.preference import preference_pair
from jobs.data.formats.record import IGNORE, RecordError, record_example, record_examples
from jobs.data.prepare import prepare_text_data
from jobs.data.tokenizers import HFTokenizer
from jobs.spec.job import TextDataSpec
from tests.jobs.llm_helpers import save_bpe_tokenizer

QUESTION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox"}]
ANSWER = [{"role": "assistant", "content": "jumps over"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(save_bpe_tokenizer(tmp_path_factory.mktemp("tok")))  # ChatML


def data_spec(tmp_path: Path, **fields: object) -> TextDataSpec:
    return TextDataSpec(kind="text", path=tmp_path, tokenizer={"kind": "hf", "path": tmp_path}, **fields)


def trained_text(example: Any, tokenizer: HFTokenizer) -> str:
    return tokenizer.hf.decode(
        [i for i, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE]
    )


def test_conversational_prompt_completion_trains_on_the_completion_only(tmp_path: Path, tokenizer: HFTokenizer) -> None:
    earlier = [{"role": "assistant", "content": "a fox?"}, {"role": "user", "content": "yes"}]
    record = {"prompt": QUESTION + earlier, "completion": ANSWER}
    example = record_example(record, data_spec(tmp_path, format="chat"), tokenizer)
    # One conversation through the template; the prompt's own assistant turn is context (TRL's completion-only loss).
    assert tokenizer.hf.decode(example.input_ids) == tokenizer.render_chat(
        QUESTION + earlier + ANSWER, add_generation_prompt=False
    )
    assert trained_text(example, tokenizer) == "jumps over<|im_end|>\n"
    # With train_on_prompt everything trains, as for messages.
    everything = record_example(record, data_spec(tmp_path, format="chat", train_on_prompt=True), tokenizer)
    assert "a fox?" in trained_text(everything, tokenizer) and "be brief" in trained_text(everything, tokenizer)


def test_a_prompt_completion_error_names_the_list_and_turn(tmp_path: Path, tokenizer: HFTokenizer) -> None:
    record = {"prompt": QUESTION, "completion": [{"role": "assistant", "content": 3}]}
    with pytest.raises(RecordError, match="must be a string; got 3") as error:
        record_example(record, data_spec(tmp_path, format="chat"), tokenizer)
    assert error.value.field == "completion[0].content"


def test_standard_prompt_completion_is_refused_with_the_instruction_settings(
    tmp_path: Path, tokenizer: HFTokenizer
) -> None:
    record = {"prompt": "The sky is", "completion": " blue."}
    with pytest.raises(RecordError, match="TRL's standard prompt-completion layout") as error:
        record_example(record, data_spec(tmp_path, format="chat"), tokenizer)
    assert error.value.field == "prompt"
    # The settings the message names read it as TRL does: the prompt as written, the completion and EOS train.
    instruction = data_spec(
        tmp_path,
        format="instruction",
        fields={"instruction": "prompt", "output": "completion"},
        prompt_template="{instruction}",
    )
    example = record_example(record, instruction, tokenizer)
    assert tokenizer.hf.decode(example.input_ids) == "The sky is blue.<|im_end|>"
    assert trained_text(example, tokenizer) == " blue.<|im_end|>"


IMPLICIT = {"chosen": QUESTION + ANSWER, "rejected": [*QUESTION, {"role": "assistant", "content": "sits"}]}


@pytest.mark.parametrize(
    ("format", "record", "field", "message"),
    [
        (
            "chat",
            {"prompt": QUESTION, "completion": ANSWER, "label": True},
            "label",
            "TRL's unpaired preference layout .* keep only the label-true rows",
        ),
        (
            "chat",
            IMPLICIT,
            "chosen",
            r"a preference pair \(TRL's implicit-prompt preference layout\), not chat data; train it with "
            "training.objective: dpo",
        ),
        (
            "chat",
            {"prompt": QUESTION, "chosen": ANSWER, "rejected": ANSWER},
            "chosen",
            r"a preference pair \(TRL's preference layout\)",
        ),
        (
            "preference",
            IMPLICIT,
            "prompt",
            "TRL's implicit-prompt preference layout .* move the turns they share into prompt .*trl.extract_prompt",
        ),
        (
            "preference",
            {"prompt": QUESTION, "completion": ANSWER, "label": False},
            "label",
            r"TRL's unpaired preference layout \(KTO's\), which Ferry does not train; pair each prompt's",
        ),
    ],
    ids=[
        "unpaired-as-chat",
        "implicit-as-chat",
        "preference-as-chat",
        "implicit-as-preference",
        "unpaired-as-preference",
    ],
)
def test_a_layout_the_format_does_not_train_is_refused_by_name(
    tmp_path: Path, tokenizer: HFTokenizer, format: str, record: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(RecordError, match=message) as error:
        record_example(record, data_spec(tmp_path, format=format), tokenizer)
    assert error.value.field == field


def test_standard_preference_strings_are_raw_text_as_trl_reads_them(tmp_path: Path, tokenizer: HFTokenizer) -> None:
    pair = preference_pair({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, tokenizer)
    decode = tokenizer.hf.decode
    # No chat template: no turn markers; each completion ends with EOS (TRL's add_eos).
    assert decode(pair.prompt) == "The sky is"
    assert decode(pair.chosen) == " blue.<|im_end|>" and decode(pair.rejected) == " green.<|im_end|>"
    assert tokenizer.hf.convert_tokens_to_ids("<|im_start|>") not in pair.prompt + pair.chosen + pair.rejected
    # A message-list prompt still renders with the template, the string completions as assistant turns.
    chat = preference_pair({"prompt": QUESTION, "chosen": "jumps", "rejected": "sits"}, tokenizer)
    assert decode(chat.prompt).endswith("<|im_start|>assistant\n") and decode(chat.chosen) == "jumps<|im_end|>\n"


def test_the_log_says_string_pairs_skip_the_template(
    tmp_path: Path, tokenizer: HFTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [{"prompt": f"Q{i}:", "chosen": " yes", "rejected": " no"} for i in range(4)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_bpe_tokenizer(tmp_path / "tok")
    spec = TextDataSpec(
        kind="text",
        path=tmp_path / "pairs.jsonl",
        format="preference",
        tokenizer={"kind": "hf", "path": tmp_path / "tok"},
    )
    with caplog.at_level(logging.INFO, logger="jobs.data.prepare"):
        data = prepare_text_data(spec, batch_size=2, seed=0, packed_path=False)
    note = "4 pair(s) of plain strings (TRL's standard layout) read as raw text without the chat template, as TRL does"
    assert note in data.summary and note in caplog.text


SKY, BLUE, GREEN = (
    [{"role": "user", "content": "What color is the sky?"}],
    [{"role": "assistant", "content": "It is blue."}],
    [{"role": "assistant", "content": "It is green."}],
)
# Every example of TRL's dataset formats page (standard, then conversational), by type.
TRL_LAYOUTS = {
    "standard language modeling": {"text": "The sky is blue."},
    "conversational language modeling": {"messages": SKY + BLUE},
    "standard prompt-only": {"prompt": "The sky is"},
    "conversational prompt-only": {"prompt": SKY},
    "standard prompt-completion": {"prompt": "The sky is", "completion": " blue."},
    "conversational prompt-completion": {"prompt": SKY, "completion": BLUE},
    "standard preference": {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    "standard implicit-prompt preference": {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    "conversational preference": {"prompt": SKY, "chosen": BLUE, "rejected": GREEN},
    "conversational implicit-prompt preference": {"chosen": SKY + BLUE, "rejected": SKY + GREEN},
    "standard unpaired preference": {"prompt": "The sky is", "completion": " blue.", "label": True},
    "conversational unpaired preference": {"prompt": SKY, "completion": BLUE, "label": True},
    "standard stepwise supervision": {
        "prompt": "Which number is larger, 9.8 or 9.11?",
        "completions": ["The fractional part of 9.8 is 0.8.", "The fractional part of 9.11 is 0.11."],
        "labels": [True, False],
    },
}
# The data.format that reads each layout as it is, and the text it trains on.
TRAINS = {
    ("standard language modeling", "text"): "The sky is blue.<|im_end|>",
    ("conversational language modeling", "chat"): "It is blue.<|im_end|>\n",
    ("conversational prompt-completion", "chat"): "It is blue.<|im_end|>\n",
    ("standard preference", "preference"): " blue.<|im_end|>",
    ("conversational preference", "preference"): "It is blue.<|im_end|>\n",
}


@pytest.mark.parametrize("data_format", ["text", "instruction", "chat", "preference", "prompt"])
@pytest.mark.parametrize("layout", list(TRL_LAYOUTS))
def test_every_trl_layout_trains_as_given_or_is_refused_naming_it(
    tmp_path: Path, tokenizer: HFTokenizer, layout: str, data_format: str
) -> None:
    record = TRL_LAYOUTS[layout]
    spec = data_spec(tmp_path, format=data_format)
    if data_format == "prompt" and "prompt" in record:  # GRPO's prompts; other columns go to the graders, as TRL's
        (example,) = record_examples(record, spec, tokenizer)
        assert trained_text(example, tokenizer) == "" and example.input_ids
        return
    if (layout, data_format) in TRAINS:
        (example,) = record_examples(record, spec, tokenizer)
        assert trained_text(example, tokenizer) == TRAINS[layout, data_format]
        return
    with pytest.raises(RecordError) as error:
        record_examples(record, spec, tokenizer)
    # Old code: e.g. "field 'messages': must be a non-empty list ... got None" for prompt-only rows under chat,
    # and under preference a prompt-completion row was called unpaired preference.
    message = error.value.message
    name = layout.partition(" ")[2]
    assert "TRL's" in message and (name in message or layout in message), message
    if name in ("stepwise supervision", "unpaired preference"):
        assert "which Ferry does not train" in message
    elif "implicit-prompt" not in name and (layout, data_format) != ("standard prompt-completion", "chat"):
        assert "train it with" in message, message
