"""OpenAI's vision fine-tuning files (chat rows whose user turns hold ``image_url`` parts with ``data:`` URLs) on
Ferry's OpenAI route, driven by OpenAI's client: a vision-language base model trains them as ``image_chat``; a text
model refuses them naming the row; a web URL, a path, corrupt base64, bytes of no image format, a corrupt image
and a huge one are each refused (or resized, with a note in the job's events) naming the row."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.jobs.llm_helpers import chat_record, save_bpe_tokenizer, save_llama
from tests.jobs.vlm_helpers import COLOURS, colour_record, data_url, save_tiny_qwen2_5_vl
from tests.service.api.openai_client import idle_ferry_client
from tests.service.conftest import TOKEN

SAMPLES = {  # an image prompt in OpenAI's content parts, answered through the processor at the end
    "prompts": [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url("red", (600, 300))}},
                    {"type": "text", "text": "what colour is this image"},
                ],
            }
        ]
    ],
    "max_new_tokens": 2,
}
TINY = {"device": "cpu", "model": {"dtype": "float32"}, "lora": {"rank": 4}, "data": {"seq_len": 128}}


def save_vision_and_text_models(root: Path) -> Path:
    """A tiny Qwen2.5-VL (``qwen``) and a tiny text-only Llama with its tokenizer (``llama``) under ``root``."""
    save_tiny_qwen2_5_vl(root / "qwen")
    save_llama(root / "llama")
    save_bpe_tokenizer(root / "llama")
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_vision_and_text_models(tmp_path_factory.mktemp("models"))


@pytest.fixture
def ferry(tmp_path: Path, models: Path) -> Iterator[openai.OpenAI]:
    with idle_ferry_client(tmp_path, model_roots=[models]) as client:
        yield client


def colour_rows() -> list[dict[str, Any]]:
    return [colour_record(data_url(colour), colour) for colour in COLOURS]


def with_url(url: str, detail: str | None = None) -> dict[str, Any]:
    row = colour_record(url, "red")
    if detail is not None:
        row["messages"][0]["content"][0]["image_url"]["detail"] = detail
    return row


def upload(ferry: openai.OpenAI, rows: list[dict[str, Any]]) -> Any:
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    return ferry.files.create(file=("train.jsonl", body), purpose="fine-tune")


def png_bytes(size: tuple[int, int], colour: str = "red") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, COLOURS[colour]).save(buffer, format="PNG")
    return buffer.getvalue()


def as_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def test_a_vision_file_uploads_as_image_chat_with_openais_detail(ferry: openai.OpenAI) -> None:
    rows = [with_url(data_url("red"), "low"), with_url(data_url("blue"), "high"), chat_record(0)]
    uploaded = upload(ferry, rows)  # old code: 422 "image content ('image_url') cannot be trained"
    assert (uploaded.format, uploaded.rows) == ("image_chat", 3)  # type: ignore[attr-defined]
    assert upload(ferry, [chat_record(1)]).format == "chat"  # type: ignore[attr-defined]


FIELD = "messages[0].content[0]"


@pytest.mark.parametrize(
    ("url", "detail", "field", "words"),
    [
        ("https://example.com/cat.png", None, f"{FIELD}.image_url.url", "is a web URL"),
        ("cat.png", None, f"{FIELD}.image_url.url", "not a data URL; an uploaded file carries its images inside it"),
        ("data:image/png;base64,iVBOR!!!", None, f"{FIELD}.image_url.url", "base64 payload does not decode"),
        (as_url(b"not an image at all"), None, f"{FIELD}.image_url.url", "says image/png but its bytes are no PNG"),
        ("data:image/tiff;base64,AAAA", None, f"{FIELD}.image_url.url", "is image/tiff; OpenAI's vision fine-tuning"),
        ("data:text/plain;base64,AAAA", None, f"{FIELD}.image_url.url", "must read data:image/<png|jpeg|webp>"),
        (data_url("red"), "medium", f"{FIELD}.image_url.detail", "must be one of auto, low, high"),
    ],
)
def test_an_image_no_job_can_read_is_refused_at_upload_naming_the_row(
    ferry: openai.OpenAI, url: str, detail: str | None, field: str, words: str
) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        upload(ferry, [with_url(data_url("red")), with_url(url, detail)])
    message = refused.value.body["message"]  # Ferry's envelope: /v1/files is Ferry's route family
    assert message.startswith(f"train.jsonl row 2: field '{field}': ") and words in message, message


def test_an_image_in_the_assistants_turn_is_refused_at_upload(ferry: openai.OpenAI) -> None:
    row = colour_record(data_url("red"), "red")
    row["messages"][1]["content"] = [{"type": "image_url", "image_url": {"url": data_url("red")}}]
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        upload(ferry, [row])
    assert "row 1: field 'messages[1].content[0]': images belong in user messages" in refused.value.body["message"]


def test_a_text_model_refuses_an_image_file_naming_the_row_and_the_fix(ferry: openai.OpenAI) -> None:
    uploaded = upload(ferry, [chat_record(0), chat_record(1), with_url(data_url("red"))])
    with pytest.raises(openai.BadRequestError) as refused:
        ferry.fine_tuning.jobs.create(model="llama", training_file=uploaded.id, extra_body={"ferry": TINY})
    body = refused.value.body
    assert body["param"] == "training_file"
    assert body["message"] == (
        f"training_file: {uploaded.id} row 3: field 'messages[0].content[0]' is an image, and model 'llama' is a "
        "text-only model (its config.json has no vision_config); fine-tune a vision-language model (one "
        "AutoModelForImageTextToText loads, with its processor, e.g. Qwen2.5-VL or SmolVLM) on this file, or upload "
        "it without image parts."
    )


def test_a_corrupt_image_is_refused_when_the_job_is_created_naming_the_row(ferry: openai.OpenAI) -> None:
    broken = as_url(png_bytes((28, 28))[:40])  # a PNG's signature and header, its pixels cut off
    uploaded = upload(ferry, [*colour_rows(), with_url(broken)])  # the upload reads no pixels
    with pytest.raises(openai.BadRequestError) as refused:
        ferry.fine_tuning.jobs.create(
            model="qwen", training_file=uploaded.id, hyperparameters={"batch_size": 2}, extra_body={"ferry": TINY}
        )
    body = refused.value.body
    assert body["param"] == "training_file" and body["code"] == "invalid_spec"
    assert body["message"].startswith(
        "training_file: train.jsonl row 5: field 'messages[0].content[0].image_url.url': image data: URL cannot be "
        "read: "
    ), body["message"]


def test_a_huge_image_is_refused_when_the_request_asks_so_naming_the_row(ferry: openai.OpenAI) -> None:
    uploaded = upload(ferry, [*colour_rows(), with_url(as_url(png_bytes((3000, 2000))))])
    with pytest.raises(openai.BadRequestError) as refused:
        ferry.fine_tuning.jobs.create(
            model="qwen",
            training_file=uploaded.id,
            hyperparameters={"batch_size": 2},
            extra_body={"ferry": {**TINY, "data": {"seq_len": 128, "huge_images": "refuse"}}},
        )
    message = refused.value.body["message"]
    assert message.startswith("training_file: train.jsonl row 5: field 'messages[0].content[0].image_url.url': ")
    assert "is 3000x2000 (6000000 pixels), above ferry.data.max_image_pixels=1003520" in message, message


def test_a_vision_file_on_a_vision_model_does_not_take_dpo(ferry: openai.OpenAI) -> None:
    uploaded = upload(ferry, colour_rows())
    with pytest.raises(openai.BadRequestError) as refused:
        ferry.fine_tuning.jobs.create(model="qwen", training_file=uploaded.id, method={"type": "dpo"})
    assert refused.value.body["param"] == "training_file"
    assert (
        "holds chat rows with images, which train supervised jobs; this is a dpo job" in refused.value.body["message"]
    )


def follow(client: openai.OpenAI, job_id: str, status: str, timeout: float = 180) -> list[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = list(client.fine_tuning.jobs.list_events(job_id, limit=100))
        if any(e.data and e.data.get("type") == "status" and e.data["status"] == status for e in events):
            return events
        if any(e.data and e.data.get("type") == "status" and e.data["status"] == "failed" for e in events):
            raise AssertionError(f"{job_id} failed: {client.fine_tuning.jobs.retrieve(job_id).error}")
        time.sleep(0.2)
    raise TimeoutError(f"{job_id} did not reach {status}: {client.fine_tuning.jobs.retrieve(job_id)}")


def test_a_vision_file_trains_a_vision_language_model_through_openais_client(
    tmp_path: Path, models: Path, make_server: Any
) -> None:
    server = make_server(FERRY_MODEL_ROOTS=str(models))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0)
    huge = with_url(as_url(png_bytes((1400, 1000), "green")))  # 1.4M pixels: resized to data.max_image_pixels
    low = with_url(as_url(png_bytes((800, 600), "blue")), "low")  # OpenAI's low detail: within 512x512
    uploaded = client.files.create(
        file=("train.jsonl", "".join(json.dumps(r) + "\n" for r in [*colour_rows(), huge, low]).encode()),
        purpose="fine-tune",
    )
    held_out = client.files.create(
        file=("valid.jsonl", "".join(json.dumps(r) + "\n" for r in colour_rows()[:2]).encode()), purpose="fine-tune"
    )
    job = client.fine_tuning.jobs.create(
        model="qwen",
        training_file=uploaded.id,
        validation_file=held_out.id,
        hyperparameters={"n_epochs": 1, "batch_size": 6},
        extra_body={"ferry": {**TINY, "checkpoint": {"every_steps": 1}, "text_samples": SAMPLES}},
    )
    events = follow(client, job.id, "succeeded")
    spec = httpx.get(f"{server.url}/v1/jobs/{job.id}", headers={"Authorization": f"Bearer {TOKEN}"}).json()["spec"]
    assert (spec["model"]["kind"], spec["data"]["kind"]) == ("hf_image_text_to_text", "image_chat")
    assert [e.data["step"] for e in events if e.type == "metrics"] == [1]
    notes = [e.message for e in events if "resized" in e.message]
    assert (
        notes
        and "train.jsonl row 5: data: URL 1400x1000 resized to 1185x846 (data.max_image_pixels=1003520)" in notes[0]
    ), [e.message for e in events]
    [low_note] = [e.message for e in events if "detail=low" in e.message]  # said once
    assert "train.jsonl row 6: data: URL 800x600 shown at 512x384" in low_note, low_note
    assert [c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job.id).data] == [1]
    validation = [e.message for e in events if "validation loss" in e.message]
    assert [m.split(":")[0] for m in validation] == ["Step 1", "Step 0"], validation  # newest first
    headers = {"Authorization": f"Bearer {TOKEN}"}
    samples = httpx.get(f"{server.url}/v1/jobs/{job.id}/samples", headers=headers).json()["data"]
    assert [s["prompt"] for s in samples] == ["[data: URL] what colour is this image"], samples
    assert isinstance(samples[0]["text"], str) and samples[0]["step"] == 1
    # The prompt's image beside its answer: a thumbnail the API serves (old code: a text sample had no url).
    assert samples[0]["url"] == f"/v1/jobs/{job.id}/samples/files/samples/prompts/prompt-0.png", samples
    thumbnail = httpx.get(f"{server.url}{samples[0]['url']}", headers=headers)
    assert thumbnail.status_code == 200 and thumbnail.headers["content-type"] == "image/png"
    from PIL import Image

    with Image.open(io.BytesIO(thumbnail.content)) as image:
        assert image.size == (256, 128) and image.getpixel((5, 5)) == COLOURS["red"]  # within 256x256, aspect kept
    assert len(thumbnail.content) < 64 << 10


def test_auto_hyperparameters_are_chosen_from_the_image_rows(ferry: openai.OpenAI) -> None:
    uploaded = upload(ferry, colour_rows())
    job = ferry.fine_tuning.jobs.create(model="qwen", training_file=uploaded.id, extra_body={"ferry": TINY})
    # old code: "auto is chosen from text data (data.kind: text)"; OpenAI's rules on 4 rows: batch 1, 25 epochs
    assert (job.hyperparameters.batch_size, job.hyperparameters.n_epochs) == (1, 25)


def test_an_image_past_pillows_decompression_bomb_limit_is_refused_before_it_is_decoded(
    ferry: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500_000)  # Pillow refuses above twice this: 1500x1000 is past it
    uploaded = upload(ferry, [*colour_rows(), with_url(as_url(png_bytes((1500, 1000))))])
    with pytest.raises(openai.BadRequestError) as refused:
        ferry.fine_tuning.jobs.create(
            model="qwen", training_file=uploaded.id, hyperparameters={"batch_size": 2}, extra_body={"ferry": TINY}
        )
    message = refused.value.body["message"]
    assert message.startswith("training_file: train.jsonl row 5: field 'messages[0].content[0].image_url.url': ")
    assert "image data: URL is too large to open safely" in message, message


def image_bytes(mode: str, kind: str = "PNG", size: tuple[int, int] = (28, 28)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format=kind)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (image_bytes("L"), "png"),
        (image_bytes("P"), "png"),
        (image_bytes("LA"), "png"),
        (image_bytes("L", "JPEG"), "jpeg"),
        (image_bytes("CMYK", "JPEG"), "jpeg"),
    ],
    ids=["grey-png", "palette-png", "grey-alpha-png", "grey-jpeg", "cmyk-jpeg"],
)
def test_an_image_not_in_rgb_or_rgba_is_refused_at_upload_naming_pillows_mode(
    ferry: openai.OpenAI, data: bytes, kind: str
) -> None:
    from PIL import Image

    mode = Image.open(io.BytesIO(data)).mode  # the oracle: the mode Pillow opens the file in
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        upload(ferry, [with_url(data_url("red")), with_url(as_url(data, kind))])
    assert refused.value.body["message"] == (
        f"train.jsonl row 2: field '{FIELD}.image_url.url': is a {kind.upper()} in mode {mode}; OpenAI's vision "
        "fine-tuning takes RGB or RGBA images: convert it (Pillow: image.convert('RGB'))"
    )


def test_rgb_and_rgba_pngs_jpegs_and_webps_upload(ferry: openai.OpenAI) -> None:
    rows = [
        with_url(as_url(image_bytes("RGBA"))),
        with_url(as_url(image_bytes("RGB", "JPEG"), "jpeg")),
        with_url(as_url(image_bytes("RGB", "JPEG"), "jpg")),
        with_url(as_url(image_bytes("RGBA", "WEBP"), "webp")),
    ]
    assert upload(ferry, rows).rows == 4  # type: ignore[attr-defined]


def test_a_gif_is_refused_at_upload_as_openais_vision_fine_tuning_does(ferry: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        upload(ferry, [with_url(as_url(image_bytes("P", "GIF"), "gif"))])
    assert refused.value.body["message"] == (
        f"train.jsonl row 1: field '{FIELD}.image_url.url': is image/gif; OpenAI's vision fine-tuning takes JPEG, "
        "PNG and WEBP images: convert it (e.g. to PNG) and write data:image/png;base64,<data>"
    )


def test_more_than_ten_images_in_an_example_are_refused_at_upload_naming_the_eleventh(
    ferry: openai.OpenAI, tmp_path: Path
) -> None:
    row = colour_record(data_url("red"), "red")
    part = row["messages"][0]["content"][0]
    row["messages"][0]["content"] = [part] * 11 + [{"type": "text", "text": "what colours"}]
    ten = colour_record(data_url("red"), "red")
    ten["messages"][0]["content"] = [part] * 10
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        upload(ferry, [ten, row])
    assert refused.value.body["message"] == (
        "train.jsonl row 2: field 'messages[0].content[10]': is the row's image 11; OpenAI's vision fine-tuning "
        "takes at most 10 images an example: split the row or leave images out"
    )
    assert ferry.files.list().data == []  # nothing stored: no record, no bytes
    assert [p for p in tmp_path.rglob("uploads/*") if p.is_file() or any(p.iterdir())] == []


def test_an_image_over_10_mb_is_refused_at_upload(tmp_path: Path, models: Path) -> None:
    big = png_bytes((28, 28)) + bytes(11 << 20)  # a PNG's header, then 11 MiB: the upload reads no pixels
    with idle_ferry_client(tmp_path, model_roots=[models], max_upload_line_bytes=32 << 20) as client:
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            upload(client, [with_url(as_url(big))])
        assert client.files.list().data == []
    assert refused.value.body["message"] == (
        f"train.jsonl row 1: field '{FIELD}.image_url.url': is a 11.0 MiB image; OpenAI's vision fine-tuning takes "
        "images of at most 10.0 MiB: shrink or recompress it"
    )


def test_examples_with_images_past_openais_count_a_file_are_refused_naming_the_row(
    ferry: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    import service.uploads.rows

    monkeypatch.setattr(service.uploads.rows, "MAX_IMAGE_EXAMPLES", 2)  # OpenAI's is 50,000: too many to upload
    rows = [with_url(data_url("red")), chat_record(0), with_url(data_url("red")), chat_record(1)]
    assert upload(ferry, rows).rows == 4  # type: ignore[attr-defined]  # text rows do not count
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        upload(ferry, [*rows, with_url(data_url("blue"))])
    assert refused.value.body["message"] == (
        "train.jsonl row 5: field 'messages[0].content[0]': is in the file's example 3 with images; OpenAI's vision "
        "fine-tuning takes at most 2 examples with images a file (text rows not counted): split the file"
    )


def test_a_video_part_is_refused_at_upload_naming_the_row(ferry: openai.OpenAI) -> None:
    row = colour_record(data_url("red"), "red")
    row["messages"][0]["content"][0] = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        upload(ferry, [with_url(data_url("red")), row])
    assert refused.value.body["message"].startswith(
        "train.jsonl row 2: field 'messages[0].content[0].type': is a 'video_url' part; OpenAI's fine-tuning files "
        "hold text and images, and Ferry trains on images, not videos"
    ), refused.value.body["message"]
