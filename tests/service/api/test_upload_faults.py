"""Uploads under real faults: the server killed with SIGKILL mid-upload, and an upload that fills a real small
disk (a tmpfs in a namespace of its own; docs/reliability.md, "Uploads and files")."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import TOKEN, Server
from tests.service.queue import test_full_disk
from tests.service.queue.test_full_disk import TinyDiskServer, namespaces_work


def partial_uploads(data_dir: Path) -> list[Path]:
    """The temporary files of uploads in flight, wherever a version kept them."""
    return sorted(p for p in data_dir.rglob(".upload-*") if p.is_file())


def test_a_kill_mid_upload_leaves_no_file_a_spec_can_name(make_server) -> None:
    server = make_server()
    stalled = threading.Event()

    def body() -> Iterator[bytes]:
        yield b"half of the bytes\n" * 1000
        stalled.wait(30)  # the rest never comes: the server dies first

    def send() -> None:
        with pytest.raises(httpx.HTTPError), server.client() as client:
            client.post("/v1/files", params={"filename": "corpus.txt", "purpose": "user_data"}, content=body())

    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 30
    while not partial_uploads(server.data_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    (partial,) = partial_uploads(server.data_dir)
    server.kill()
    stalled.set()
    sender.join(30)
    assert partial.exists()  # what SIGKILL leaves

    server.start()
    assert partial_uploads(server.data_dir) == []  # removed at start-up
    with server.client() as client:
        for named in (partial.name, str(partial)):
            spec = (
                "name: on-partial\ndevice: cpu\n"
                "model: {kind: transformer_lm, vocab_size: 257, hidden_size: 32, num_layers: 1, num_heads: 2, "
                "max_seq_len: 32}\n"
                f"data: {{kind: text, path: '{named}', seq_len: 32, tokenizer: {{kind: byte}}}}\n"
                "training: {steps: 2, batch_size: 2}\n"
            )
            answer = client.post("/v1/jobs", content=spec, headers={"content-type": "application/yaml"})
            assert answer.status_code == 422, answer.text
            assert client.get("/v1/files").json()["data"] == []


@pytest.fixture
def tiny_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    reason = namespaces_work(tmp_path)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setattr(test_full_disk, "SIZE_MIB", 40)  # the database, the 8 MiB reserve, ~30 MiB for uploads
    server = TinyDiskServer(tmp_path / "data", {"FERRY_API_TOKEN": TOKEN, "FERRY_MIN_FREE_DISK_BYTES": "0"})
    server.start()
    yield server
    server.stop()


def test_an_upload_that_fills_the_disk_is_a_507_with_the_free_space(tiny_disk: Server) -> None:
    with tiny_disk.client() as client:
        big = client.post(
            "/v1/files", params={"filename": "big.bin", "purpose": "user_data"}, content=b"\0" * (48 << 20)
        )
        assert big.status_code == 507, big.text  # before: 500
        error = big.json()["error"]
        assert error["code"] == "insufficient_storage"
        assert "ran out of space after" in error["message"] and " free. Free space on that disk" in error["message"]
        assert client.get("/v1/files").json()["data"] == []
        small = client.post("/v1/files", params={"filename": "a.txt", "purpose": "user_data"}, content=b"a" * 1000)
        assert small.status_code == 201, small.text  # the partial upload was removed: its space is back
