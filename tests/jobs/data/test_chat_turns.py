"""Which tokens of a multi-turn conversation train, through Qwen3's real chat template and TRL's training one.

Qwen3's template (tests/jobs/data/templates/qwen3.jinja, as Qwen ships it) renders earlier assistant turns
without the ``<think>`` block it writes on the last turn, so no prefix of the conversation renders as the
start of the whole: each assistant turn trains in an example of its own, the conversation up to it. TRL's
training variant marks assistant text with ``{% generation %}``, read through transformers' assistant mask.
In every case the trained text is exactly what the template emits for the turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jobs.data.formats.record import IGNORE, RecordError, record_examples
from jobs.data.tokenizers import HFTokenizer
from tests.jobs.data.test_chat_tools import TEMPLATES, chat, tokenizer_with, tool_record
from tests.jobs.data.test_chat_tools import trained_text as trained


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return tokenizer_with(tmp_path_factory.mktemp("qwen3"), (TEMPLATES / "qwen3.jinja").read_text())


@pytest.fixture(scope="module")
def qwen3_training(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return tokenizer_with(tmp_path_factory.mktemp("qwen3t"), (TEMPLATES / "qwen3_training.jinja").read_text())


def two_questions(reasoning: bool) -> list[dict[str, Any]]:
    first = {"role": "assistant", "content": "4"}
    second = {"role": "assistant", "content": "6"}
    if reasoning:
        first["reasoning_content"] = "Two and two make four."
        second["reasoning_content"] = "Three and three make six."
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        first,
        {"role": "user", "content": "And 3 + 3?"},
        second,
    ]


def text(ids: list[int], tokenizer: HFTokenizer) -> str:
    return str(tokenizer.hf.decode(ids))


def emitted(tokenizer: HFTokenizer, messages: list[dict[str, Any]], index: int) -> tuple[str, str]:
    """(context, turn): the template's text of the conversation up to turn ``index``, cut at the turn."""
    plain = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
    prompt = tokenizer.render_chat(plain[:index], add_generation_prompt=True)
    full = tokenizer.render_chat(plain[: index + 1], add_generation_prompt=False)
    assert full.startswith(prompt)
    return prompt, full[len(prompt) :]


@pytest.mark.parametrize("reasoning", [False, True], ids=["plain", "reasoning"])
def test_qwen3_trains_each_turn_as_its_template_writes_it(tmp_path: Path, qwen3: HFTokenizer, reasoning: bool) -> None:
    messages = two_questions(reasoning)
    examples = record_examples({"messages": messages}, chat(tmp_path), qwen3)
    assert len(examples) == 2  # one per assistant turn: the earlier turn renders differently as history
    for example, index in zip(examples, (2, 4), strict=True):
        context, turn = emitted(qwen3, messages, index)
        assert text(example.input_ids, qwen3) == context + turn  # the template's own text, token for token
        assert trained(example, qwen3) == turn
    think = ("<think>\nTwo and two make four.\n</think>\n\n", "<think>\nThree and three make six.\n</think>\n\n")
    empty = ("<think>\n\n</think>\n\n",) * 2
    first, second = think if reasoning else empty
    assert trained(examples[0], qwen3) == first + "4<|im_end|>\n"
    assert trained(examples[1], qwen3) == second + "6<|im_end|>\n"
    # The second turn's context holds the first as Qwen3 writes history: no <think> block, not trained.
    assert "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3 + 3?" in text(examples[1].input_ids, qwen3)


def test_qwen3_trains_a_tool_call_and_the_answer_after_its_result(tmp_path: Path, qwen3: HFTokenizer) -> None:
    # Both turns follow the last user message; the call renders with <think> as last turn, without as history.
    record = tool_record()
    examples = record_examples(record, chat(tmp_path), qwen3)
    assert [trained(e, qwen3) for e in examples] == [
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n",
        "<think>\n\n</think>\n\nIt is sunny in Rome.<|im_end|>\n",
    ]
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text(examples[1].input_ids, qwen3)


def test_qwen3_weight_0_turn_is_history_only(tmp_path: Path, qwen3: HFTokenizer) -> None:
    messages = two_questions(reasoning=True)
    messages[2]["weight"] = 0
    (example,) = record_examples({"messages": messages}, chat(tmp_path), qwen3)
    assert trained(example, qwen3) == "<think>\nThree and three make six.\n</think>\n\n6<|im_end|>\n"


def test_qwen3_train_on_prompt_is_refused_naming_the_fix(tmp_path: Path, qwen3: HFTokenizer) -> None:
    with pytest.raises(RecordError, match="renders earlier turns differently .* set data.train_on_prompt: false"):
        record_examples({"messages": two_questions(False)}, chat(tmp_path, train_on_prompt=True), qwen3)


@pytest.mark.parametrize("reasoning", [False, True], ids=["plain", "reasoning"])
def test_generation_marks_train_the_marked_text(tmp_path: Path, qwen3_training: HFTokenizer, reasoning: bool) -> None:
    messages = two_questions(reasoning)
    (example,) = record_examples({"messages": messages}, chat(tmp_path), qwen3_training)
    plain = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
    out = qwen3_training.hf.apply_chat_template(
        plain, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert example.input_ids == list(out["input_ids"])
    assert example.labels == [i if m else IGNORE for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True)]
    first = "<think>\nTwo and two make four.\n</think>\n\n" if reasoning else "<think>\n\n</think>\n\n"
    second = "<think>\nThree and three make six.\n</think>\n\n" if reasoning else "<think>\n\n</think>\n\n"
    assert trained(example, qwen3_training) == f"{first}4<|im_end|>\n{second}6<|im_end|>\n"
    # A weight-0 turn is the first marked stretch, left out.
    messages[2]["weight"] = 0
    (skipped,) = record_examples({"messages": messages}, chat(tmp_path), qwen3_training)
    assert trained(skipped, qwen3_training) == f"{second}6<|im_end|>\n"
    with_prompt = record_examples({"messages": messages}, chat(tmp_path, train_on_prompt=True), qwen3_training)[0]
    assert "What is 2 + 2?" in trained(with_prompt, qwen3_training)
    assert "make four" not in trained(with_prompt, qwen3_training) and "4<|im_end|>" not in trained(
        with_prompt, qwen3_training
    )


def test_the_jobs_data_counts_one_example_per_trained_turn(tmp_path: Path) -> None:
    import json

    from jobs.data.prepare import prepare_text_data
    from jobs.spec.job import TextDataSpec
    from tests.jobs.llm_helpers import save_bpe_tokenizer

    save_bpe_tokenizer(tmp_path / "tok", chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    rows = [{"messages": two_questions(reasoning=bool(i % 2))} for i in range(3)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = TextDataSpec(
        kind="text", path=tmp_path / "chats.jsonl", format="chat", seq_len=256,
        tokenizer={"kind": "hf", "path": tmp_path / "tok"},
    )  # fmt: skip
    data = prepare_text_data(spec, batch_size=1, seed=0, packed_path=False)
    assert data.counts.examples == 6 and "3 record(s) -> 6 example(s)" in data.summary
