"""/v1/files: uploads streamed to disk with their SHA-256, fine-tuning rows checked, a job naming a file by its id,
and a delete refused while a job that has not finished uses it."""

from __future__ import annotations

import hashlib
import json

from tests.jobs.llm_helpers import chat_record
from tests.service.conftest import spec_yaml, submit, wait_status

YAML = {"content-type": "application/yaml"}


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_upload_list_read_download_and_delete(make_server) -> None:
    server = make_server(FERRY_MAX_UPLOAD_BYTES="4096")
    chats = jsonl([chat_record(i) for i in range(4)])
    with server.client() as client:
        answer = client.post("/v1/files", files={"file": ("train.jsonl", chats)}, data={"purpose": "fine-tune"})
        assert answer.status_code == 201, answer.text
        chat = answer.json()
        assert chat["id"].startswith("file-") and chat["object"] == "file"
        assert (chat["filename"], chat["purpose"], chat["bytes"]) == ("train.jsonl", "fine-tune", len(chats))
        assert (chat["sha256"], chat["format"], chat["rows"]) == (hashlib.sha256(chats).hexdigest(), "chat", 4)
        assert (server.data_dir / "uploads" / chat["id"] / "train.jsonl").read_bytes() == chats

        raw = client.post(
            "/v1/files",
            params={"filename": "../notes.txt", "purpose": "user_data"},
            content=b"hello ferry",
            headers={"content-type": "application/octet-stream"},
        )
        assert raw.status_code == 201, raw.text
        notes = raw.json()
        assert (notes["filename"], notes["format"], notes["rows"]) == ("../notes.txt", None, None)
        assert (server.data_dir / "uploads" / notes["id"] / "notes.txt").read_bytes() == b"hello ferry"

        listed = client.get("/v1/files").json()
        assert [f["id"] for f in listed["data"]] == [notes["id"], chat["id"]] and listed["has_more"] is False
        page = client.get("/v1/files", params={"limit": 1}).json()
        assert [f["id"] for f in page["data"]] == [notes["id"]] and page["has_more"] is True
        after = client.get("/v1/files", params={"after": notes["id"]}).json()
        assert [f["id"] for f in after["data"]] == [chat["id"]]
        assert [f["id"] for f in client.get("/v1/files", params={"purpose": "fine-tune"}).json()["data"]] == [
            chat["id"]
        ]
        assert client.get(f"/v1/files/{chat['id']}").json() == chat

        content = client.get(f"/v1/files/{chat['id']}/content")
        assert content.content == chats and content.headers["x-checksum-sha256"] == chat["sha256"]

        deleted = client.delete(f"/v1/files/{notes['id']}")
        assert deleted.json() == {"id": notes["id"], "object": "file", "deleted": True}
        assert not (server.data_dir / "uploads" / notes["id"]).exists()
        missing = client.get(f"/v1/files/{notes['id']}")
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == f"No file with id {notes['id']!r}; GET /v1/files lists them."


def test_bad_rows_too_large_and_wrong_purpose_are_refused(make_server) -> None:
    server = make_server(FERRY_MAX_UPLOAD_BYTES="4096")
    rows = [chat_record(i) for i in range(3)]
    rows[1]["messages"][1]["role"] = "human"
    with server.client() as client:
        bad = client.post("/v1/files", files={"file": ("bad.jsonl", jsonl(rows))}, data={"purpose": "fine-tune"})
        assert bad.status_code == 422
        assert bad.json()["error"] == {
            "code": "invalid_file",
            "message": "bad.jsonl row 2: field 'messages[1].role': must be one of system, user, assistant, tool, "
            "developer; got 'human'",
            "problems": [
                {
                    "path": "messages[1].role",
                    "message": "must be one of system, user, assistant, tool, developer; got 'human'",
                    "line": 2,
                    "suggestion": None,
                }
            ],
        }
        pair = {"input": {"messages": [{"role": "user", "content": "hi"}]}, "preferred_output": "hello"}
        pairs = client.post("/v1/files", files={"file": ("p.jsonl", jsonl([pair]))}, data={"purpose": "fine-tune"})
        assert pairs.status_code == 422
        assert pairs.json()["error"]["message"] == (
            "p.jsonl row 1: field 'preferred_output': must be a non-empty list of {role, content} objects; got 'hello'"
        )
        good_pair = {**pair, "preferred_output": [{"role": "assistant", "content": "hello"}]}
        good_pair["non_preferred_output"] = [{"role": "assistant", "content": "go away"}]
        accepted = client.post("/v1/files", files={"file": ("p", jsonl([good_pair]))}, data={"purpose": "fine-tune"})
        assert accepted.status_code == 201 and accepted.json()["format"] == "preference"

        large = client.post("/v1/files", files={"file": ("big.jsonl", b"x" * 5000)}, data={"purpose": "fine-tune"})
        assert large.status_code == 413
        assert large.json()["error"]["message"] == (
            "The request body is larger than 4096 bytes; send a smaller file or raise FERRY_MAX_UPLOAD_BYTES."
        )
        purpose = client.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "batch"})
        assert purpose.status_code == 422
        assert purpose.json()["error"]["message"] == "purpose must be one of fine-tune, user_data; got 'batch'."
        assert [f["id"] for f in client.get("/v1/files").json()["data"]] == [accepted.json()["id"]]
        left = sorted(p.name for p in (server.data_dir / "uploads").iterdir())
        assert left == [accepted.json()["id"]]  # nothing refused stays on disk


def test_a_spec_names_an_upload_by_id_and_a_delete_waits_for_its_jobs(make_server) -> None:
    server = make_server()
    corpus = b"the quick brown fox jumps over the lazy dog. " * 40
    with server.client() as client:
        upload = client.post("/v1/files", params={"filename": "corpus.txt", "purpose": "user_data"}, content=corpus)
        file_id = upload.json()["id"]
        busy = submit(client, spec_yaml("busy", steps=1_000_000, every=1_000_000))  # holds the one CPU worker
        wait_status(client, busy["id"], "running")
        text_job = (
            "name: on-upload\ndevice: cpu\n"
            "model: {kind: transformer_lm, vocab_size: 257, hidden_size: 32, num_layers: 1, num_heads: 2, max_seq_len: 32}\n"
            f"data: {{kind: text, path: {file_id}, seq_len: 32, tokenizer: {{kind: byte}}}}\n"
            "training: {steps: 2, batch_size: 2}\n"
        )
        queued = submit(client, text_job)
        assert queued["spec"]["data"]["path"] == str((server.data_dir / "uploads" / file_id).resolve())
        refused = client.delete(f"/v1/files/{file_id}")
        assert refused.status_code == 409
        assert refused.json()["error"]["message"] == (
            f"File {file_id} is used by {queued['id']} (queued, running, paused or interrupted); "
            "cancel those jobs or wait for them to finish, then delete it."
        )
        client.post(f"/v1/jobs/{busy['id']}/cancel")
        wait_status(client, queued["id"], "succeeded", timeout=120)
        assert client.delete(f"/v1/files/{file_id}").status_code == 200
