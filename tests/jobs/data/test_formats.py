"""Record formats: which tokens train (labels) for text, instruction and chat data, and the field errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.data.formats.record import IGNORE, RecordError, record_example, record_examples
from jobs.data.tokenizers import HFTokenizer
from jobs.spec.job import TextDataSpec
from tests.jobs.llm_helpers import save_bpe_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(save_bpe_tokenizer(tmp_path_factory.mktemp("tok")))


def data_spec(tmp_path: Path, **fields: object) -> TextDataSpec:
    return TextDataSpec(kind="text", path=tmp_path, tokenizer={"kind": "hf", "path": tmp_path}, **fields)


def trained_text(example, tokenizer: HFTokenizer) -> str:
    return tokenizer.hf.decode(
        [i for i, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE]
    )


def test_instruction_trains_only_on_the_output(tmp_path: Path, tokenizer: HFTokenizer) -> None:
    spec = data_spec(tmp_path, format="instruction")
    record = {"instruction": "name a dog", "input": "", "output": "the lazy dog"}
    example = record_example(record, spec, tokenizer)
    prompt = tokenizer.encode("Below is an instruction that describes a task. ")
    assert example.input_ids[: len(prompt)] == prompt
    assert trained_text(example, tokenizer) == "the lazy dog<|im_end|>"  # the response and EOS, nothing else
    assert example.labels.count(IGNORE) == len(example.labels) - len(tokenizer.encode("the lazy dog")) - 1

    everything = record_example(record, data_spec(tmp_path, format="instruction", train_on_prompt=True), tokenizer)
    assert everything.labels == everything.input_ids


def test_instruction_fields_and_template_are_configurable(tmp_path: Path, tokenizer: HFTokenizer) -> None:
    spec = data_spec(
        tmp_path,
        format="instruction",
        fields={"instruction": "q", "input": "ctx", "output": "a"},
        prompt_template="Q: {instruction} [{input}] {literal braces}\nA: ",
    )
    example = record_example({"q": "fox", "ctx": "dog", "a": "back"}, spec, tokenizer)
    assert tokenizer.hf.decode(example.input_ids).startswith("Q: fox [dog] {literal braces}\nA: back")
    with pytest.raises(RecordError, match="field 'q': is missing .*set data.fields.instruction"):
        record_example({"instruction": "fox", "a": "x"}, spec, tokenizer)


def test_chat_masks_everything_but_assistant_turns(tmp_path: Path, tokenizer: HFTokenizer) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the fox"},
        {"role": "assistant", "content": "jumps over"},
        {"role": "user", "content": "and then"},
        {"role": "assistant", "content": "the lazy dog"},
    ]
    example = record_example({"messages": messages}, data_spec(tmp_path, format="chat"), tokenizer)
    # The whole conversation is the chat template's rendering, token for token.
    assert tokenizer.hf.decode(example.input_ids) == tokenizer.render_chat(messages, add_generation_prompt=False)
    assert trained_text(example, tokenizer) == "jumps over<|im_end|>\nthe lazy dog<|im_end|>\n"

    messages[2]["weight"] = 0  # OpenAI's per-message weight: this turn is context only
    skipped = record_example({"messages": messages}, data_spec(tmp_path, format="chat"), tokenizer)
    assert trained_text(skipped, tokenizer) == "the lazy dog<|im_end|>\n"
    everything = record_example(
        {"messages": messages}, data_spec(tmp_path, format="chat", train_on_prompt=True), tokenizer
    )
    assert "be brief" in trained_text(everything, tokenizer) and "jumps over" not in trained_text(everything, tokenizer)


@pytest.mark.parametrize(
    ("messages", "field", "message"),
    [
        ("hello", "messages", "must be a non-empty list"),
        ([{"role": "bot", "content": "x"}], "messages[0].role", "must be one of system, user, assistant"),
        ([{"role": "user", "content": 3}], "messages[0].content", "must be a string; got 3"),
        ([{"role": "user", "content": "x"}], "messages", "has no assistant message"),
        ([{"role": "assistant", "content": "x", "weight": 2}], "messages[0].weight", "must be 0 or 1"),
    ],
)
def test_chat_record_errors_name_the_field(
    tmp_path: Path, tokenizer: HFTokenizer, messages: object, field: str, message: str
) -> None:
    with pytest.raises(RecordError, match=message) as error:
        record_example({"messages": messages}, data_spec(tmp_path, format="chat"), tokenizer)
    assert error.value.field == field


def test_a_template_that_rewrites_earlier_turns_trains_each_turn_on_its_own(tmp_path: Path) -> None:
    # Shows only the last assistant turn's content: earlier turns change when a new one arrives.
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[hidden]"
        "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer = HFTokenizer(save_bpe_tokenizer(tmp_path / "tok", chat_template=template))
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    first, second = record_examples({"messages": messages}, data_spec(tmp_path, format="chat"), tokenizer)
    assert tokenizer.hf.decode(first.input_ids) == "user: a\nassistant: b\n"
    assert tokenizer.hf.decode(second.input_ids) == "user: a\n[hidden]user: c\nassistant: d\n"
    assert [trained_text(e, tokenizer) for e in (first, second)] == ["b\n", "d\n"]


def test_a_template_that_writes_a_turn_unlike_its_prompt_is_refused(tmp_path: Path) -> None:
    # The generation prompt says "assistant: ", the turn is written "assistant> ": no cut tells them apart.
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[hidden]"
        "{% else %}{{ m['role'] }}> {{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer = HFTokenizer(save_bpe_tokenizer(tmp_path / "tok", chat_template=template))
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(RecordError, match="does not render assistant turn 1 after its own prompt") as error:
        record_examples({"messages": messages}, data_spec(tmp_path, format="chat"), tokenizer)
    assert error.value.field == "messages"


SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "the fox"},
        {"from": "gpt", "value": "jumps over"},
        {"from": "user", "value": "the dog"},
        {"from": "assistant", "value": "lazy"},
    ]
}


def test_sharegpt_conversations_train_like_chat_messages(tmp_path: Path, tokenizer: HFTokenizer) -> None:
    spec = data_spec(tmp_path, format="chat")
    roles = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}
    messages = [{"role": roles[t["from"]], "content": t["value"]} for t in SHAREGPT["conversations"]]
    sharegpt = record_example(SHAREGPT, spec, tokenizer)
    assert sharegpt == record_example({"messages": messages}, spec, tokenizer)
    assert trained_text(sharegpt, tokenizer) == "jumps over<|im_end|>\nlazy<|im_end|>\n"
    # Under a messages_field of the user's choosing, the {from, value} spelling is recognised too.
    renamed = data_spec(tmp_path, format="chat", messages_field="dialog")
    assert record_example({"dialog": SHAREGPT["conversations"]}, renamed, tokenizer) == sharegpt


@pytest.mark.parametrize(
    ("turn", "error"),
    [
        ({"from": "bot", "value": "x"}, "field 'conversations[1].from': must be one of human, gpt, system, user, "),
        ({"from": "gpt", "text": "x"}, "field 'conversations[1].value': must be a string; got None"),
        ("gpt: x", "field 'conversations[1]': must be an object with from and value; got 'gpt: x'"),
    ],
)
def test_sharegpt_errors_name_the_turn(tmp_path: Path, tokenizer: HFTokenizer, turn: object, error: str) -> None:
    record = {"conversations": [{"from": "human", "value": "hi"}, turn]}
    with pytest.raises(RecordError) as caught:
        record_example(record, data_spec(tmp_path, format="chat"), tokenizer)
    assert str(caught.value).startswith(error)
    with pytest.raises(RecordError, match="field 'conversations': has no assistant message"):
        record_example(
            {"conversations": [{"from": "human", "value": "hi"}]}, data_spec(tmp_path, format="chat"), tokenizer
        )


def test_a_message_weight_must_be_the_number_0_or_1_not_a_boolean() -> None:
    from jobs.data.formats.chat import check_messages
    from jobs.data.formats.examples import RecordError

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "weight": True}]
    with pytest.raises(RecordError, match=r"must be 0 or 1 \(OpenAI's per-message weight\); got True"):
        check_messages(messages, "messages")
    assert check_messages([messages[0]], "prompt", need_assistant=False) == [
        {"role": "user", "content": "hi", "weight": 1}
    ]
