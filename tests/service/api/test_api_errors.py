"""Bad requests: each gets the right 4xx with an exact message, and nothing is stored."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator

import httpx
import pytest

from tests.service.checking.test_yaml_guard import BOMB
from tests.service.conftest import TOKEN, Server, spec_yaml

UNKNOWN_KEY_HINT = (
    "unknown key (valid keys: steps, epochs, batch_size, auto, gradient_accumulation_steps, optimizer, "
    "learning_rate, weight_decay, scheduler, max_grad_norm, seed, kernels, compile, profile, mixed_precision, "
    "gradient_checkpointing, objective, dpo, orpo, grpo, timestep_range, timestep_weighting, guidance)"
)


def stored(server: Server) -> tuple[int, int, int]:
    """Rows in jobs and events, and job directories: what a rejected request must not add to."""
    conn = sqlite3.connect(server.data_dir / "ferry.sqlite3")
    try:
        jobs, events = (conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("jobs", "events"))
    finally:
        conn.close()
    job_dirs = server.data_dir / "jobs"
    return jobs, events, len(list(job_dirs.iterdir())) if job_dirs.exists() else 0


@pytest.fixture
def nothing_stored(server: Server) -> Iterator[None]:
    before = stored(server)
    yield
    assert stored(server) == before


def post_spec(client: httpx.Client, text: str, content_type: str = "application/yaml") -> httpx.Response:
    return client.post("/v1/jobs", content=text.encode(), headers={"Content-Type": content_type})


def spec_error(response: httpx.Response) -> tuple[int, str, list[dict]]:
    error = response.json()["error"]
    return response.status_code, error["message"], error.get("problems")


@pytest.mark.usefixtures("nothing_stored")
class TestRejectedSpecs:
    def test_malformed_yaml(self, client: httpx.Client) -> None:
        assert spec_error(post_spec(client, "name: t\nmodel: {kind: toy_mlp\n"))[:2] == (
            422,
            (
                "The job spec has 1 problem: spec (line 3): the spec is not valid YAML: expected ',' or '}', "
                "but got '<stream end>' at line 3, column 1"
            ),
        )

    def test_unknown_key_names_the_path_line_and_the_closest_key(self, client: httpx.Client) -> None:
        status, message, problems = spec_error(post_spec(client, spec_yaml().replace("learning_rate", "learning_rat")))
        assert (status, message) == (
            422,
            f"The job spec has 1 problem: training.learning_rat (line 4): "
            f"{UNKNOWN_KEY_HINT}; did you mean 'learning_rate'?",
        )
        assert problems == [
            {"path": "training.learning_rat", "message": UNKNOWN_KEY_HINT, "line": 4, "suggestion": "learning_rate"}
        ]

    def test_wrong_type(self, client: httpx.Client) -> None:
        assert spec_error(post_spec(client, spec_yaml().replace("steps: 40", "steps: forty")))[:2] == (
            422,
            ("The job spec has 1 problem: training.steps (line 4): must be a whole number; got 'forty'"),
        )

    def test_every_problem_is_reported_at_once(self, client: httpx.Client) -> None:
        text = spec_yaml().replace("steps: 40", "steps: forty").replace("learning_rate", "learning_rat")
        _, _, problems = spec_error(post_spec(client, text))
        assert sorted(p["path"] for p in problems) == ["training.learning_rat", "training.steps"]

    def test_oversized_body(self, client: httpx.Client) -> None:
        response = post_spec(client, spec_yaml() + "#" * 70_000 + "\n")
        assert (response.status_code, response.json()) == (
            413,
            {
                "error": {
                    "code": "body_too_large",
                    "message": (
                        "The request body is larger than 65536 bytes; send a smaller spec or raise FERRY_MAX_BODY_BYTES."
                    ),
                }
            },
        )

    def test_alias_bomb(self, client: httpx.Client) -> None:
        assert spec_error(post_spec(client, BOMB))[:2] == (
            422,
            (
                "The job spec has 1 problem: spec (line 5): the spec expands to more than 20000 YAML nodes once "
                "its aliases (*name) are expanded; write the values out instead of repeating anchors"
            ),
        )

    def test_path_escaping_the_data_root(self, client: httpx.Client, server: Server) -> None:
        escape = "../" * 12 + "etc/passwd"  # enough ../ to reach / from any tmp dir
        text = spec_yaml().replace("{kind: synthetic_regression}", f"{{kind: text, path: {escape}}}")
        assert spec_error(post_spec(client, text))[:2] == (
            422,
            (
                f"The job spec has 1 problem: data.path (line 3): '{escape}' leads outside every data root "
                "(data root 1, data root 2); give a path relative to a data root, and copy the files in rather "
                "than linking to them"
            ),
        )

    def test_invalid_json(self, client: httpx.Client) -> None:
        assert spec_error(post_spec(client, '{"name": "t",}', "application/json"))[:2] == (
            422,
            (
                "The job spec has 1 problem: spec (line 1): the body is not valid JSON: Expecting property name "
                "enclosed in double quotes at line 1, column 14"
            ),
        )

    def test_unsupported_content_type(self, client: httpx.Client) -> None:
        response = post_spec(client, spec_yaml(), "application/xml")
        assert response.status_code == 415
        assert response.json()["error"]["message"] == (
            "Content-Type 'application/xml' is not accepted; send the spec as application/yaml (or text/yaml) "
            "or as application/json, or an axolotl config as application/x-axolotl+yaml."
        )

    @pytest.mark.parametrize(
        ("headers", "message"),
        [
            (
                {},
                "This service needs a token: send the header 'Authorization: Bearer <token>' with the value of "
                "FERRY_API_TOKEN.",
            ),
            ({"Authorization": "Bearer wrong-token"}, "The bearer token is wrong; send the value of FERRY_API_TOKEN."),
            (
                {"Authorization": f"Basic {TOKEN}"},
                "This service needs a token: send the header 'Authorization: "
                "Bearer <token>' with the value of FERRY_API_TOKEN.",
            ),
        ],
    )
    @pytest.mark.parametrize(
        ("method", "path"),
        [
            ("POST", "/v1/jobs"),
            ("GET", "/v1/jobs"),
            ("GET", "/v1/workers"),
            ("GET", "/metrics"),
            ("GET", "/v1/jobs/job-x/checkpoints/step-00000010/files/model.safetensors"),
        ],
    )
    def test_missing_or_wrong_token(self, server: Server, headers: dict, message: str, method: str, path: str) -> None:
        response = httpx.request(
            method,
            server.url + path,
            headers={"Content-Type": "application/yaml", **headers},
            content=spec_yaml() if method == "POST" else None,
        )
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json() == {"error": {"code": "unauthorized", "message": message}}

    def test_validate_reports_the_fit_and_queues_nothing(self, client: httpx.Client) -> None:
        response = client.post("/v1/jobs/validate", content=spec_yaml(), headers={"Content-Type": "text/yaml"})
        body = response.json()
        assert response.status_code == 200 and body["valid"] is True and body["name"] == "smoke"
        estimate = body["estimate"]
        assert estimate["peak_device_bytes"] > 0 and estimate["fits"] is True, body["estimate_error"]
        assert [d["worker"] for d in estimate["devices"]] == ["cpu0"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", ""),
        ("POST", "/cancel"),
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("DELETE", ""),
        ("GET", "/events"),
        ("GET", "/events/stream"),
        ("GET", "/metrics"),
        ("GET", "/logs"),
        ("GET", "/checkpoints"),
        ("GET", "/checkpoints/step-00000010/files/model.safetensors"),
    ],
)
def test_unknown_job_is_404(client: httpx.Client, method: str, path: str) -> None:
    response = client.request(method, f"/v1/jobs/job-nope{path}")
    assert (response.status_code, response.json()) == (
        404,
        {"error": {"code": "not_found", "message": "No job with id 'job-nope'."}},
    )


def test_bad_query_parameter_names_the_field(client: httpx.Client) -> None:
    response = client.get("/v1/jobs", params={"limit": 0})
    assert (response.status_code, response.json()["error"]["message"]) == (
        422,
        "The request is invalid: query.limit: Input should be greater than or equal to 1.",
    )


def test_health_is_open_and_ready_after_recovery(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").json() == {"status": "ready"}


def test_json_body_and_idempotency_key(client: httpx.Client) -> None:
    body = json.dumps(
        {
            "name": "as-json",
            "model": {"kind": "toy_mlp", "hidden_size": 8, "num_layers": 1},
            "data": {"kind": "synthetic_regression"},
            "training": {"steps": 2},
            "device": "cpu",
        }
    )
    headers = {"Content-Type": "application/json", "Idempotency-Key": "once-only"}
    first = client.post("/v1/jobs", content=body, headers=headers)
    again = client.post("/v1/jobs", content=body, headers=headers)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"] and first.headers["location"] == f"/v1/jobs/{first.json()['id']}"
    other = client.post("/v1/jobs", content=body.replace("as-json", "other"), headers=headers)
    assert (other.status_code, other.json()["error"]["message"]) == (
        422,
        "Idempotency-Key 'once-only' was already used with a different spec; send a new key for a new job.",
    )
    client.post(f"/v1/jobs/{first.json()['id']}/cancel")
