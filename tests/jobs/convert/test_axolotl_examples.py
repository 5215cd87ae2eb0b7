"""axolotl's own example configs (a pinned copy, axolotl_examples/README.md) through the importer.

Every config converts or is refused with a ValueError naming the key (no other exception), no LoRA target is a
single character, and every top-level key is either mapped or listed in the one block of "not converted" lines
at the end of the text. Of the configs whose model is an architecture Ferry trains (docs/model-families.md),
at least 90% convert and validate with `load_job_spec`, their model and data paths stood in under tmp_path.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from jobs.convert.axolotl import AxolotlConversion, convert_axolotl
from jobs.errors import JobSpecError
from jobs.paths import PathRoots
from jobs.spec.loading import load_job_spec

EXAMPLES = Path(__file__).parent / "axolotl_examples"
CONFIGS = sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".yml", ".yaml"))
# base_model → the architecture of docs/model-families.md's table it is (text-only checkpoints Ferry can read:
# no vision towers, no GPTQ or NVFP4 weights).
FAMILIES = {
    "llama": r"(llama-2|llama-3\.[12]-[0-9]+b(-instruct)?$|meta-llama-3|llama-3-70b|tinyllama|smollm2|codellama|"
    r"huggyllama|open_llama|cogito-v1-preview-llama|yi-34b|orpheus|sparse-llama)",
    "qwen2": r"(qwen2-7b$|qwen2\.5-[0-9.]+b$|deepcoder|cogito-v1-preview-qwen)",
    "qwen3": r"qwen3-[0-9]+b$",
    "qwen3_moe": r"qwen3-30b-a3b-instruct",
    "mistral": r"(mistral-7b|ministral-8b|devstral-small|magistral-small-250[67])",
    "mixtral": r"mixtral",
    "phi3": r"phi-3",
    "gemma2": r"gemma-2-",
    "gemma3": r"gemma-3-(1b|270m)",
    "gpt_neox": r"(pythia|redpajama)",
    "gpt2": r"cerebras-gpt",
}
NOT_READABLE = r"(gptq|nvfp4|vision|reward)"  # reward: a sequence-classification checkpoint
OTHER_OBJECTIVE = re.compile(r"(rl|reward_model|process_reward_model): ")


def family(base_model: object) -> str | None:
    """The Ferry-trained architecture ``base_model`` names, or None."""
    name = str(base_model).lower()
    if re.search(NOT_READABLE, name):
        return None
    return next((f for f, pattern in FAMILIES.items() if re.search(pattern, name)), None)


def stand_in_roots(spec: dict, root: Path) -> PathRoots:
    """Model directories and data files where the spec names them, so its paths resolve as a server's would."""
    models, data = root / "models", root / "data"
    for path in {spec["model"]["path"], spec["data"]["tokenizer"]["path"]}:
        (models / path).mkdir(parents=True, exist_ok=True)
    sources = [spec["data"]["path"]] if "path" in spec["data"] else [s["path"] for s in spec["data"]["mix"]]
    for source in sources:
        target = data / source
        if Path(source).suffix:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text('{"text": "a"}\n')
        else:  # a Hub dataset's repository, downloaded as a directory
            target.mkdir(parents=True, exist_ok=True)
            (target / "train.jsonl").write_text('{"text": "a"}\n')
    return PathRoots(model_roots=[models], data_roots=[data])


def converted(path: Path) -> AxolotlConversion | ValueError:
    try:
        return convert_axolotl(path.read_text())
    except ValueError as error:  # a refusal that names the key; anything else fails the test with its traceback
        return error


def test_the_pinned_copy_is_there() -> None:
    assert len(CONFIGS) == 252
    assert "067b021c8b87a9e5e380b9173c704cf7340e30f5" in (EXAMPLES / "README.md").read_text()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_each_config_converts_and_lists_every_key_it_does_not_map(path: Path) -> None:
    result = converted(path)
    if isinstance(result, ValueError):
        assert str(result) and "\n" not in str(result)
        return
    targets = result.spec.get("lora", {}).get("target_modules", [])
    assert all(len(name) > 1 for name in targets), targets
    config = yaml.safe_load(path.read_text())
    listed = {key for key, _ in result.not_converted}
    unset = {k for k, v in config.items() if v is None or v == ""}
    assert set(config) - unset <= result.mapped | listed
    assert not result.mapped & listed
    text = result.to_yaml()
    block = [line for line in text.splitlines() if line.startswith("# not converted: ")]
    assert block == [f"# not converted: {k} because {why}" for k, why in result.not_converted]
    assert text.splitlines()[-len(block) :] == block if block else True  # the block ends the text


def test_nine_in_ten_configs_of_a_family_ferry_trains_convert_and_validate(tmp_path: Path) -> None:
    supported = [p for p in CONFIGS if family(yaml.safe_load(p.read_text()).get("base_model"))]
    passed, other_objective, failed = [], [], {}
    for index, path in enumerate(supported):
        result = converted(path)
        if isinstance(result, ValueError):
            if OTHER_OBJECTIVE.match(str(result)):  # ebft, kto, gdpo, reward models: refused, never trained as SFT
                other_objective.append(path)
            else:
                failed[str(path.relative_to(EXAMPLES))] = str(result)
            continue
        try:
            load_job_spec(result.to_yaml(), stand_in_roots(result.spec, tmp_path / str(index)))
        except JobSpecError as error:
            failed[str(path.relative_to(EXAMPLES))] = str(error)
            continue
        passed.append(path)
    # The figures docs/axolotl.md reports.
    assert (len(supported), len(other_objective), len(passed)) == (113, 11, 101), failed
    assert len(passed) >= 0.9 * (len(supported) - len(other_objective))
