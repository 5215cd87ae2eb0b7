"""Uploads under attack and faults: read and checked in bounded memory, never a 500 for a hostile row, one JSONL
reader for the upload check and the job, downloads that never break or end short, ``Range`` errors in the
envelope (docs/reliability.md, "Uploads and files")."""

from __future__ import annotations

import hashlib
import json
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import service.api.routes.files as routes
from jobs.data.records import iter_records
from service.api.app import create_app
from service.checking.check import InlineSpecChecker
from service.settings import Settings
from service.uploads.receive import remove_upload
from service.uploads.rows import RowProblem, check_fine_tuning_rows
from tests.jobs.llm_helpers import chat_record
from tests.service.checking.test_one_parse import IdleExecutor

CHATS = "".join(json.dumps(chat_record(i)) + "\n" for i in range(8)).encode()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", devices="cpu", max_upload_line_bytes=4096, _env_file=None)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:  # rows up to 2 KiB a line
    app = create_app(settings, executor=IdleExecutor(), spec_checker=InlineSpecChecker())
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def upload(client: TestClient, body: bytes, name: str = "train.jsonl", purpose: str = "fine-tune") -> Any:
    return client.post("/v1/files", files={"file": (name, body)}, data={"purpose": purpose})


def error(response: Any) -> tuple[int, str, str]:
    return response.status_code, response.json()["error"]["code"], response.json()["error"]["message"]


def test_a_json_array_on_one_line_is_checked_in_memory_bounded_by_the_line_limit(tmp_path: Path) -> None:
    """The check reads at most the line limit of a line: its peak stays near the limit, not ~12x the file."""
    array = tmp_path / "export.jsonl"
    array.write_text(json.dumps([chat_record(i) for i in range(200)] * 300))  # a .json array export, ~16 MB
    assert array.stat().st_size > 14 << 20
    limit = 4 << 20  # the default of FERRY_MAX_UPLOAD_LINE_BYTES (Settings.max_upload_line_bytes)
    tracemalloc.start()
    try:
        with pytest.raises(RowProblem) as refused:
            check_fine_tuning_rows(array)  # before the limit: a peak of ~103 MiB (7x the file) under tracemalloc
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * limit, f"the check of a {array.stat().st_size} byte line peaked at {peak} bytes"
    assert refused.value.row == 1
    assert "FERRY_MAX_UPLOAD_LINE_BYTES" in str(refused.value) and "jq -c '.[]'" in str(refused.value)


def test_a_line_past_the_limit_is_a_422_that_says_how_to_convert(client: TestClient) -> None:
    array = json.dumps([chat_record(i) for i in range(60)]).encode()  # one line, past the 4096 byte limit
    refused = upload(client, array, name="train.json")
    assert error(refused) == (
        422,
        "invalid_file",
        "train.json row 1: the row: is longer than 4.0 KiB (FERRY_MAX_UPLOAD_LINE_BYTES); a fine-tuning file is "
        "JSON Lines, one row per line. A .json array converts with: jq -c '.[]' train.json > train.jsonl; "
        "for rows this long, raise FERRY_MAX_UPLOAD_LINE_BYTES",
    )
    accepted = upload(client, CHATS)  # the same rows, one per line, each under the limit
    assert accepted.status_code == 201 and accepted.json()["rows"] == 8


def test_a_row_nested_100000_deep_is_a_422_not_a_500(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", devices="cpu", _env_file=None)  # the default 4 MiB a line
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    app = create_app(settings, executor=IdleExecutor(), spec_checker=InlineSpecChecker())
    with TestClient(app, raise_server_exceptions=False) as client:
        refused = upload(client, CHATS + deep)
        assert error(refused) == (
            422,
            "invalid_file",
            "train.jsonl row 9: the row: nests objects or lists deeper than 128 levels; flatten the row",
        )
        shallow = b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}\n"  # parses, but past the reader's depth
        assert error(upload(client, shallow))[2] == (
            "train.jsonl row 1: the row: nests objects or lists deeper than 128 levels; flatten the row"
        )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], '
            b'"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}',
            "has the key 'messages' twice in one object; keep one of them (JSON keeps only the last)",
        ),
        (b'{"messages": ' + b"[" * 900 + b"]" * 900 + b"}", "nests objects or lists deeper than 128 levels"),
    ],
    ids=["duplicate-key", "deep"],
)
def test_the_upload_check_and_the_job_reader_refuse_a_row_alike(
    client: TestClient, tmp_path: Path, line: bytes, message: str
) -> None:
    """One reader: a row the upload check refuses is refused by the job's reader in the same words, never read
    otherwise (datasets used to split a row with a key twice into two rows of the wrong shape)."""
    body = CHATS + line + b"\n"
    refused = upload(client, body)
    assert refused.status_code == 422 and message in refused.json()["error"]["message"]
    assert refused.json()["error"]["problems"][0]["line"] == 9
    data = tmp_path / "train.jsonl"
    data.write_bytes(body)
    with pytest.raises(ValueError, match="line 9: ") as job_refused:
        list(iter_records(data))
    assert message in str(job_refused.value)


def test_the_job_reader_reads_what_the_upload_check_accepts(client: TestClient, tmp_path: Path) -> None:
    body = b"\xef\xbb\xbf" + CHATS.replace(b"\n", b"\n\n", 1)  # a BOM and a blank line
    accepted = upload(client, body)
    assert accepted.status_code == 201 and accepted.json()["rows"] == 8
    data = tmp_path / "train.jsonl"
    data.write_bytes(body)
    records = list(iter_records(data))
    assert [r.fields for r in records] == [chat_record(i) for i in range(8)]
    assert [r.row for r in records] == [1, *range(3, 10)]  # the line, as the upload check names it


def test_a_download_whose_bytes_are_gone_is_a_404(client: TestClient, settings: Settings) -> None:
    file_id = upload(client, CHATS).json()["id"]
    remove_upload(settings.uploads_dir, file_id)  # the record stays; the bytes were removed by hand
    gone = client.get(f"/v1/files/{file_id}/content")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    assert "its bytes are no longer on disk" in gone.json()["error"]["message"]


def test_a_download_deleted_after_its_lookup_is_a_404(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DELETE that lands between the download's lookup and its read: a 404, not a 500 or a broken body."""
    file_id = upload(client, CHATS).json()["id"]
    found = routes._found

    def found_then_deleted(files: Any, wanted: str) -> Any:
        record = found(files, wanted)
        assert client.delete(f"/v1/files/{wanted}").status_code == 200
        return record

    monkeypatch.setattr(routes, "_found", found_then_deleted)
    answer = client.get(f"/v1/files/{file_id}/content")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


def test_a_download_deleted_while_it_streams_arrives_whole(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    file_id = upload(client, CHATS).json()["id"]
    opened = routes._open

    def open_then_delete(path: Path, wanted: str) -> Any:
        handle = opened(path, wanted)
        remove_upload(settings.uploads_dir, wanted)  # what DELETE does once the record is gone
        return handle

    monkeypatch.setattr(routes, "_open", open_then_delete)
    answer = client.get(f"/v1/files/{file_id}/content")
    assert answer.status_code == 200 and answer.content == CHATS
    assert answer.headers["content-length"] == str(len(CHATS))
    assert answer.headers["x-checksum-sha256"] == hashlib.sha256(CHATS).hexdigest()


def test_downloads_racing_a_delete_are_whole_or_404(client: TestClient) -> None:
    """Real threads: every answer to a download during a delete is the whole file or a 404."""
    body = CHATS * 2000  # ~1.7 MB: the body takes several reads
    for _ in range(3):
        file_id = upload(client, body, name="big.jsonl", purpose="user_data").json()["id"]
        answers: list[tuple[int, bytes]] = []
        start = threading.Barrier(5)

        def download(file_id: str = file_id, start: Any = start, answers: list = answers) -> None:
            start.wait()
            for _ in range(5):
                answer = client.get(f"/v1/files/{file_id}/content")
                answers.append((answer.status_code, answer.content))

        threads = [threading.Thread(target=download) for _ in range(4)]
        for thread in threads:
            thread.start()
        start.wait()
        assert client.delete(f"/v1/files/{file_id}").status_code == 200
        for thread in threads:
            thread.join()
        assert len(answers) == 20
        for status_code, content in answers:
            assert (status_code, content == body) == (200, True) or status_code == 404, (status_code, len(content))


def test_range_errors_answer_in_the_json_envelope(client: TestClient) -> None:
    file_id = upload(client, CHATS).json()["id"]
    part = client.get(f"/v1/files/{file_id}/content", headers={"Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == CHATS[10:20]
    outside = client.get(f"/v1/files/{file_id}/content", headers={"Range": "bytes=99999-"})
    assert error(outside) == (
        416,
        "range_not_satisfiable",
        f"The Range header 'bytes=99999-' lies outside the file's {len(CHATS)} bytes.",
    )
    assert outside.headers["content-range"] == f"bytes */{len(CHATS)}"
    malformed = client.get(f"/v1/files/{file_id}/content", headers={"Range": "pages=1"})
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "malformed_range"
