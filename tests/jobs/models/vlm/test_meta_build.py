"""Vision-language models built on the meta device under model offload, their weights filled into the engine's
pinned copies: a ``save_pretrained`` checkpoint (one file or shards, keys renamed as transformers 5 renames them)
gives exactly what ``from_pretrained`` gives; an offloaded LoRA job trains as the in-memory build does; ``init:
random`` never runs transformers' CPU init; names transformers' renamings cannot place load whole, with a warning.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from jobs import PathRoots, run_job
from jobs.events import StartedEvent, StepEvent
from jobs.fit.disk_tier import loads_into_pinned_memory
from jobs.models.lora import adapters_stay_on_the_cpu
from jobs.models.vlm.batches import build_image_chat_data
from jobs.models.vlm.family import FAMILY
from jobs.models.vlm.processor import ProcessorText, load_processor
from jobs.models.vlm.spec import HFImageTextToTextSpec, ImageChatDataSpec
from jobs.spec.job import LoraSpec
from jobs.spec.preflight import preflight_problems
from offload import OffloadOptions, OffloadTrainingManager
from tests.jobs.helpers import spec_from
from tests.jobs.models.test_weight_sources import assert_bitwise_equal, through_the_engine
from tests.jobs.vlm_helpers import (
    TINY_VLMS,
    save_tiny_qwen2_5_vl,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_vlms: Path) -> Path:
    from transformers import AutoModelForImageTextToText

    root = tmp_path_factory.mktemp("models")
    for name in TINY_VLMS:
        shutil.copytree(tiny_vlms / name, root / name)
        sharded = root / f"{name}-sharded"  # the same weights in several shards with an index, processor beside
        shutil.copytree(root / name, sharded)
        (sharded / "model.safetensors").unlink()
        AutoModelForImageTextToText.from_pretrained(root / name).save_pretrained(sharded, max_shard_size="100KB")
    save_tiny_qwen2_5_vl(root / "qwen-tied", tie_word_embeddings=True)  # no lm_head stored: it is the embedding
    return root


def _spec(path: Path, **fields: object) -> HFImageTextToTextSpec:
    return HFImageTextToTextSpec(kind="hf_image_text_to_text", path=path, dtype="float32", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["qwen", "qwen-sharded", "qwen-tied", "idefics", "idefics-sharded"])
def test_the_meta_build_holds_exactly_what_from_pretrained_gives(models: Path, name: str) -> None:
    from transformers import AutoModelForImageTextToText

    if name.endswith("sharded"):
        assert len(list((models / name).glob("model-*.safetensors"))) > 1
    stored = {k for f in (models / name).glob("*.safetensors") for k in load_file(str(f))}
    ordinary = AutoModelForImageTextToText.from_pretrained(models / name, dtype=torch.float32)
    if name.startswith("qwen"):  # transformers 5 renames Qwen2.5-VL's stored keys as it loads them
        assert "model.layers.0.mlp.up_proj.weight" in stored and "visual.merger.ln_q.weight" in stored
        assert {"model.language_model.layers.0.mlp.up_proj.weight", "model.visual.merger.ln_q.weight"} <= set(
            ordinary.state_dict()
        )
    assert FAMILY.build_on_meta is not None and FAMILY.checkpoint_problems is not None
    assert FAMILY.checkpoint_problems(_spec(models / name)) == []
    model, source = FAMILY.build_on_meta(_spec(models / name), 0, torch.device("cpu"))
    assert source.kind == "safetensors" and all(p.is_meta for p in model.parameters())
    if name == "qwen-tied":
        assert "lm_head.weight" not in stored
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # one pinned copy
    assert_bitwise_equal(through_the_engine(model, source), ordinary.state_dict())
    buffers = dict(ordinary.named_buffers())  # the rotary frequencies, not in the state dict: built, not loaded
    assert buffers.keys() == dict(model.named_buffers()).keys()
    assert all(torch.equal(buffer, buffers[n]) for n, buffer in model.named_buffers())


def _resave(source: Path, target: Path, change: dict[str, str | None]) -> Path:
    """``source``'s model with stored tensors renamed (``old: new``) or dropped (``old: None``)."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    for old, new in change.items():
        value = tensors.pop(old)
        if new is not None:
            tensors[new] = value
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_names_the_renamings_cannot_place_load_whole_with_a_warning(
    tmp_path: Path, models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    renamed = _resave(models / "qwen", tmp_path / "renamed", {"model.norm.weight": "model.final_norm.weight"})
    spec = _spec(renamed)
    assert FAMILY.build_on_meta is not None and FAMILY.checkpoint_problems is not None
    assert FAMILY.checkpoint_problems(spec) == []  # from_pretrained decides, as the in-memory build did
    with caplog.at_level(logging.WARNING):
        model, source = FAMILY.build_on_meta(spec, 0, torch.device("cpu"))
    assert source.kind == "from_pretrained"
    assert any("model.final_norm.weight" in r.getMessage() and "whole" in r.getMessage() for r in caplog.records)
    assert_bitwise_equal(through_the_engine(model, source), FAMILY.build(spec, 0).state_dict())


def test_a_checkpoint_lacking_a_tensor_is_refused_at_submit_and_at_load(
    tmp_path: Path, models: Path, colours: Path
) -> None:
    spec = _spec(_resave(models / "qwen", tmp_path / "truncated", {"lm_head.weight": None}))
    assert FAMILY.build_on_meta is not None and FAMILY.checkpoint_problems is not None
    problems = FAMILY.checkpoint_problems(spec)
    assert [p[0] for p in problems] == ["lm_head.weight"] and "does not have it" in problems[0][2]
    with pytest.raises(ValueError, match="lm_head.weight"):
        FAMILY.build_on_meta(spec, 0, torch.device("cpu"))
    roots = PathRoots(model_roots=[tmp_path], data_roots=[colours.parent])
    submitted = preflight_problems(_job(roots, {"path": "truncated"}, offload=True), roots)  # type: ignore[arg-type]
    assert any(p.path == "model.path" and "'lm_head.weight'" in p.message for p in submitted), submitted


@pytest.mark.parametrize(
    ("tower", "saved", "offload", "on_meta"),
    [(False, [], True, True), (True, [], True, False), (False, ["lm_head"], True, False), (False, [], False, False)],
)
def test_lora_jobs_build_on_meta_unless_peft_copies_a_module_to_train_in_full(
    models: Path, colours: Path, tower: bool, saved: list[str], offload: bool, on_meta: bool
) -> None:
    roots = PathRoots(model_roots=[models], data_roots=[colours.parent])
    job = _job(roots, {"path": "qwen", "train_vision_tower": tower}, offload=offload)
    job = job.model_copy(update={"lora": job.lora.model_copy(update={"modules_to_save": saved})})  # type: ignore[attr-defined]
    assert loads_into_pinned_memory(job, FAMILY) is on_meta  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", list(TINY_VLMS))
def test_lora_gradients_through_the_pinned_copies_equal_the_in_memory_builds(
    models: Path, colours: Path, arch: str
) -> None:
    assert FAMILY.apply_lora is not None and FAMILY.build_on_meta is not None and FAMILY.whole_units is not None
    spec = _spec(models / f"{arch}-sharded")
    text = ProcessorText(load_processor(spec.path))
    batch = build_image_chat_data(ImageChatDataSpec(kind="image_chat", path=colours), 2, 0, text).batch(0)  # type: ignore[attr-defined]
    lora = LoraSpec(target_modules=["q_proj", "v_proj"], rank=4, init_lora_weights="gaussian")
    resident = FAMILY.apply_lora(FAMILY.build(spec, 0), lora)
    FAMILY.loss(resident, batch).backward()
    meta, source = FAMILY.build_on_meta(spec, 0, torch.device("cpu"))
    with adapters_stay_on_the_cpu(meta):  # as jobs/train/session.py applies a family's own LoRA
        offloaded = FAMILY.apply_lora(meta, lora)
    options = OffloadOptions(granularity="block", whole_units=FAMILY.whole_units(offloaded))
    manager = OffloadTrainingManager(offloaded, torch.device("cpu"), options=options, initialize=source.fill)
    source.finish()
    loss = FAMILY.loss(offloaded, batch)
    loss.backward()
    manager.after_backward()
    trained = {n: p for n, p in resident.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    torch.testing.assert_close(loss, FAMILY.loss(resident, batch), rtol=1e-5, atol=1e-7)
    for name, param in offloaded.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.data, trained[name].data, msg=name)  # the same adapters drawn
            torch.testing.assert_close(param.grad, trained[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    manager.remove()


def _job(roots: PathRoots, model: dict[str, object], offload: bool) -> object:
    return spec_from(
        {
            "name": "vlm-meta",
            "device": "cpu",
            "model": {"kind": "hf_image_text_to_text", "dtype": "float32", **model},
            "data": {"kind": "image_chat", "path": "train.jsonl", "seq_len": 128},
            "lora": {"target_modules": ["q_proj", "v_proj"], "rank": 4, "init_lora_weights": "gaussian"},
            "training": {"steps": 3, "batch_size": 2, "learning_rate": 1e-2},
            "offload": {"enable_model_cpu_offload": offload, "granularity": "block"},
        },
        roots,
    )


def _run(spec: object, output: Path) -> tuple[StartedEvent, list[float]]:
    events: list[object] = []
    run_job(spec, output_dir=output, report=events.append)  # type: ignore[arg-type]
    started = next(e for e in events if isinstance(e, StartedEvent))
    return started, [e.loss for e in events if isinstance(e, StepEvent)]


def test_an_offloaded_lora_job_loads_into_pinned_memory_and_trains_as_the_in_memory_build(
    tmp_path: Path, models: Path, colours: Path
) -> None:
    roots = PathRoots(model_roots=[models], data_roots=[colours.parent])
    meta_started, meta_losses = _run(_job(roots, {"path": "qwen-sharded"}, offload=True), tmp_path / "meta")
    memory_started, memory_losses = _run(_job(roots, {"path": "qwen-sharded"}, offload=False), tmp_path / "memory")
    assert meta_started.load is not None and meta_started.load.source == "safetensors"
    assert memory_started.load is not None and memory_started.load.source == "in_memory"
    assert len(meta_losses) == 3 and meta_losses[0] != meta_losses[-1]
    assert meta_losses == pytest.approx(memory_losses, rel=1e-5)


def test_init_random_under_offload_never_runs_transformers_init_and_trains(
    tmp_path: Path, models: Path, colours: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import PreTrainedModel

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("transformers' weight init ran on the CPU")

    monkeypatch.setattr(PreTrainedModel, "_init_weights", refuse)
    monkeypatch.setattr(PreTrainedModel, "_initialize_weights", refuse)
    roots = PathRoots(model_roots=[models], data_roots=[colours.parent])
    started, losses = _run(_job(roots, {"path": "qwen", "init": "random"}, offload=True), tmp_path / "out")
    assert started.load is not None and started.load.source == "random"
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(loss)) for loss in losses)


def test_init_random_draws_seeded_matrices_and_sets_every_norm_weight_to_one(models: Path) -> None:
    assert FAMILY.build_on_meta is not None
    spec = _spec(models / "qwen", init="random")

    def load(seed: int) -> dict[str, torch.Tensor]:
        model, source = FAMILY.build_on_meta(spec, seed, torch.device("cpu"))  # type: ignore[misc]
        assert source.kind == "random"
        return through_the_engine(model, source)

    first, again, other = load(1), load(1), load(2)
    assert_bitwise_equal(first, again)
    weight = "model.language_model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(first[weight], other[weight])
    # Qwen2.5-VL's vision merger names its RMSNorm ln_q: zero, it would blank every image feature.
    assert torch.all(first["model.visual.merger.ln_q.weight"] == 1)
    assert torch.all(first["model.language_model.norm.weight"] == 1)


def test_init_random_in_memory_never_runs_transformers_init_and_draws_the_meta_builds_values(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On an H100 box the resident 7B VLM bench spent its whole 150 s in transformers' CPU init, never reaching a step.
    from transformers import PreTrainedModel

    from jobs.models.vlm.model import build_image_text_model

    assert FAMILY.build_on_meta is not None
    spec = _spec(models / "qwen", init="random")
    meta, source = FAMILY.build_on_meta(spec, 3, torch.device("cpu"))  # type: ignore[misc]
    drawn = through_the_engine(meta, source)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("transformers' weight init ran on the CPU")

    monkeypatch.setattr(PreTrainedModel, "_init_weights", refuse)
    monkeypatch.setattr(PreTrainedModel, "_initialize_weights", refuse)
    model = build_image_text_model(spec, 3)
    built = dict(model.named_parameters())
    shared = [name for name in drawn if name in built]
    assert len(shared) == len(built)  # every parameter compared
    assert_bitwise_equal({n: built[n].detach() for n in shared}, {n: drawn[n] for n in shared})
