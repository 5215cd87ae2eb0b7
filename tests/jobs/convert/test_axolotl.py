"""axolotl configs as Ferry specs: what maps, the block of what is not converted, and the shipped example, run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from jobs.cli import main
from jobs.convert.axolotl import convert_axolotl

REPO = Path(__file__).parents[3]
EXAMPLE = REPO / "configs" / "axolotl" / "llama-lora.yml"


def test_the_example_converts_with_each_key_not_converted_listed() -> None:
    converted = convert_axolotl(EXAMPLE.read_text())
    spec = converted.spec
    assert spec["model"] == {"kind": "hf_causal_lm", "path": "SmolLM2-135M-Instruct"}
    assert spec["data"] == {
        "kind": "text",
        "format": "chat",
        "chat_template": "chatml",
        "path": "axolotl_chat.jsonl",
        "seq_len": 64,
        "packing": "padded",
        "tokenizer": {"kind": "hf", "path": "SmolLM2-135M-Instruct"},
    }
    assert spec["lora"]["target_modules"][-1] == "down_proj" and spec["lora"]["rank"] == 4
    assert spec["training"] == {
        "steps": 4,
        "batch_size": 2,
        "gradient_accumulation_steps": 1,
        "weight_decay": 0.0,
        "learning_rate": 0.002,
        "optimizer": "adamw",
        "scheduler": {"kind": "cosine", "warmup_steps": 1},
        "gradient_checkpointing": True,
    }
    assert spec["eval"] == {"split": 0.25}
    assert [key for key, _ in converted.not_converted] == [
        "model_type",
        "tokenizer_type",
        "dataset_prepared_path",
        "output_dir",
        "logging_steps",
        "evals_per_epoch",
        "saves_per_epoch",
        "special_tokens",
    ]
    assert converted.warnings[0].startswith("note: lora_target_linear: expanded to the Llama-style linear layers")
    assert converted.to_yaml().endswith(
        "# not converted: special_tokens because Ferry uses the tokenizer as saved; add tokens to it (and resize "
        "the model) before training\n"
    )


def test_qlora_alpaca_epochs_and_unknown_keys() -> None:
    converted = convert_axolotl(
        "base_model: org/Llama-3-8B\nadapter: qlora\nlora_target_modules: [q_proj]\n"
        "datasets:\n  - {path: a.jsonl, type: alpaca}\n  - {path: b.jsonl, type: alpaca}\n"
        "num_epochs: 2\nfp16: true\noptimizer: paged_adamw_8bit\nlr_scheduler: one_cycle\nwarmup_ratio: 0.1\n"
        "save_steps: 50\nsave_total_limit: 2\nwandb_project: demo\nrope_scaling: {type: linear}\n"
    )
    spec = converted.spec
    assert spec["name"] == "Llama-3-8B-axolotl"
    assert spec["model"]["quantize"] == "nf4"
    assert spec["data"]["format"] == "instruction"
    assert spec["data"]["mix"] == [{"path": "a.jsonl"}, {"path": "b.jsonl"}]
    assert spec["training"]["epochs"] == 2 and spec["training"]["mixed_precision"] == "fp16"
    assert spec["training"]["optimizer"] == "adamw" and spec["training"]["scheduler"] == {"kind": "constant"}
    assert spec["checkpoint"] == {"every_steps": 50, "keep_last": 2}
    assert spec["tracking"] == {"wandb": {"project": "demo", "mode": "offline"}}
    assert [key for key, _ in converted.not_converted] == ["lr_scheduler", "warmup_ratio", "rope_scaling"]
    assert (
        "note: optimizer: paged_adamw_8bit (8-bit, paged or apex state) is trained as plain adamw" in converted.warnings
    )


def test_eval_and_save_steps_as_counts_or_listed_as_fractions() -> None:
    base = "base_model: m\ndatasets: [{path: d.jsonl, type: alpaca}]\nval_set_size: 0.1\n"
    counts = convert_axolotl(base + "eval_steps: 20\nsave_steps: 40\n")
    assert counts.spec["eval"]["every_steps"] == 20 and counts.spec["checkpoint"]["every_steps"] == 40
    fractions = dict(convert_axolotl(base + "eval_steps: 0.25\nsave_steps: 0.5\n").not_converted)
    assert fractions["eval_steps"] == "a fraction of the run is not a step count; set eval.every_steps"
    assert fractions["save_steps"] == "a fraction of the run is not a step count; set checkpoint.every_steps"


def test_sharegpt_reads_conversations_and_a_config_without_datasets_is_refused() -> None:
    spec = convert_axolotl("base_model: m\ndatasets: [{path: s.jsonl, type: sharegpt}]\n").spec
    assert spec["data"]["format"] == "chat" and spec["data"]["messages_field"] == "conversations"
    with pytest.raises(ValueError, match="has no datasets; Ferry needs both"):
        convert_axolotl("base_model: m\n")


def test_cli_prints_the_spec_then_the_block_of_what_is_not_converted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import-axolotl", str(EXAMPLE)]) == 0
    out, err = capsys.readouterr()
    assert "\nname: SmolLM2-135M-Instruct-axolotl\n" in out
    assert out.splitlines()[-1].startswith("# not converted: special_tokens because")
    assert "flash_attention" not in err  # false: asks for what Ferry does
    assert "not converted: output_dir because Ferry keeps a job's outputs in its own directory" in err


@pytest.mark.slow
def test_the_shipped_example_runs_as_shipped(
    tmp_path: Path, smollm2: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The header's commands, as written, from a directory holding the README's offline SmolLM2 in its default
    # model root (ferry-data/models); the data is the bundled configs/data/axolotl_chat.jsonl.
    shutil.copytree(smollm2, tmp_path / "ferry-data" / "models" / smollm2.name)  # the run's converted model
    monkeypatch.chdir(tmp_path)
    assert main(["import-axolotl", str(EXAMPLE)]) == 0
    (tmp_path / "llama-lora.yaml").write_text(capsys.readouterr().out)
    assert main(["run", "llama-lora.yaml", "--output", "out/axolotl"]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "axolotl").is_dir()
