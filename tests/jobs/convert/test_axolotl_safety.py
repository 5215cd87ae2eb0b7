"""Hostile axolotl configs: line breaks cannot inject spec sections, wrong types are ValueErrors naming the key,
and the YAML shape guard stops alias bombs in every entry point (the CLI's import-axolotl and validate too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jobs.cli import main
from jobs.convert.axolotl import convert_axolotl

BOMB = "\n".join(
    [f"a0: &a0 [{', '.join(['x'] * 9)}]"] + [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 9)}]" for n in range(1, 7)]
)  # 9**7 strings once expanded


@pytest.mark.parametrize("brk", ["\n", "\r", "\u2028", "\x85"])
def test_a_line_break_in_a_key_or_path_cannot_inject_a_section(brk: str) -> None:
    config = {
        "base_model": "m",
        "datasets": [{"path": f"d.jsonl{brk}device: cpu{brk}offload: {{x: 1}}", "type": "alpaca"}],
        f"evil{brk}device: cuda{brk}task: x": 1,
    }
    text = convert_axolotl(yaml.safe_dump(config)).to_yaml()
    parsed = yaml.safe_load(text)
    assert set(parsed) == {"name", "model", "data", "training"}
    assert parsed["data"]["path"] == config["datasets"][0]["path"]
    assert all(line.startswith("#") or not line.startswith(("device", "task", "offload")) for line in text.splitlines())


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('lora_r: "abc"', "lora_r: must be an integer, e.g. lora_r: 16; got 'abc'"),
        ("datasets: 5", "datasets: must be a list of {path, type} entries"),
        ("learning_rate: [1]", "learning_rate: must be a number"),
        ("micro_batch_size: true", "micro_batch_size: must be an integer"),
        ("lora_target_modules: 5", "lora_target_modules: must be a list of names"),
        ("sample_packing: maybe", "sample_packing: must be true or false"),
    ],
)
def test_a_wrongly_typed_value_is_a_value_error_naming_the_key(line: str, message: str) -> None:
    base = {"base_model": "m", "adapter": "lora", "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}
    key = line.split(":")[0]
    text = yaml.safe_dump({k: v for k, v in base.items() if k != key}) + line + "\n"
    with pytest.raises(ValueError) as error:
        convert_axolotl(text)
    assert message in str(error.value)


def test_import_axolotl_and_validate_refuse_an_alias_bomb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bomb = tmp_path / "bomb.yml"
    bomb.write_text("base_model: m\ndatasets: [{path: d.jsonl}]\n" + BOMB + "\n")
    assert main(["import-axolotl", str(bomb)]) == 2
    assert "expands to more than 20000 YAML nodes" in capsys.readouterr().err
    assert main(["validate", str(bomb)]) == 2
    assert "expands to more than 20000 YAML nodes" in capsys.readouterr().err
