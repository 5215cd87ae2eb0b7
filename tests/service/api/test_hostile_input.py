"""Whatever a client sends, the answer is the JSON envelope with a 4xx, and a refused job stores nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from tests.service.api.test_api_errors import nothing_stored, post_spec, spec_error  # noqa: F401  (a fixture, used by name)
from tests.service.conftest import Server, spec_yaml, submit, wait_status

BIG = str(2**63)


def envelope(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["message"]


@pytest.mark.usefixtures("nothing_stored")
class TestCursorsAndHeaders:
    @pytest.mark.parametrize(
        ("path", "params", "message"),
        [
            ("/v1/jobs", {"cursor": BIG}, "query.cursor: must be at most 9223372036854775807"),
            ("/v1/jobs", {"cursor": "9" * 30}, "query.cursor: String should match pattern '^[0-9]{1,19}$'"),
            ("/v1/jobs/{id}/events", {"after": BIG}, "query.after: Input should be less than or equal to"),
            ("/v1/jobs/{id}/metrics", {"after": BIG}, "query.after: Input should be less than or equal to"),
            ("/v1/jobs/{id}/events/stream", {"after": BIG}, "query.after: Input should be less than or equal to"),
        ],
    )
    def test_cursors_beyond_int64(
        self, client: httpx.Client, job_id: str, path: str, params: dict, message: str
    ) -> None:
        status, code, text = envelope(client.get(path.format(id=job_id), params=params))
        assert (status, code) == (422, "invalid_request") and message in text

    @pytest.mark.parametrize("value", ["²".encode(), b"12a", BIG.encode(), b"-1"])
    def test_last_event_id_that_no_stream_sent(self, client: httpx.Client, job_id: str, value: bytes) -> None:
        response = client.get(f"/v1/jobs/{job_id}/events/stream", headers={"Last-Event-ID": value})
        status, code, message = envelope(response)
        assert (status, code) == (422, "invalid_request")
        assert message.startswith("The request is invalid: header.last-event-id: must be the id of an event")


@pytest.fixture(scope="module")
def job_id(server: Server) -> str:
    """A finished job with checkpoints, for the routes that take an id."""
    with server.client() as client:
        job = submit(client, spec_yaml(name="hostile", steps=2, every=1))
        wait_status(client, job["id"], "succeeded")
        return job["id"]


@pytest.mark.usefixtures("nothing_stored")
class TestBodies:
    def test_json_nested_1000_deep(self, client: httpx.Client) -> None:
        assert spec_error(post_spec(client, "[" * 1000 + "]" * 1000, "application/json"))[:2] == (
            422,
            "The job spec has 1 problem: spec: the JSON body nests too deep; flatten it",
        )

    def test_a_5000_digit_integer_in_json_and_in_yaml(self, client: httpx.Client) -> None:
        status, message, _ = spec_error(post_spec(client, '{"name": ' + "9" * 5000 + "}", "application/json"))
        assert status == 422 and "the JSON body holds a number no field can take" in message
        text = spec_yaml().replace("steps: 40", "steps: " + "9" * 5000)
        assert spec_error(post_spec(client, text))[:2] == (
            422,
            "The job spec has 1 problem: spec (line 4): a number of 5000 digits; no field takes more than 64 "
            "(2**63 - 1 has 19)",
        )

    def test_a_lone_surrogate_is_refused_and_the_listing_stays_whole(self, client: httpx.Client) -> None:
        spec = {
            "name": "surrogate",
            "model": {"kind": "toy_mlp", "hidden_size": 8, "num_layers": 1},
            "data": {"kind": "synthetic_regression"},
            "training": {"steps": 1},
            "lora": {"target_modules": ["layers.0\ud800"]},
            "device": "cpu",
        }
        response = post_spec(client, json.dumps(spec), "application/json")  # json.dumps writes it as \\ud800
        assert spec_error(response)[:2] == (
            422,
            "The job spec has 1 problem: lora.target_modules.0 (line 1): holds a lone surrogate (\\ud800) at character 9; "
            "send valid Unicode text",
        )
        assert client.get("/v1/jobs").status_code == 200

    @pytest.mark.parametrize(
        ("key", "value", "message"),
        [
            ("learning_rate", ".inf", "must be a finite number; got inf"),
            ("learning_rate", "1e400", "must be a finite number; got 1e400"),
            ("steps", "true", "must be a number, not true"),
            ("steps", BIG, "must be within ±(2**63 - 1), what the store holds; got a 64-bit number"),
        ],
    )
    def test_values_no_run_can_use(self, client: httpx.Client, key: str, value: str, message: str) -> None:
        old = {"learning_rate": "learning_rate: 0.01", "steps": "steps: 40"}[key]
        _, _, problems = spec_error(post_spec(client, spec_yaml().replace(old, f"{key}: {value}")))
        assert [(p["path"], p["message"]) for p in problems] == [(f"training.{key}", message)]


@pytest.mark.usefixtures("nothing_stored")
class TestDataPaths:
    def data_spec(self, path: str) -> str:
        return spec_yaml().replace("{kind: synthetic_regression}", f"{{kind: text, path: '{path}'}}")

    def test_a_link_in_a_data_directory_leading_out(self, client: httpx.Client, datasets: Path) -> None:
        corpus = datasets / "linked"
        corpus.mkdir(exist_ok=True)
        (corpus / "ok.txt").write_text("hello")
        secret = datasets.parent / "secret.txt"
        secret.write_text("outside the roots")
        if not (corpus / "leak.txt").is_symlink():
            (corpus / "leak.txt").symlink_to(secret)
        for path in ("linked", "."):
            status, message, _ = spec_error(post_spec(client, self.data_spec(path)))
            shown = "leak.txt" if path == "linked" else "linked/leak.txt"
            assert status == 422 and f"{shown} in '{path}' links outside it; copy the file in" in message
            assert str(datasets) not in message

    def test_loops_fifos_and_long_names(self, client: httpx.Client, datasets: Path) -> None:
        if not (datasets / "loop").is_symlink():
            (datasets / "loop").symlink_to(datasets / "loop")
        if not (datasets / "pipe").exists():
            os.mkfifo(datasets / "pipe")
        expected = {
            "loop": "'loop' cannot be used: it is a symbolic link loop",
            "pipe": "'pipe' is not a regular file or a directory",
            "a" * 300: "a name in it is longer than the filesystem allows (255 bytes per name)",
        }
        for path, text in expected.items():
            status, message, problems = spec_error(post_spec(client, self.data_spec(path)))
            assert status == 422 and text in message, message
            assert [p["path"] for p in problems] == ["data.path"]
        # the data directory itself holds the loop and the FIFO: both are skipped or refused, never read
        os.unlink(datasets / "loop")
        os.unlink(datasets / "pipe")


@pytest.fixture
def datasets(server: Server) -> Path:
    return server.data_dir.parent / "datasets"


@pytest.mark.usefixtures("nothing_stored")
class TestWhereItWouldRun:
    def test_device_cuda_on_a_server_without_a_gpu(self, client: httpx.Client) -> None:
        text = spec_yaml().replace("device: cpu", "device: cuda")
        response = post_spec(client, text)
        status, code, message = envelope(response)
        assert (status, code) == (422, "device_unavailable")
        assert message == (
            "The job cannot run here: device: cuda, but this service has no GPU worker (its workers: cpu0); set "
            "device: cpu or auto, or run the service on a machine with a GPU. Submit with ?queue_anyway=true to "
            "queue it anyway."
        )
        assert response.json()["error"]["problems"][0] | {"message": ""} == {
            "path": "device",
            "message": "",
            "line": 6,
            "suggestion": None,
        }
        assert client.post("/v1/jobs/validate", content=text, headers={"content-type": "text/yaml"}).status_code == 422

    def test_a_cpu_job_beyond_the_host(self, client: httpx.Client) -> None:
        text = spec_yaml().replace("hidden_size: 64, num_layers: 2", "hidden_size: 400000, num_layers: 10")
        validated = client.post("/v1/jobs/validate", content=text, headers={"content-type": "text/yaml"}).json()
        assert validated["estimate"]["fits"] is False
        status, code, message = envelope(post_spec(client, text))
        assert (status, code) == (422, "does_not_fit")
        assert message.startswith("The job cannot fit in this host's memory: the job needs an estimated ")
        assert " TiB of host memory (peak " in message


def test_device_cuda_queued_anyway(client: httpx.Client) -> None:
    text = spec_yaml(name="anyway").replace("device: cpu", "device: cuda")
    response = client.post(
        "/v1/jobs", params={"queue_anyway": "true"}, content=text, headers={"content-type": "application/yaml"}
    )
    assert response.status_code == 201, response.text
    client.post(f"/v1/jobs/{response.json()['id']}/cancel")


def test_downloads_head_and_range_errors_in_the_envelope(client: httpx.Client, job_id: str) -> None:
    checkpoint = client.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"][-1]
    file = checkpoint["files"][0]
    head = client.head(file["url"])
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == file["bytes"] and head.headers["x-checksum-sha256"] == file["sha256"]
    malformed = client.get(file["url"], headers={"Range": "bytes=abc"})
    assert envelope(malformed)[:2] == (400, "malformed_range")
    beyond = client.get(file["url"], headers={"Range": f"bytes={file['bytes'] + 10}-"})
    assert envelope(beyond) == (
        416,
        "range_not_satisfiable",
        f"The Range header 'bytes={file['bytes'] + 10}-' lies outside the file's {file['bytes']} bytes.",
    )
    assert beyond.headers["content-range"] == f"bytes */{file['bytes']}"
    assert client.get(file["url"], headers={"Range": "bytes=0-3"}).status_code == 206
