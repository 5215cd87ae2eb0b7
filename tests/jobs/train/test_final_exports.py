"""The spec's ``export:`` section: a tiny Llama LoRA job on the CPU ends with its merged model and a q8_0 GGUF
written from its last checkpoint, reported as ``export`` events and listed by the checkpoint routes; bad
``export:`` sections are refused at submit naming the field."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from jobs import JobSpecError, PathRoots, load_job_spec, run_job
from jobs.events import ExportEvent, JobEvent
from jobs.train.final_exports import write_final_exports
from service.api.app import create_app
from service.checking.check import InlineSpecChecker
from service.queue.status import JobStatus
from service.queue.store import JobStore
from service.settings import Settings
from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, save_llama, write_jsonl
from tests.service.checking.test_one_parse import IdleExecutor

pytest.importorskip("gguf")
JOB = "job-export"


@pytest.fixture
def llm_roots(tmp_path: Path) -> PathRoots:
    models, data = tmp_path / "models", tmp_path / "data"
    save_bpe_tokenizer(models / "tok")
    save_llama(models / "llama")
    write_jsonl(data / "chat.jsonl", [chat_record(i) for i in range(12)])
    return PathRoots(model_roots=[models], data_roots=[data])


def _problems(data: dict[str, Any], roots: PathRoots) -> dict[str, str]:
    with pytest.raises(JobSpecError) as caught:
        load_job_spec(yaml.safe_dump(data), roots)
    return {p.path: p.message for p in caught.value.problems}


def test_a_lora_job_ends_with_its_exports_reported_and_listed(tmp_path: Path, llm_roots: PathRoots) -> None:
    from transformers import AutoModelForCausalLM

    settings = Settings(data_dir=tmp_path / "service", devices="cpu", _env_file=None)
    settings.data_dir.mkdir(parents=True)
    store = JobStore(settings.db_path)
    store.create_job(job_id=JOB, name=None, spec_text="name: x", spec={})
    store.transition(JOB, JobStatus.CANCELLED, reason="cancelled by user")  # nothing for the scheduler to run
    store.close()
    output = settings.job_dir(JOB) / "output"
    events: list[JobEvent] = []
    data = llm_spec(training={"steps": 2}, export={"gguf": {"quant": "Q8_0"}, "merged": True})
    outcome = run_job(load_job_spec(yaml.safe_dump(data), llm_roots), output_dir=output, report=events.append)

    assert outcome.status == "succeeded" and events[-1].type == "finished"
    exported = [e for e in events if isinstance(e, ExportEvent)]
    assert [(e.checkpoint, e.format, e.quant) for e in exported] == [
        ("step-00000002", "merged", None),
        ("step-00000002", "gguf", "q8_0"),
    ]
    names = [f.name for e in exported for f in e.files]
    assert names == [
        "exports/step-00000002-merged.tar",
        "exports/step-00000002-q8_0.gguf",
        "exports/step-00000002-q8_0.Modelfile",
    ]
    for file in (f for e in exported for f in e.files):
        assert hashlib.sha256((output / file.name).read_bytes()).hexdigest() == file.sha256
    merged = AutoModelForCausalLM.from_pretrained(str(output / "exports" / "step-00000002-merged"))
    assert merged.config.model_type == "llama"

    app = create_app(settings, executor=IdleExecutor(), spec_checker=InlineSpecChecker())
    with TestClient(app, raise_server_exceptions=False) as client:
        listed = client.get(f"/v1/jobs/{JOB}/checkpoints").json()["data"]
        exports = {f["name"]: f for f in listed[-1]["exports"]}
        assert sorted(exports) == [
            "step-00000002-merged.tar",
            "step-00000002-q8_0.Modelfile",
            "step-00000002-q8_0.gguf",
        ]
        gguf = client.get(exports["step-00000002-q8_0.gguf"]["url"])
        assert gguf.status_code == 200 and hashlib.sha256(gguf.content).hexdigest() == exported[1].files[0].sha256
        tar = client.get(exports["step-00000002-merged.tar"]["url"])
        assert tar.status_code == 200 and hashlib.sha256(tar.content).hexdigest() == exported[0].files[0].sha256
        modelfile = client.get(exports["step-00000002-q8_0.Modelfile"]["url"])
        assert modelfile.status_code == 200 and "FROM ./step-00000002-q8_0.gguf" in modelfile.text
        # A second POST answers with the file the job already wrote, exporting nothing again.
        again = client.post(f"/v1/jobs/{JOB}/checkpoints/step-00000002/gguf?quant=q8_0").json()
        assert again["gguf"]["sha256"] == exported[1].files[0].sha256

    # The same checkpoint diverged (a NaN in its adapter): each export is refused in an error event naming
    # its field and the fix, and nothing is written.
    from safetensors.torch import load_file, save_file

    shutil.rmtree(output / "exports")
    adapter = output / "checkpoints" / "step-00000002" / "adapter_model.safetensors"
    weights = load_file(str(adapter))
    next(iter(weights.values())).view(-1)[0] = float("inf")
    save_file(weights, str(adapter))
    later: list[JobEvent] = []
    assert write_final_exports(load_job_spec(yaml.safe_dump(data), llm_roots), output, later.append) == []
    assert [(e.type, getattr(e, "level", None)) for e in later] == [("log", "error"), ("log", "error")]
    messages = [getattr(e, "message", "") for e in later]
    assert messages[0].startswith("export.merged not written: checkpoint step-00000002 has weights that are not")
    assert messages[1].startswith("export.gguf not written:") and "export an earlier checkpoint" in messages[1]
    assert not (output / "exports").exists() or not any((output / "exports").iterdir())


def test_bad_export_sections_are_refused_at_submit_naming_the_field(llm_roots: PathRoots) -> None:
    problems = _problems(llm_spec(export={"gguf": {"quant": "q5_k_m"}}), llm_roots)
    assert "llama-quantize" in problems["export.gguf.quant"]
    problems = _problems(llm_spec(export={"gguf": {"quant": "q9"}}), llm_roots)
    assert problems["export.gguf.quant"].endswith("unknown quant 'q9': choose one of f32, f16, bf16, q8_0, q4_k_m")
    problems = _problems(llm_spec(lora=None, export={"merged": True}), llm_roots)
    assert problems["export.merged"].startswith("a full fine-tune's checkpoint is already a whole model")
    problems = _problems(llm_spec(export={"gguf": {}}, checkpoint={"save_final": False}), llm_roots)
    assert problems["export"] == "exports are written from a checkpoint: set checkpoint.save_final: true"
    problems = _problems(llm_spec(export={"onnx": True}), llm_roots)
    assert "export.onnx" in problems


def test_a_family_without_gguf_is_refused(tmp_path: Path) -> None:
    data = {
        "name": "toy",
        "device": "cpu",
        "model": {"kind": "toy_mlp", "hidden_size": 8, "num_layers": 1},
        "data": {"kind": "synthetic_regression"},
        "training": {"steps": 1},
        "export": {"gguf": {"quant": "f16"}},
    }
    problems = _problems(data, PathRoots(model_roots=[tmp_path], data_roots=[tmp_path]))
    assert problems["export.gguf"] == (
        "model kind 'toy_mlp' cannot be exported as gguf (it has none); remove export.gguf"
    )
