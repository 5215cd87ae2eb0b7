"""Caption folders (kohya's and ai-toolkit's layout): images with .txt sidecars, N_name repeats, a trigger word,
caption dropout; a broken folder is refused at submit naming each file (a 422 from the service)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from jobs import JobSpecError, run_job
from jobs.events import event_to_wire
from jobs.models.diffusion.data.batches import DiffusionBatches
from jobs.models.diffusion.data.cache import CachedSamples
from jobs.models.diffusion.data.images import read_rows
from jobs.models.diffusion.flow_match import TrainingTimesteps
from jobs.models.diffusion.variants import FAMILIES
from tests.jobs.models.diffusion.helpers import cache_job, spec_from, train_job

pytestmark = pytest.mark.filterwarnings("ignore")


def caption_folder(directory: Path, folders: dict[str, int]) -> Path:
    """``{folder: images}``: PNGs of 64 x 48 with a caption file each (``[trigger]`` in the first)."""
    from PIL import Image

    for folder, count in folders.items():
        (directory / folder).mkdir(parents=True, exist_ok=True)
        for index in range(count):
            pixels = (torch.rand((48, 64, 3), generator=torch.Generator().manual_seed(index)) * 255).to(torch.uint8)
            Image.fromarray(pixels.numpy()).save(directory / folder / f"img_{index}.png")
            caption = "a photo of [trigger] on grass" if index == 0 else f"a red square number {index}"
            (directory / folder / f"img_{index}.txt").write_text(caption + "\n")
    return directory


def _data(**fields: object) -> dict:
    return {"kind": "image_caption", "path": "captioned", "max_pixels": 64 * 48, **fields}


def test_captions_repeats_and_the_trigger_word_are_read(roots, tmp_path: Path) -> None:
    caption_folder(tmp_path / "data" / "captioned", {"3_dog": 2, "plain": 1})
    rows = read_rows(spec_from(cache_job(data=_data(trigger_word="sks dog")), roots).data)
    assert [(str(r.media.relative_to(tmp_path / "data" / "captioned")), r.prompt, r.repeats) for r in rows] == [
        ("3_dog/img_0.png", "a photo of sks dog on grass", 3),
        ("3_dog/img_1.png", "sks dog, a red square number 1", 3),
        ("plain/img_0.png", "a photo of sks dog on grass", 1),
    ]


def test_a_caption_folder_caches_and_trains_with_repeats_and_caption_dropout(roots, tmp_path: Path) -> None:
    caption_folder(tmp_path / "data" / "captioned", {"2_dog": 2})
    assert run_job(spec_from(cache_job(data=_data(trigger_word="sks")), roots), output_dir=tmp_path / "c").status == (
        "succeeded"
    )
    cache = CachedSamples(tmp_path / "data" / "cache-qwen")
    assert [cache.repeats(i) for i in range(len(cache))] == [2, 2] and cache.empty_prompt() is not None
    batches = DiffusionBatches(
        cache, FAMILIES["QwenImageTransformer2DModel"], TrainingTimesteps("qwen_image", (0, 1), "bell"),
        batch_size=1, seed=0, caption_dropout=0.5,
    )  # fmt: skip
    assert batches.batches_per_epoch == 4  # two images, each twice
    empty = cache.empty_prompt()[0]
    dropped = [torch.equal(batches.batch(i)["prompt_embeds"][0], empty) for i in range(8)]
    assert any(dropped) and not all(dropped)

    events: list[dict] = []
    job = train_job(data={"kind": "diffusion_cache", "path": "cache-qwen", "caption_dropout": 0.5})
    outcome = run_job(
        spec_from(job, roots), output_dir=tmp_path / "t", report=lambda e: events.append(event_to_wire(e))
    )
    assert outcome.status == "succeeded" and len([e for e in events if e["type"] == "step"]) == 4
    live = train_job(data=_data(trigger_word="sks", caption_dropout=0.5), training={"steps": 2})
    assert run_job(spec_from(live, roots), output_dir=tmp_path / "live").status == "succeeded"


def _broken_folder(root: Path) -> None:
    caption_folder(root, {"5_cat": 3})
    (root / "5_cat" / "img_1.txt").unlink()  # an image without its caption
    (root / "5_cat" / "img_2.png").write_bytes(b"not a png")  # an image that does not open


def test_a_broken_caption_folder_is_refused_naming_each_file(roots, tmp_path: Path) -> None:
    _broken_folder(tmp_path / "data" / "captioned")
    with pytest.raises(JobSpecError) as caught:
        spec_from(cache_job(data=_data()), roots)
    (problem,) = caught.value.problems
    assert problem.path == "data.path"
    assert problem.message.startswith(
        f"2 of 3 images in {tmp_path / 'data' / 'captioned'} cannot be used: 5_cat/img_1.png: no caption file "
        "img_1.txt; 5_cat/img_2.png: UnidentifiedImageError: "
    )


def test_the_service_answers_a_broken_caption_folder_with_422(roots, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from service.api.app import create_app
    from service.settings import Settings
    from tests.service.checking.test_one_parse import IdleExecutor

    _broken_folder(tmp_path / "data" / "captioned")
    settings = Settings(
        data_dir=tmp_path / "service", devices="cpu", model_roots=roots.model_roots, data_roots=roots.data_roots,
        _env_file=None,
    )  # fmt: skip
    spec = yaml.safe_dump(cache_job(data=_data()))
    with TestClient(create_app(settings, executor=IdleExecutor())) as client:
        answer = client.post("/v1/jobs", content=spec, headers={"content-type": "application/yaml"})
        assert answer.status_code == 422, answer.text
        text = answer.text
        assert (
            "5_cat/img_1.png: no caption file img_1.txt" in text and "5_cat/img_2.png: UnidentifiedImageError" in text
        )
        assert client.get("/v1/jobs").json()["data"] == []
