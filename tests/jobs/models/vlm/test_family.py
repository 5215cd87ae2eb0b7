"""``model.kind: hf_image_text_to_text`` on two architectures: offload gradients equal the resident model's, the
vision tower is one frozen unit, a job trains and checkpoints, and a tiny model learns to name a colour."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from jobs import PathRoots, run_job
from jobs.models.vlm.batches import build_image_chat_data
from jobs.models.vlm.family import FAMILY
from jobs.models.vlm.model import vision_tower_name
from jobs.models.vlm.processor import ProcessorText, load_processor
from jobs.models.vlm.spec import HFImageTextToTextSpec, ImageChatDataSpec
from jobs.spec.job import LoraSpec
from offload import OffloadOptions, OffloadTrainingManager
from tests.jobs.helpers import spec_from
from tests.jobs.vlm_helpers import (
    COLOURS,
    TINY_VLMS,
)


@pytest.fixture(scope="module")
def models(tiny_vlms: Path) -> Path:
    return tiny_vlms


def _setup(model_dir: Path, data: Path, batch_size: int) -> tuple[HFImageTextToTextSpec, ProcessorText, object]:
    spec = HFImageTextToTextSpec(kind="hf_image_text_to_text", path=model_dir, dtype="float32")
    text = ProcessorText(load_processor(model_dir))
    batches = build_image_chat_data(ImageChatDataSpec(kind="image_chat", path=data), batch_size, 0, text)
    return spec, text, batches


@pytest.mark.parametrize("arch", list(TINY_VLMS))
def test_offload_lora_gradients_equal_the_resident_models(models: Path, colours: Path, arch: str) -> None:
    spec, _, batches = _setup(models / arch, colours, 2)
    lora = LoraSpec(target_modules=["q_proj", "v_proj"], rank=4, init_lora_weights="gaussian")
    resident = FAMILY.apply_lora(FAMILY.build(spec, 0), lora)  # type: ignore[misc]
    offloaded = copy.deepcopy(resident)
    batch = batches.batch(0)  # type: ignore[attr-defined]
    FAMILY.loss(resident, batch).backward()
    whole = FAMILY.whole_units(offloaded)  # type: ignore[misc]
    options = OffloadOptions(granularity="block", whole_units=whole)
    manager = OffloadTrainingManager(offloaded, torch.device("cpu"), options=options)
    FAMILY.loss(offloaded, batch).backward()
    manager.after_backward()
    tower = vision_tower_name(offloaded)
    assert whole == (tower,) and tower in [unit.name for unit in manager.units]  # the tower is one unit
    trained = {n: p.grad for n, p in resident.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n and ".visual." not in n and "vision_model" not in n for n in trained)
    for name, param in offloaded.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, trained[name], rtol=1e-5, atol=1e-7, msg=name)
    manager.remove()


def test_a_lora_job_trains_offloaded_checkpoints_the_adapter_with_the_processor_and_samples_images(
    tmp_path: Path, models: Path, colours: Path
) -> None:
    roots = PathRoots(model_roots=[models], data_roots=[colours.parent])
    spec = spec_from(
        {
            "name": "vlm-lora",
            "device": "cpu",
            "model": {"kind": "hf_image_text_to_text", "path": "qwen", "dtype": "float32"},
            "data": {"kind": "image_chat", "path": "train.jsonl", "seq_len": 128},
            "lora": {"target_modules": ["q_proj", "v_proj"], "rank": 4},
            "training": {"steps": 2, "batch_size": 2, "learning_rate": 1e-2, "gradient_checkpointing": True},
            "offload": {"enable_model_cpu_offload": True, "granularity": "block"},
            "image_samples": {"rows": 2, "every_steps": 2, "max_new_tokens": 3},
        },
        roots,
    )
    events: list[object] = []
    outcome = run_job(spec, output_dir=tmp_path / "out", report=events.append)
    samples = [e for e in events if getattr(e, "type", None) == "sample"]
    assert [s.prompt for s in samples] == [
        "[red.png] what colour is this image",
        "[green.png] what colour is this image",
    ]  # type: ignore[attr-defined]
    assert all(isinstance(s.text, str) and s.media_type == "image/png" for s in samples)  # type: ignore[attr-defined]
    assert all((tmp_path / "out" / s.artifact_path).is_file() for s in samples)  # type: ignore[attr-defined]
    files = {p.name for p in Path(outcome.checkpoint).iterdir()}  # type: ignore[arg-type]
    assert {"adapter_model.safetensors", "preprocessor_config.json", "chat_template.jinja", "tokenizer.json"} <= files
    config = json.loads((Path(outcome.checkpoint) / "adapter_config.json").read_text())  # type: ignore[arg-type]
    assert all("visual" not in name for name in config["target_modules"])


def test_train_vision_tower_trains_it_beside_the_adapter(models: Path) -> None:
    spec = HFImageTextToTextSpec(kind="hf_image_text_to_text", path=models / "idefics", dtype="float32",
                                 train_vision_tower=True)  # fmt: skip
    model = FAMILY.apply_lora(FAMILY.build(spec, 0), LoraSpec(target_modules=["q_proj"], rank=2))  # type: ignore[misc]
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("vision_model" in n for n in trained) and any("lora_" in n for n in trained)
    assert FAMILY.whole_units(model) == ()  # type: ignore[misc]  # a trained tower streams as ordinary units
    frozen = FAMILY.build(spec.model_copy(update={"train_vision_tower": False}), 0)
    assert not any(p.requires_grad for n, p in frozen.named_parameters() if "vision_model" in n)


def test_a_tiny_model_learns_to_name_the_colour_it_is_shown(models: Path, colours: Path) -> None:
    spec, text, batches = _setup(models / "qwen", colours, 4)
    torch.manual_seed(0)
    model = FAMILY.build(spec, 0)  # full fine-tune of the language model; the vision tower stays frozen
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for step in range(40):
        loss = FAMILY.loss(model, batches.batch(step))  # type: ignore[attr-defined]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    named = {}
    with torch.no_grad():
        for row in batches.rows:  # type: ignore[attr-defined]
            batch = batches.collate([row])  # type: ignore[attr-defined]
            answer = int((batch["labels"][0] != -100).nonzero()[0])
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            guess = text.tokenizer.decode([int(logits[0, answer - 1].argmax())])
            named[text.tokenizer.decode([batch["input_ids"][0, answer]])] = guess
    assert named == {colour: colour for colour in named} and len(named) == len(COLOURS), named


def test_a_full_fine_tune_loads_with_the_auto_classes_and_resumes(tmp_path: Path, models: Path, colours: Path) -> None:
    from transformers import AutoModelForImageTextToText

    roots = PathRoots(model_roots=[models], data_roots=[colours.parent])
    job = {
        "name": "vlm-full",
        "device": "cpu",
        "model": {"kind": "hf_image_text_to_text", "path": "idefics", "dtype": "float32"},
        "data": {"kind": "image_chat", "path": "train.jsonl", "seq_len": 128},
        "training": {"steps": 2, "batch_size": 2, "learning_rate": 1e-3, "gradient_checkpointing": True},
        "offload": {"enable_model_cpu_offload": True, "enable_optimizer_cpu_offload": True, "granularity": "block"},
    }
    first = run_job(spec_from(job, roots), output_dir=tmp_path / "out")
    checkpoint = Path(first.checkpoint)  # type: ignore[arg-type]
    loaded = AutoModelForImageTextToText.from_pretrained(str(checkpoint))
    assert load_processor(checkpoint).image_token == "<image>"
    base = AutoModelForImageTextToText.from_pretrained(str(models / "idefics"))
    changed = lambda name: not torch.equal(loaded.state_dict()[name], base.state_dict()[name])  # noqa: E731
    names = list(base.state_dict())
    assert any(changed(n) for n in names if "text_model" in n)
    assert not any(changed(n) for n in names if "vision_model" in n)  # the tower stayed frozen
    events: list[object] = []
    resumed = run_job(spec_from({**job, "training": {**job["training"], "steps": 3}}, roots),
                      output_dir=tmp_path / "out", report=events.append)  # fmt: skip
    started = next(e for e in events if getattr(e, "type", None) == "started")
    assert resumed.step == 3 and started.resumed_from_step == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("arch", list(TINY_VLMS))
def test_the_chunked_loss_equals_the_models_own(
    models: Path, colours: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jobs.recompute.chunked_loss as chunked_loss

    spec, _, batches = _setup(models / arch, colours, 2)
    model = FAMILY.build(spec, 0)
    batch = batches.batch(0)  # type: ignore[attr-defined]
    whole = model(**batch).loss
    monkeypatch.setattr(chunked_loss, "CHUNK_ABOVE_BYTES", 0)  # every batch's logits count as large
    monkeypatch.setattr(chunked_loss, "CHUNK_BYTES", 4 * 300 * 8)  # 8 positions a chunk
    calls = []
    real = chunked_loss.chunked_nll
    monkeypatch.setattr(chunked_loss, "chunked_nll", lambda *a: calls.append(1) or real(*a))
    torch.testing.assert_close(FAMILY.loss(model, batch), whole)
    assert calls  # the chunked path ran
