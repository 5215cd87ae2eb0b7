"""``data.kind: image_chat``: both row layouts, labels on the answer only, and each bad input refused at submit
naming its row and field."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from jobs import PathRoots
from jobs.data.formats.examples import IGNORE
from jobs.errors import JobSpecError as SpecError
from jobs.models.vlm.batches import build_image_chat_data
from jobs.models.vlm.processor import ProcessorText, load_processor
from jobs.models.vlm.spec import ImageChatDataSpec
from tests.jobs.helpers import spec_from
from tests.jobs.vlm_helpers import (
    colour_record,
    data_url,
    save_tiny_qwen2_5_vl,
    solid_png,
    write_jsonl,
)


@pytest.fixture(scope="module")
def models(tiny_vlms: Path) -> Path:
    return tiny_vlms


def _rows(path: Path, model: Path, **data: Any) -> Any:
    spec = ImageChatDataSpec(kind="image_chat", path=path, **{"seq_len": 256, **data})
    return build_image_chat_data(spec, 1, 0, ProcessorText(load_processor(model)))


@pytest.mark.parametrize("arch", ["qwen", "idefics"])
def test_both_layouts_give_the_same_row_and_train_on_the_answer_only(tmp_path: Path, models: Path, arch: str) -> None:
    solid_png(tmp_path / "red.png", "red")
    trl = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is this image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        ],
        "images": ["red.png"],
    }
    openai = colour_record("red.png", "red")
    inline = colour_record(data_url("red"), "red")
    data = _rows(write_jsonl(tmp_path / "rows.jsonl", [openai, trl, inline]), models / arch)
    batches = [data.collate([row]) for row in data.rows]
    for batch in batches[1:]:
        assert torch.equal(batch["input_ids"], batches[0]["input_ids"])
        assert torch.equal(batch["pixel_values"], batches[0]["pixel_values"])
    tokenizer = data.text.tokenizer
    trained = [
        int(i) for i, label in zip(batches[0]["input_ids"][0], batches[0]["labels"][0], strict=False) if label != IGNORE
    ]
    assert tokenizer.decode(trained).startswith("red<|im_end|>")  # the answer and its end of turn, nothing else
    images = (batches[0]["input_ids"] == data.text.image_token_id).sum()
    assert images > 0 and all(batches[0]["labels"][batches[0]["input_ids"] == data.text.image_token_id] == IGNORE)


def test_images_of_different_sizes_batch_through_the_processor(tmp_path: Path, models: Path) -> None:
    solid_png(tmp_path / "small.png", "red", (28, 28))
    solid_png(tmp_path / "wide.png", "blue", (112, 56))
    rows = [colour_record("small.png", "red"), colour_record("wide.png", "blue")]
    data = _rows(write_jsonl(tmp_path / "rows.jsonl", rows), models / "qwen")
    batch = data.collate(data.rows)
    tokens = (batch["input_ids"] == data.text.image_token_id).sum(dim=1)
    assert tokens[1] > tokens[0]  # the wide image takes more tokens; the processor flattens both
    assert batch["image_grid_thw"].shape == (2, 3)
    assert int(batch["attention_mask"][0].sum()) < batch["input_ids"].shape[1]  # the shorter row is padded


def test_a_huge_image_is_resized_with_a_note(tmp_path: Path, models: Path, caplog: pytest.LogCaptureFixture) -> None:
    solid_png(tmp_path / "huge.png", "green", (2000, 1000))
    with caplog.at_level(logging.WARNING):
        data = _rows(write_jsonl(tmp_path / "rows.jsonl", [colour_record("huge.png", "green")]), models / "qwen",
                     max_image_pixels=56 * 56)  # fmt: skip
    assert "huge.png 2000x1000 resized to 79x39" in caplog.text and "row 1" in caplog.text
    assert (data.collate(data.rows)["input_ids"] == data.text.image_token_id).sum() <= 8  # 84x28 after the processor


def _submit(roots: PathRoots, models: Path, rows: list[dict[str, Any]], **data: Any) -> str:
    write_jsonl(roots.data_roots[0] / "vlm" / "rows.jsonl", rows)
    spec = {
        "name": "vlm",
        "device": "cpu",
        "model": {"kind": "hf_image_text_to_text", "path": str(models / "qwen"), "dtype": "float32"},
        "data": {"kind": "image_chat", "path": "vlm/rows.jsonl", **data},
        "training": {"steps": 1},
    }
    with pytest.raises(SpecError) as refused:
        spec_from(spec, PathRoots(model_roots=[models], data_roots=roots.data_roots))
    return str(refused.value)


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (
            colour_record("gone.png", "red"),
            "row 2: field 'messages[0].content[0].image_url.url': image 'gone.png' not found",
        ),
        (
            colour_record("corrupt.png", "red"),
            "row 2: field 'messages[0].content[0].image_url.url': image corrupt.png cannot be read",
        ),
        (colour_record("https://example.com/a.png", "red"), "is a web URL; jobs read no network"),
        (colour_record("../outside.png", "red"), "lies outside the data's folder"),
        (colour_record("data:image/png;base64,@@@", "red"), "base64 payload is not valid"),
        (
            {**colour_record("red.png", "red"), "images": ["red.png"]},
            "row 2: field 'images': holds 1 image(s) but the messages have 0",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "red"}]},
            "row 2: field 'messages[0].content[0]': is an image part without an image",
        ),
    ],
)
def test_bad_images_are_refused_at_submit_naming_the_row(
    roots: PathRoots, models: Path, row: dict[str, Any], expected: str
) -> None:
    folder = roots.data_roots[0] / "vlm"
    solid_png(folder / "red.png", "red")
    solid_png(roots.data_roots[0] / "outside.png", "red")
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    assert expected in _submit(roots, models, [colour_record("red.png", "red"), row])


def test_a_huge_image_is_refused_when_asked(roots: PathRoots, models: Path) -> None:
    solid_png(roots.data_roots[0] / "vlm" / "huge.png", "red", (300, 300))
    message = _submit(roots, models, [colour_record("huge.png", "red")], max_image_pixels=10_000, huge_images="refuse")
    assert "row 1: field 'messages[0].content[0].image_url.url': image huge.png is 300x300 (90000 pixels)" in message


def test_a_text_model_refuses_image_parts_at_submit_naming_row_and_the_image_kind(roots: PathRoots) -> None:
    from jobs.spec.preflight import preflight_problems
    from tests.jobs.llm_helpers import llm_spec, save_bpe_tokenizer, save_llama

    save_llama(roots.model_roots[0] / "llama")
    save_bpe_tokenizer(roots.model_roots[0] / "tok")
    solid_png(roots.data_roots[0] / "red.png", "red")
    text_row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the fox"}]}
    write_jsonl(roots.data_roots[0] / "chat.jsonl", [text_row, colour_record("red.png", "red")])
    problems = preflight_problems(spec_from(llm_spec(), roots))
    [problem] = [p for p in problems if p.path == "data.path"]
    assert problem.message.startswith("chat.jsonl row 2: field 'messages[0].content[0].type': image content")
    assert "cannot be trained" in problem.message and "model.kind: hf_image_text_to_text" in problem.message


@pytest.mark.parametrize("arch", ["qwen", "idefics"])
def test_a_text_only_row_batches_beside_an_image_row(tmp_path: Path, models: Path, arch: str) -> None:
    from transformers import AutoModelForImageTextToText

    solid_png(tmp_path / "red.png", "red")
    text_only = {"messages": [{"role": "user", "content": "no image here"}, {"role": "assistant", "content": "red"}]}
    data = _rows(write_jsonl(tmp_path / "rows.jsonl", [text_only, colour_record("red.png", "red")]), models / arch)
    batch = data.collate(data.rows)
    assert (batch["input_ids"][0] == data.text.image_token_id).sum() == 0
    model = AutoModelForImageTextToText.from_pretrained(str(models / arch))
    assert torch.isfinite(model(**batch).loss)


def _with_detail(image: str, detail: str) -> dict[str, Any]:
    row = colour_record(image, "red")
    row["messages"][0]["content"][0]["image_url"]["detail"] = detail
    return row


def test_openais_low_detail_shows_the_processor_the_image_within_512x512_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from PIL import Image

    model = save_tiny_qwen2_5_vl(tmp_path / "qwen", max_pixels=1600 * 1600)  # the processor keeps large images large
    solid_png(tmp_path / "big.png", "red", (1200, 600))
    rows = [_with_detail("big.png", "low"), _with_detail("big.png", "high"), _with_detail("big.png", "auto")]
    with caplog.at_level(logging.WARNING):
        data = _rows(write_jsonl(tmp_path / "rows.jsonl", rows), model, seq_len=4096)
    grids = [data.collate([row])["image_grid_thw"].tolist() for row in data.rows]
    text = data.text  # the oracle: the processor's own grid for the image at each size
    low = text.pixels([[Image.new("RGB", (512, 256), (220, 30, 30))]])["image_grid_thw"].tolist()
    full = text.pixels([[Image.new("RGB", (1200, 600), (220, 30, 30))]])["image_grid_thw"].tolist()
    assert low != full  # old code: every row's grid is the full image's
    assert grids == [low, full, full]
    tokens = [row.input_ids.count(text.image_token_id) for row in data.rows]
    assert tokens[0] < tokens[1] == tokens[2]
    assert data.notices == [
        "data: 1 image(s) with image_url.detail=low shown to the model at most 512x512 (OpenAI's low detail): "
        "rows.jsonl row 1: big.png 1200x600 shown at 512x256"
    ]
    assert data.notices[0] in caplog.text


def test_low_detail_leaves_an_image_within_512x512_as_it_is(tmp_path: Path, models: Path) -> None:
    solid_png(tmp_path / "small.png", "red", (84, 56))
    data = _rows(write_jsonl(tmp_path / "rows.jsonl", [_with_detail("small.png", "low")]), models / "qwen")
    assert data.notices == []
    from PIL import Image

    unchanged = data.text.pixels([[Image.new("RGB", (84, 56))]])["image_grid_thw"].tolist()
    assert data.collate(data.rows)["image_grid_thw"].tolist() == unchanged


VIDEO_ROWS = [
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens"}]},
                {"role": "assistant", "content": "red"},
            ],
            "videos": ["clip.mp4"],
        },
        "row 2: field 'videos': holds video(s): Ferry trains on images, not videos",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "hm"}]},
                {"role": "assistant", "content": "red"},
            ]
        },
        "row 2: field 'messages[0].content[0].type': is a 'video' part: Ferry trains on images, not videos",
    ),
    (
        {
            "messages": [{"role": "user", "content": "<video> what"}, {"role": "assistant", "content": "red"}],
            "videos": [{"path": "clip.mp4"}],
        },
        "row 2: field 'videos': holds video(s)",
    ),
    (_with_detail("red.png", "medium"), "row 2: field 'messages[0].content[0].image_url.detail': must be one of"),
]


@pytest.mark.parametrize(("row", "expected"), VIDEO_ROWS)
def test_a_video_row_or_an_unknown_detail_is_refused_at_submit_naming_the_row(
    roots: PathRoots, models: Path, row: dict[str, Any], expected: str
) -> None:
    solid_png(roots.data_roots[0] / "vlm" / "red.png", "red")
    assert expected in _submit(roots, models, [colour_record("red.png", "red"), row])


def test_more_images_in_a_row_than_data_max_images_per_row_are_refused_naming_the_image(
    roots: PathRoots, models: Path
) -> None:
    solid_png(roots.data_roots[0] / "vlm" / "red.png", "red")
    row = colour_record("red.png", "red")
    row["messages"][0]["content"] = [row["messages"][0]["content"][0]] * 11 + [{"type": "text", "text": "colours"}]
    trl = {"messages": [{"role": "user", "content": "<image>" * 11}, {"role": "assistant", "content": "red"}],
           "images": ["red.png"] * 11}  # fmt: skip
    assert (
        "row 1: field 'messages[0].content[10].image_url.url': is the row's image 11, above "
        "data.max_images_per_row=10; raise it for multi-image rows, or split the row"
    ) in _submit(roots, models, [row])
    assert "row 1: field 'images[10]': is the row's image 11" in _submit(roots, models, [trl])
    write_jsonl(roots.data_roots[0] / "vlm" / "rows.jsonl", [row, trl])
    spec = {
        "name": "vlm",
        "device": "cpu",
        "model": {"kind": "hf_image_text_to_text", "path": str(models / "qwen"), "dtype": "float32"},
        "data": {"kind": "image_chat", "path": "vlm/rows.jsonl", "max_images_per_row": 11},
        "training": {"steps": 1},
    }
    spec_from(spec, PathRoots(model_roots=[models], data_roots=roots.data_roots))  # raised, the rows pass
