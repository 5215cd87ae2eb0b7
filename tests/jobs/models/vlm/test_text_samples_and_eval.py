"""``text_samples`` and ``eval`` on ``model.kind: hf_image_text_to_text``: a prompt with an image (OpenAI's content
parts) is answered through the processor, named by its image, and after a tiny model learns the solid-colour task
its samples name the colours; the held-out rows' eval loss falls. Both sections were refused for this kind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jobs import PathRoots, run_job
from jobs.spec.loading import JobSpecError
from tests.jobs.helpers import spec_from
from tests.jobs.vlm_helpers import COLOURS, colour_record, save_tiny_qwen2_5_vl, solid_png, write_jsonl

QUESTION = "what colour is this image"


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> PathRoots:
    models, data = tmp_path_factory.mktemp("models"), tmp_path_factory.mktemp("colours")
    save_tiny_qwen2_5_vl(models / "qwen")
    for colour in COLOURS:
        solid_png(data / f"{colour}.png", colour)
    rows = [colour_record(f"{c}.png", c) for c in COLOURS]
    write_jsonl(data / "train.jsonl", rows)
    write_jsonl(data / "held_out.jsonl", rows[:2])
    return PathRoots(model_roots=[models], data_roots=[data])


def image_prompt(image: str) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


def job(**sections: Any) -> dict[str, Any]:
    return {
        "name": "vlm-samples",
        "device": "cpu",
        "model": {"kind": "hf_image_text_to_text", "path": "qwen", "dtype": "float32"},
        "data": {"kind": "image_chat", "path": "train.jsonl", "seq_len": 128},
        "training": {"steps": 40, "batch_size": 4, "learning_rate": 3e-3, "mixed_precision": "no"},
        "checkpoint": {"every_steps": 1000},
        **sections,
    }


def learns_and_names_the_colours(tmp_path: Path, roots: PathRoots, **sections: Any) -> None:
    samples = {"prompts": [image_prompt(f"{c}.png") for c in COLOURS], "max_new_tokens": 3}
    spec = spec_from(job(text_samples=samples, eval={"path": "held_out.jsonl"}, **sections), roots)
    events: list[Any] = []
    run_job(spec, output_dir=tmp_path / "out", report=events.append)
    answers = {e.prompt: e.text for e in events if e.type == "sample"}
    assert list(answers) == [f"[{c}.png] {QUESTION}" for c in COLOURS]
    assert all(answers[f"[{c}.png] {QUESTION}"].startswith(c) for c in COLOURS), answers
    losses = [(e.step, e.eval_loss) for e in events if e.type == "eval"]
    assert [step for step, _ in losses] == [0, 40] and losses[1][1] < losses[0][1] / 4, losses


def test_after_learning_the_colours_the_samples_name_them_and_the_eval_loss_falls(
    tmp_path: Path, roots: PathRoots
) -> None:
    learns_and_names_the_colours(tmp_path, roots)  # old code: text_samples and eval refused for this kind


@pytest.mark.gpu
def test_on_cuda_with_model_offload_the_samples_name_the_colours(tmp_path: Path, roots: PathRoots) -> None:
    offload = {"enable_model_cpu_offload": True, "granularity": "block"}
    learns_and_names_the_colours(tmp_path, roots, device="cuda", offload=offload)


def test_offloaded_text_samples_every_steps_a_data_url_a_string_prompt_and_an_eval_split(
    tmp_path: Path, roots: PathRoots
) -> None:
    from PIL import Image

    from tests.jobs.vlm_helpers import data_url

    big = data_url("blue", (600, 300))  # the thumbnail is at most 256x256, whatever the prompt's image
    samples = {"prompts": [image_prompt(big), "hello"], "every_steps": 1, "max_new_tokens": 2}
    offload = {"enable_model_cpu_offload": True, "granularity": "block"}  # samples and eval through the engine
    sections = {"text_samples": samples, "eval": {"split": 0.25}, "offload": offload}
    spec = spec_from(job(training={"steps": 2, "batch_size": 2}, **sections), roots)
    events: list[Any] = []
    run_job(spec, output_dir=tmp_path / "out", report=events.append)
    shown = [(e.step, e.prompt) for e in events if e.type == "sample"]
    assert shown == [(s, p) for s in (1, 2) for p in (f"[data: URL] {QUESTION}", "hello")]
    images = [(e.artifact_path, e.media_type) for e in events if e.type == "sample"]
    assert images == [("samples/prompts/prompt-0.png", "image/png"), (None, None)] * 2  # old code: no image
    with Image.open(tmp_path / "out" / "samples" / "prompts" / "prompt-0.png") as thumbnail:
        assert thumbnail.size == (256, 128) and thumbnail.getpixel((10, 10)) == COLOURS["blue"]
    assert [e.metrics["batches"] for e in events if e.type == "eval"] == [1.0, 1.0]  # one held-out row


def test_a_missing_sample_image_is_refused_at_submit_naming_the_prompt(roots: PathRoots) -> None:
    with pytest.raises(JobSpecError) as refused:
        spec_from(job(text_samples={"prompts": [image_prompt("purple.png")]}), roots)
    message = str(refused.value)
    assert "text_samples.prompts" in message and "field 'messages[0].content[0].image_url.url'" in message
    assert "image 'purple.png' not found beside the data" in message, message


def test_image_parts_in_a_text_models_sample_prompts_are_refused(tmp_path: Path) -> None:
    from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, save_llama

    save_llama(tmp_path / "llama")
    save_bpe_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "chat.jsonl", [chat_record(0)])
    text_job = llm_spec(text_samples={"prompts": [image_prompt("red.png")]})
    with pytest.raises(JobSpecError) as refused:
        spec_from(json.loads(json.dumps(text_job)), PathRoots(model_roots=[tmp_path], data_roots=[tmp_path]))
    assert "text_samples.prompts.0.0.content" in str(refused.value)
    assert "content parts (images) are for model.kind=hf_image_text_to_text" in str(refused.value)
