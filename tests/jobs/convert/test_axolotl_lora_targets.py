"""A regex ``lora_target_modules`` becomes the module names it spells out, or is refused; all-linear is listed."""

from __future__ import annotations

import pytest

from jobs.convert.axolotl import convert_axolotl
from jobs.convert.axolotl.lora import LINEAR_MODULES

BASE = "base_model: m\ndatasets: [{path: d.jsonl, type: alpaca}]\nadapter: lora\n"


def targets(line: str) -> list[str]:
    return convert_axolotl(BASE + line).spec["lora"]["target_modules"]


def test_a_regex_becomes_the_names_of_its_trailing_alternation() -> None:
    # As in axolotl's LiquidAI, llava, qwen2-vl and pixtral examples; split into characters before.
    regex = r"model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj"
    assert targets(f"lora_target_modules: '{regex}'\n") == [
        f"{n}_proj" for n in ("up", "down", "gate", "q", "k", "v", "o")
    ]
    nested = r"model.layers.[\d]+.(self_attn.(q_a_proj|o_proj)|mlp.(shared_experts.)?(gate_proj|up_proj))"
    assert targets(f"lora_target_modules: '{nested}'\n") == ["q_a_proj", "o_proj", "gate_proj", "up_proj"]
    assert targets(r"lora_target_modules: 'model\.projector\.linear_[12]'" + "\n") == ["linear_1", "linear_2"]
    assert targets("lora_target_modules: q_proj\n") == ["q_proj"]
    converted = convert_axolotl(BASE + f"lora_target_modules: '{regex}'\n")
    assert any(w.startswith("note: lora_target_modules: the regex") for w in converted.warnings)


@pytest.mark.parametrize(
    ("regex", "why"),
    [
        (r".*\.layers\.(3|7|11)\.self_attn\.(q|k)_proj", "picks particular layers (3, 7, 11)"),
        (r"model.layers.\d+.mlp.*", "does not spell out the last name"),
        (r"model.layers.(\d+", "is not a regular expression"),
    ],
)
def test_a_regex_that_does_not_map_to_names_is_refused_with_the_fix(regex: str, why: str) -> None:
    with pytest.raises(ValueError, match="lora_target_modules: ") as error:
        convert_axolotl(BASE + f"lora_target_modules: '{regex}'\n")
    assert why in str(error.value)
    assert "write lora_target_modules as a list of module names, e.g. [q_proj, k_proj, v_proj, o_proj]" in str(
        error.value
    )


def test_target_linear_and_all_linear_expand_to_the_linear_layers() -> None:
    assert targets("lora_target_linear: true\n") == LINEAR_MODULES
    assert targets("lora_target_modules: all-linear\n") == LINEAR_MODULES
    assert targets("lora_target_modules: [lm_head]\nlora_target_linear: true\n") == ["lm_head", *LINEAR_MODULES]
