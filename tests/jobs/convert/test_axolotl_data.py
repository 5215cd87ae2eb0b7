"""axolotl's datasets as Ferry's data: data_files, per-source settings, message fields, rl pairs, pretraining
text, and a note with the download command for each Hub id read as a local path."""

from __future__ import annotations

from jobs.convert.axolotl import convert_axolotl


def convert(text: str):
    return convert_axolotl("base_model: m\n" + text)


def listed(conversion) -> dict[str, str]:
    return dict(conversion.not_converted)


def test_data_files_become_paths_inside_the_dataset_never_a_list_literal() -> None:
    one = convert("datasets: [{path: org/set, data_files: [train.jsonl], type: completion}]\n")
    assert one.spec["data"]["path"] == "org/set/train.jsonl"
    loader = convert("datasets: [{path: json, data_files: [a.jsonl, b.jsonl], type: alpaca}]\n")
    assert loader.spec["data"]["mix"] == [{"path": "a.jsonl"}, {"path": "b.jsonl"}]
    assert "[" not in str(loader.spec["data"]["mix"][0]["path"])
    assert any("equal weights" in w for w in loader.warnings)


def test_each_entry_keeps_its_own_settings_or_is_listed_never_read_with_the_first_ones() -> None:
    conversion = convert(
        "datasets:\n"
        "  - {path: a.jsonl, type: completion, field: body}\n"
        "  - {path: b.jsonl, type: completion, field: body}\n"
        "  - {path: c.jsonl, type: completion, field: text}\n"
        "  - {path: d.jsonl, type: alpaca}\n"
    )
    data = conversion.spec["data"]
    assert data["text_field"] == "body" and data["mix"] == [{"path": "a.jsonl"}, {"path": "b.jsonl"}]
    why = listed(conversion)
    assert "text_field: 'text'" in why["datasets[2]"] and "differ from the first entry's" in why["datasets[2]"]
    assert "format: 'instruction'" in why["datasets[3]"]


def test_message_fields_roles_and_system_messages_map_or_are_listed() -> None:
    sharegpt_spelled = convert(
        "datasets:\n  - path: c.jsonl\n    type: chat_template\n    field_messages: conversations\n"
        "    message_field_role: from\n    message_field_content: value\n"
        "    roles: {user: [human], assistant: [gpt]}\n    drop_system_message: false\n"
    )
    assert sharegpt_spelled.spec["data"]["messages_field"] == "conversations"
    assert sharegpt_spelled.not_converted == []  # Ferry reads {from, value} turns with human/gpt
    other = convert(
        "datasets:\n  - path: c.jsonl\n    type: chat_template\n"
        "    message_field_role: speaker\n    message_field_content: text\n"
        "    roles: {user: [customer]}\n    drop_system_message: true\n"
    )
    why = listed(other)
    assert set(why) == {
        "datasets[0].message_field_role",
        "datasets[0].message_field_content",
        "datasets[0].roles",
        "datasets[0].drop_system_message",
    }
    assert "rename the fields in the data" in why["datasets[0].message_field_role"]


def test_rl_dpo_and_orpo_become_preference_jobs() -> None:
    dpo = convert(
        "rl: dpo\nrl_beta: 0.2\ndatasets:\n  - path: pairs.jsonl\n    type: chat_template.default\n"
        "    field_messages: conversation\n    field_chosen: chosen\n    field_rejected: rejected\n"
    )
    assert dpo.spec["data"]["format"] == "preference"
    assert dpo.spec["training"]["objective"] == "dpo" and dpo.spec["training"]["dpo"] == {"beta": 0.2}
    assert "rename 'conversation' to 'prompt'" in listed(dpo)["datasets[0].field_messages"]
    orpo = convert("rl: orpo\norpo_alpha: 0.1\ndatasets: [{path: p.jsonl, type: chat_template.argilla}]\n")
    assert orpo.spec["training"]["objective"] == "orpo" and orpo.spec["training"]["orpo"] == {"beta": 0.1}
    ipo = convert("rl: ipo\ndatasets: [{path: p.jsonl, type: chat_template.default, field_messages: prompt}]\n")
    assert ipo.spec["training"]["dpo"] == {"loss_type": "ipo"}


def test_pretraining_dataset_is_a_text_dataset_and_hub_ids_say_how_to_fetch() -> None:
    conversion = convert(
        "max_steps: 10\npretraining_dataset:\n  - {path: HuggingFaceFW/fineweb-edu, name: sample-10BT, "
        "type: pretrain, text_column: content}\n"
    )
    data = conversion.spec["data"]
    assert data["format"] == "text" and data["text_field"] == "content" and data["path"] == "HuggingFaceFW/fineweb-edu"
    assert "pretraining_dataset[0].name" in listed(conversion)
    assert any(
        "Ferry reads local paths only" in w
        and "huggingface-cli download --repo-type dataset HuggingFaceFW/fineweb-edu --local-dir <data root>/HuggingFaceFW/fineweb-edu"
        in w
        for w in conversion.warnings
    )
    model = convert_axolotl("base_model: meta-llama/Llama-3.2-1B\ndatasets: [{path: d.jsonl, type: alpaca}]\n")
    assert any(
        "huggingface-cli download meta-llama/Llama-3.2-1B --local-dir <model root>/meta-llama/Llama-3.2-1B" in w
        for w in model.warnings
    )


def test_thinking_keys_map_to_ferrys_reasoning_keys(tmp_path) -> None:
    """axolotl's gpt-oss example reads reasoning from each message's ``thinking`` and gives it to the template as
    ``thinking``: both map, and a row in that layout trains its reasoning through gpt-oss's template."""
    import json
    from pathlib import Path

    from jobs.data.formats.record import IGNORE, record_examples
    from jobs.data.tokenizers import HFTokenizer
    from jobs.spec.job import TextDataSpec
    from tests.jobs.llm_helpers import save_bpe_tokenizer

    example = Path(__file__).parent / "axolotl_examples" / "gpt-oss" / "gpt-oss-20b-sft-lora-singlegpu.yaml"
    conversion = convert_axolotl(example.read_text())
    assert not [key for key, _ in conversion.not_converted if "thinking" in key]
    template = (Path(__file__).parents[1] / "data" / "templates" / "gptoss.jinja").read_text()
    tokenizer_dir = save_bpe_tokenizer(tmp_path / "tok", chat_template=template)
    row = {  # HuggingFaceH4/Multilingual-Thinking's layout
        "messages": [
            {"role": "system", "content": "reasoning language: French"},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4", "thinking": "Deux et deux font quatre."},
        ]
    }
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    data = {
        **conversion.spec["data"],
        "path": tmp_path / "rows.jsonl",
        "tokenizer": {"kind": "hf", "path": tokenizer_dir},
    }
    tokenizer = HFTokenizer(tokenizer_dir)
    (trained,) = record_examples(row, TextDataSpec(**data), tokenizer)
    text = tokenizer.hf.decode(
        [i for i, label in zip(trained.input_ids, trained.labels, strict=True) if label != IGNORE]
    )
    assert (
        text
        == "<|channel|>analysis<|message|>Deux et deux font quatre.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>"
    )

    other = convert(
        "datasets:\n  - {path: c.jsonl, type: chat_template, field_thinking: thoughts, template_thinking_key: think}\n"
    )
    why = listed(other)
    assert "not 'thoughts'; rename that key in the data's messages" in why["datasets[0].field_thinking"]
    assert "not 'think'" in why["datasets[0].template_thinking_key"]
