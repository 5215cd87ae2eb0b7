"""Checkpoint routes never answer 500: a file gone from the disk is a 404 in the usual shape, one deleted
mid-download still arrives whole, a manifest of the wrong shape marks only its checkpoint damaged, and a
whole checkpoint downloads as one tar whose SHA-256 the headers give."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import service.api.routes.checkpoints as routes
from jobs.checkpoints.directory import save_checkpoint
from service.api.app import create_app
from service.checking.check import InlineSpecChecker
from service.queue.status import JobStatus
from service.queue.store import JobStore
from service.settings import Settings
from tests.service.checking.test_one_parse import IdleExecutor

JOB = "job-ckpt"
BASE = f"/v1/jobs/{JOB}/checkpoints"
WEIGHTS = bytes(range(256)) * 40


def write(directory: Path) -> None:
    (directory / "model.safetensors").write_bytes(WEIGHTS)
    (directory / "training_state.pt").write_bytes(b"state")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = Settings(data_dir=tmp_path, devices="cpu", _env_file=None)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = JobStore(settings.db_path)
    store.create_job(job_id=JOB, name=None, spec_text="name: x", spec={})
    store.transition(JOB, JobStatus.CANCELLED, reason="cancelled by user")  # nothing for the scheduler to run
    store.close()
    for step in (1, 2, 3):
        save_checkpoint(settings.job_dir(JOB) / "output", step, {}, write)
    return settings


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings, executor=IdleExecutor(), spec_checker=InlineSpecChecker())
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def checkpoint_dir(settings: Settings, step: int) -> Path:
    return settings.job_dir(JOB) / "output" / "checkpoints" / f"step-{step:08d}"


def error(response: Any) -> tuple[int, str, str]:
    return response.status_code, response.json()["error"]["code"], response.json()["error"]["message"]


def test_a_listed_file_gone_from_the_disk_is_a_404(client: TestClient, settings: Settings) -> None:
    (checkpoint_dir(settings, 2) / "model.safetensors").unlink()  # keep_last's prune racing the download
    gone = "is listed but no longer on disk: pruned by checkpoint.keep_last, or deleted; list the checkpoints again."
    for method in ("GET", "HEAD"):
        answer = client.request(method, f"{BASE}/step-00000002/files/model.safetensors")
        assert answer.status_code == 404
    assert error(client.get(f"{BASE}/step-00000002/files/model.safetensors")) == (
        404,
        "not_found",
        f"File 'model.safetensors' of checkpoint 'step-00000002' of job {JOB} {gone}",
    )
    assert error(client.get(f"{BASE}/step-00000002/archive")) == (
        404,
        "not_found",
        f"A file of checkpoint 'step-00000002' of job {JOB} {gone}",
    )
    assert error(client.post(f"{BASE}/step-00000002/merge")) == (
        404,
        "not_found",
        f"A file of checkpoint 'step-00000002' of job {JOB} {gone}",
    )


def test_a_file_deleted_after_it_was_opened_still_arrives_whole(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = routes._open

    def open_then_delete(path: Path, what: str) -> Any:
        handle = opened(path, what)
        path.unlink()  # between the route and the body: the headers are not sent yet
        return handle

    monkeypatch.setattr(routes, "_open", open_then_delete)
    answer = client.get(f"{BASE}/step-00000003/files/model.safetensors")
    assert answer.status_code == 200 and answer.content == WEIGHTS
    assert answer.headers["x-checksum-sha256"] == hashlib.sha256(WEIGHTS).hexdigest()
    assert answer.headers["content-length"] == str(len(WEIGHTS))


def test_ranges_are_read_from_the_open_file(client: TestClient) -> None:
    answer = client.get(f"{BASE}/step-00000003/files/model.safetensors", headers={"Range": "bytes=256-511"})
    assert answer.status_code == 206 and answer.content == WEIGHTS[256:512]
    assert answer.headers["content-range"] == f"bytes 256-511/{len(WEIGHTS)}"
    head = client.head(f"{BASE}/step-00000003/files/model.safetensors")
    assert head.status_code == 200 and head.headers["content-length"] == str(len(WEIGHTS)) and head.content == b""
    refused = client.get(f"{BASE}/step-00000003/files/model.safetensors", headers={"Range": "bytes=99999-"})
    assert error(refused) == (
        416,
        "range_not_satisfiable",
        f"The Range header 'bytes=99999-' lies outside the file's {len(WEIGHTS)} bytes.",
    )


@pytest.mark.parametrize("manifest", ["{}", "[1, 2]", '{"step": "abc"}'])
def test_a_manifest_of_the_wrong_shape_marks_its_checkpoint_damaged_and_spares_the_others(
    client: TestClient, settings: Settings, manifest: str
) -> None:
    (checkpoint_dir(settings, 2) / "manifest.json").write_text(manifest)
    listing = client.get(BASE)
    assert listing.status_code == 200
    entries = listing.json()["data"]
    assert [(c["name"], c["damaged"] is not None) for c in entries] == [
        ("step-00000001", False),
        ("step-00000002", True),
        ("step-00000003", False),
    ]
    damaged = entries[1]
    assert (
        damaged["step"] == 2 and damaged["files"] == [] and damaged["damaged"].startswith("manifest.json is damaged: ")
    )
    for route in ("files/model.safetensors", "archive"):
        assert error(client.get(f"{BASE}/step-00000002/{route}")) == (
            409,
            "checkpoint_damaged",
            f"Checkpoint 'step-00000002' of job {JOB} is damaged: {damaged['damaged']}",
        )
    assert client.post(f"{BASE}/step-00000002/merge").status_code == 409
    assert client.get(f"{BASE}/step-00000003/files/training_state.pt").content == b"state"


def test_a_whole_checkpoint_downloads_as_one_tar_with_its_sha256(client: TestClient, settings: Settings) -> None:
    answer = client.get(f"{BASE}/step-00000003/archive")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/x-tar"
    assert answer.headers["content-disposition"] == 'attachment; filename="step-00000003.tar"'
    assert answer.headers["content-length"] == str(len(answer.content))
    assert answer.headers["x-checksum-sha256"] == hashlib.sha256(answer.content).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(answer.content)) as tar:
        assert tar.getnames() == [
            "step-00000003/manifest.json",
            "step-00000003/model.safetensors",
            "step-00000003/training_state.pt",
        ]
        manifest = json.load(tar.extractfile("step-00000003/manifest.json"))  # type: ignore[arg-type]
        assert tar.extractfile("step-00000003/model.safetensors").read() == WEIGHTS  # type: ignore[union-attr]
    assert manifest == json.loads((checkpoint_dir(settings, 3) / "manifest.json").read_text())
    again = client.get(f"{BASE}/step-00000003/archive")  # the digest from the cache, the same bytes
    assert again.content == answer.content and again.headers["x-checksum-sha256"] == answer.headers["x-checksum-sha256"]


def test_an_unknown_checkpoint_archive_is_a_404(client: TestClient) -> None:
    assert error(client.get(f"{BASE}/step-00000009/archive")) == (
        404,
        "not_found",
        f"Job {JOB} has no checkpoint 'step-00000009'; GET /v1/jobs/{JOB}/checkpoints lists them.",
    )


def test_a_checkpoint_exports_to_gguf_with_its_modelfile(client: TestClient, settings: Settings) -> None:
    from tests.jobs.llm_helpers import save_bpe_tokenizer, save_llama

    def full_model(directory: Path) -> None:  # a full fine-tune's checkpoint: a whole Hugging Face model
        save_llama(directory)
        save_bpe_tokenizer(directory)

    save_checkpoint(settings.job_dir(JOB) / "output", 4, {}, full_model)
    url = f"{BASE}/step-00000004/gguf"
    assert error(client.get(url, params={"quant": "q8_0"})) == (
        404,
        "not_found",
        f"Checkpoint 'step-00000004' of job {JOB} has no q8_0 GGUF file; POST {url}?quant=q8_0 first.",
    )
    made = client.post(url, params={"quant": "Q8_0"})
    assert made.status_code == 200, made.text
    body = made.json()
    assert body["quant"] == "q8_0" and body["gguf"]["name"] == "step-00000004-q8_0.gguf"
    download = client.get(body["gguf"]["url"])
    assert download.status_code == 200 and download.content[:4] == b"GGUF"
    assert (
        hashlib.sha256(download.content).hexdigest() == body["gguf"]["sha256"] == download.headers["x-checksum-sha256"]
    )
    modelfile = client.get(body["modelfile"]["url"])
    assert modelfile.status_code == 200 and "FROM ./step-00000004-q8_0.gguf\n" in modelfile.text
    assert client.post(url, params={"quant": "q8_0"}).json() == body  # made once


def test_gguf_export_refusals_are_4xx_naming_the_fix(client: TestClient, settings: Settings) -> None:
    url = f"{BASE}/step-00000003/gguf"
    for answer in (client.post(url, params={"quant": "q5_k_m"}), client.get(url, params={"quant": "q5_k_m"})):
        status, code, message = error(answer)
        assert (status, code) == (422, "bad_quant") and "llama-quantize model-f16.gguf" in message
    assert error(client.post(url, params={"quant": "../x"}))[:2] == (422, "bad_quant")
    status, code, message = error(client.post(url))  # weights without config.json: not a model to export
    assert (status, code) == (422, "not_exportable") and "no readable config.json" in message
    exports = settings.job_dir(JOB) / "output" / "exports"
    assert not exports.exists() or not any(exports.iterdir())  # nothing partial left behind
    assert error(client.post(f"{BASE}/step-00000099/gguf"))[0] == 404


def test_a_diverged_checkpoint_is_refused_by_every_export_with_nothing_left(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    from tests.jobs.llm_helpers import save_bpe_tokenizer, save_llama

    model = save_llama(tmp_path / "llama")
    save_bpe_tokenizer(model)  # a whole model with its tokenizer: exportable but for the NaN
    weights = load_file(str(model / "model.safetensors"))
    name = sorted(weights)[3]
    weights[name][0, 0] = float("nan")  # one weight a diverged step made NaN

    def diverged(directory: Path) -> None:
        save_file(weights, str(directory / "model.safetensors"))
        for file in model.iterdir():
            if file.suffix != ".safetensors":
                (directory / file.name).write_bytes(file.read_bytes())

    save_checkpoint(settings.job_dir(JOB) / "output", 4, {}, diverged)
    status, code, message = error(client.post(f"{BASE}/step-00000004/gguf", params={"quant": "q8_0"}))
    assert (status, code) == (422, "not_exportable")
    assert f"({name} in model.safetensors holds NaN or infinity: the run diverged); export an earlier" in message
    exports = settings.job_dir(JOB) / "output" / "exports"
    assert not exports.exists() or not any(exports.iterdir())  # nothing partial left behind
    assert error(client.get(f"{BASE}/step-00000004/gguf", params={"quant": "q8_0"}))[0] == 404
    listed = {c["name"]: c for c in client.get(BASE).json()["data"]}
    assert listed["step-00000004"]["exports"] == []


@pytest.mark.parametrize(
    ("kind", "adapter", "mergeable"),
    [("hf_causal_lm", True, True), ("transformer_lm", True, False), ("hf_causal_lm", False, False)],
)
def test_a_checkpoint_is_marked_mergeable_only_when_a_merge_works(
    tmp_path: Path, kind: str, adapter: bool, mergeable: bool
) -> None:
    """The dashboard shows Merge where ``mergeable`` is true: a LoRA adapter of a family that merges. Any
    other (a transformer_lm adapter, a full fine-tune) answers the merge with an error, so it is not offered."""
    settings = Settings(data_dir=tmp_path, devices="cpu", _env_file=None)
    store = JobStore(settings.db_path)
    store.create_job(job_id=JOB, name=None, spec_text="name: x", spec={"model": {"kind": kind}})
    store.transition(JOB, JobStatus.CANCELLED, reason="cancelled by user")
    store.close()

    def files(directory: Path) -> None:
        write(directory)
        if adapter:
            (directory / "adapter_config.json").write_text("{}")

    save_checkpoint(settings.job_dir(JOB) / "output", 1, {}, files)
    app = create_app(settings, executor=IdleExecutor(), spec_checker=InlineSpecChecker())
    with TestClient(app, raise_server_exceptions=False) as client:
        (listed,) = client.get(BASE).json()["data"]
    assert listed["mergeable"] is mergeable
