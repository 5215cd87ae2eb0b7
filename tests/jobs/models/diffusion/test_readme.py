"""The README's diffusion walkthrough: its two specs load as written, and the cache one runs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from jobs import PathRoots, load_job_spec, run_job
from tests.jobs.models.diffusion.pipelines import image_folder

README = Path(__file__).parents[4] / "README.md"


def _walkthrough_specs() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Diffusion transformers") :]
    section = section[: section.index("\n## ", 3)]
    blocks = re.findall(r"(?m)^(    name: .*\n(?:    .*\n)+)", section)
    return [re.sub(r"(?m)^    ", "", block) for block in blocks]


@pytest.mark.filterwarnings("ignore")
def test_the_walkthrough_specs_load_and_the_cache_job_runs(pipelines: Path, tmp_path: Path) -> None:
    specs = _walkthrough_specs()
    assert [re.search(r"name: (\S+)", s).group(1) for s in specs] == ["my-cat-cache", "my-cat-lora"]
    shutil.copytree(pipelines / "qwen", tmp_path / "models" / "Qwen-Image")
    image_folder(tmp_path / "data" / "my_cat", [(64, 48), (48, 64)])
    (tmp_path / "data" / "caches").mkdir()
    roots = PathRoots(model_roots=[tmp_path / "models"], data_roots=[tmp_path / "data"])
    cache = load_job_spec(specs[0], roots)  # device auto: the CPU here, where the memory limit means nothing
    assert run_job(cache, output_dir=tmp_path / "out").status == "succeeded"
    lora = load_job_spec(specs[1], roots)
    assert lora.data.kind == "diffusion_cache" and lora.lora.rank == 32 and lora.sample.every_steps == 250
