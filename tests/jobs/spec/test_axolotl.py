"""axolotl configs as Ferry specs: what maps, what is listed as not honoured, and an example that trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.cli import main
from jobs.convert.axolotl import convert_axolotl
from jobs.paths import PathRoots
from jobs.spec.loading import load_job_spec
from jobs.train.runner import run_job
from tests.jobs.llm_helpers import chat_record, save_bpe_tokenizer, save_llama, write_jsonl

EXAMPLE = Path(__file__).parents[3] / "configs" / "axolotl" / "llama-lora.yml"


def test_the_example_converts_with_each_key_it_cannot_honour_listed() -> None:
    converted = convert_axolotl(EXAMPLE.read_text())
    spec = converted.spec
    assert spec["model"] == {"kind": "hf_causal_lm", "path": "llama"}
    assert spec["data"] == {
        "kind": "text",
        "format": "chat",
        "chat_template": "chatml",
        "path": "chat.jsonl",
        "seq_len": 64,
        "packing": "padded",
        "tokenizer": {"kind": "hf", "path": "llama"},
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
    listed = {w.split(":")[0] for w in converted.warnings}
    assert listed == {
        "lora_target_linear",
        "model_type",
        "tokenizer_type",
        "dataset_prepared_path",
        "output_dir",
        "logging_steps",
        "evals_per_epoch",
        "saves_per_epoch",
        "special_tokens",
    }
    assert converted.to_yaml().startswith(
        "# Converted from an axolotl config.\n# Not honoured:\n#   lora_target_linear"
    )


def test_qlora_alpaca_epochs_and_unknown_keys() -> None:
    converted = convert_axolotl(
        "base_model: org/Llama-3-8B\nadapter: qlora\nlora_target_modules: [q_proj]\n"
        "datasets:\n  - {path: a.jsonl, type: alpaca}\n  - {path: b.jsonl, type: alpaca}\n  - {path: c.jsonl, type: sharegpt}\n"
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
    assert converted.warnings == [
        "datasets: c.jsonl has type 'sharegpt'; one job reads one format, left out",
        "optimizer: paged_adamw_8bit (8-bit, paged or apex state) is trained as plain adamw",
        "lr_scheduler: 'one_cycle' is not supported (cosine, linear, constant); constant is used",
        "warmup_ratio: Ferry warms up for a number of steps; set warmup_steps (no max_steps to scale)",
        "rope_scaling: not a setting Ferry maps; see the spec reference in the README",
    ]


def test_sharegpt_reads_conversations_and_a_config_without_datasets_is_refused() -> None:
    spec = convert_axolotl("base_model: m\ndatasets: [{path: s.jsonl, type: sharegpt}]\n").spec
    assert spec["data"]["format"] == "chat" and spec["data"]["messages_field"] == "conversations"
    with pytest.raises(ValueError, match="has no datasets; Ferry needs both"):
        convert_axolotl("base_model: m\n")


@pytest.mark.slow
def test_the_example_trains_on_cpu(tmp_path: Path) -> None:
    models, data = tmp_path / "models", tmp_path / "datasets"
    save_llama(models / "llama")
    save_bpe_tokenizer(models / "llama")
    write_jsonl(data / "chat.jsonl", [chat_record(i) for i in range(16)])
    text = convert_axolotl(EXAMPLE.read_text()).to_yaml() + "device: cpu\n"
    spec = load_job_spec(text, PathRoots(model_roots=[models], data_roots=[data]))
    events: list = []
    outcome = run_job(spec, output_dir=tmp_path / "out", report=events.append)
    assert outcome.status == "succeeded" and outcome.step == 4
    assert [e.step for e in events if e.type == "step"] == [1, 2, 3, 4]


def test_cli_prints_the_spec_and_lists_what_is_not_honoured(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import-axolotl", str(EXAMPLE)]) == 0
    out, err = capsys.readouterr()
    assert "\nname: llama-axolotl\n" in out and out.endswith("split: 0.25\n")
    assert "not honoured: flash_attention" not in err
    assert "not honoured: output_dir: Ferry keeps a job's outputs in its own directory" in err
