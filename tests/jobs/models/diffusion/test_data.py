"""Image/caption datasets: DiffSynth's layout, the pixel budget, aspect buckets, submit-time row checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import JobSpecError
from jobs.models.diffusion.data.images import bucketed_batches, load_pixels, read_rows, target_size
from tests.jobs.models.diffusion.helpers import cache_job, spec_from
from tests.jobs.models.diffusion.pipelines import image_folder


def test_target_size_keeps_the_aspect_within_budget_in_multiples_of_16() -> None:
    assert target_size(4000, 3000, 1024 * 1024) == (1168, 880)
    assert target_size(100, 50, 1024 * 1024) == (96, 48)  # never scaled up, only floored
    w, h = target_size(1920, 1080, 512 * 512)
    assert w * h <= 512 * 512 and w % 16 == 0 and h % 16 == 0


def test_buckets_never_mix_shapes_and_cover_whole_batches() -> None:
    sizes = [(64, 48)] * 5 + [(48, 64)] * 4
    batches = bucketed_batches(sizes, 2, seed=0, epoch=0)
    assert len(batches) == 4  # 2 + 2 whole batches; one leftover of the first shape dropped
    assert all(len({sizes[i] for i in batch}) == 1 for batch in batches)
    assert batches == bucketed_batches(sizes, 2, seed=0, epoch=0)
    assert batches != bucketed_batches(sizes, 2, seed=0, epoch=1)


def test_metadata_json_and_csv_read_alike(roots, tmp_path: Path) -> None:
    image_folder(tmp_path / "data" / "as_json", [(32, 32), (48, 32)], fmt="json")
    spec = spec_from(cache_job(data={"path": "as_json"}), roots)
    rows = read_rows(spec.data)
    assert [r.prompt for r in rows] == ["a red square number 0", "a red square number 1"]
    pixels = load_pixels(rows[1], target_size(48, 32, 32 * 32), 1)
    assert pixels.shape == (3, 1, 16, 32) and pixels.min() >= -1 and pixels.max() <= 1


def test_rows_that_do_not_open_are_named_at_submit(roots, tmp_path: Path) -> None:
    folder = tmp_path / "data" / "images"
    (folder / "image_1.png").write_bytes(b"not a png")
    (folder / "image_3.png").unlink()
    with pytest.raises(JobSpecError) as caught:
        spec_from(cache_job(), roots)
    problem = caught.value.problems[0]
    assert problem.path == "data.path"
    assert problem.message.startswith("2 of 4 rows of metadata.csv do not open: row 1 (image_1.png): ")
    assert "row 3 (image_3.png): FileNotFoundError" in problem.message


def test_metadata_without_a_prompt_column_is_refused(roots, tmp_path: Path) -> None:
    (tmp_path / "data" / "images" / "metadata.csv").write_text("image,caption\nimage_0.png,a cat\n")
    with pytest.raises(JobSpecError, match=r"lacks column\(s\) \['prompt'\]"):
        spec_from(cache_job(), roots)
