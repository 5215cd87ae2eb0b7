"""The API process never imports torch: the spec checker, the merge and the jobs do, each in a process of its own.

A real server runs in a subprocess whose ``sys.modules`` is written out when it exits; every route a user
touches is called first, the merge included (a tiny LoRA job on CPU).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, save_llama, write_jsonl
from tests.service.conftest import TOKEN, Server, wait_status

HEAVY = ("torch", "transformers", "diffusers", "peft", "datasets", "accelerate")
# Runs the server as `python -m service` does, then writes the modules it ever imported.
SERVE_AND_DUMP = """
import json, runpy, sys
dump, sys.argv = sys.argv[1], sys.argv[:1]
try:
    runpy.run_module("service", run_name="__main__")
finally:
    json.dump(sorted(sys.modules), open(dump, "w"))
"""
YAML = {"content-type": "application/yaml"}


def test_no_route_imports_torch_into_the_api_process(tmp_path: Path) -> None:
    models, data = tmp_path / "models", tmp_path / "datasets"
    save_bpe_tokenizer(models / "tok")
    save_llama(models / "llama")
    write_jsonl(data / "chat.jsonl", [chat_record(i) for i in range(8)])
    dump = tmp_path / "modules.json"
    env = {"FERRY_API_TOKEN": TOKEN, "FERRY_MODEL_ROOTS": str(models), "FERRY_DATA_ROOTS": str(data)}
    server = Server(tmp_path / "data", env, argv=[sys.executable, "-c", SERVE_AND_DUMP, str(dump)])
    spec = yaml.safe_dump(llm_spec(training={"steps": 2}, checkpoint={"every_steps": 2}))
    try:
        server.start()
        with server.client() as client:
            validated = client.post("/v1/jobs/validate", content=spec, headers=YAML)
            assert validated.status_code == 200, validated.text
            assert validated.json()["estimate"]["peak_device_bytes"] > 0
            refused = client.post("/v1/jobs/validate", content="name: x\nmodel: {kind: nope}\n", headers=YAML)
            assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_spec"

            job = client.post("/v1/jobs", content=spec, headers=YAML).json()
            wait_status(client, job["id"], "succeeded", timeout=180)
            base = f"/v1/jobs/{job['id']}"
            assert [j["id"] for j in client.get("/v1/jobs").json()["data"]] == [job["id"]]
            assert client.get(base).json()["status"] == "succeeded"
            assert "finished" in [e["type"] for e in client.get(f"{base}/events").json()["data"]]
            with client.stream("GET", f"{base}/events/stream") as stream:
                assert stream.status_code == 200
                assert any("finished" in line for line in stream.iter_lines())  # a finished job's stream ends
            assert client.get(f"{base}/metrics").status_code == 200
            checkpoints = client.get(f"{base}/checkpoints").json()["data"]
            name = checkpoints[-1]["name"]
            merged = client.post(f"{base}/checkpoints/{name}/merge")
            assert merged.status_code == 200, merged.text
            assert client.get(merged.json()["archive"]["url"]).status_code == 200
            assert client.get("/metrics").status_code == 200 and client.get("/ui/").status_code == 200
            chats = "".join(json.dumps(chat_record(i)) + "\n" for i in range(4)).encode()
            upload = client.post("/v1/files", files={"file": ("c.jsonl", chats)}, data={"purpose": "fine-tune"})
            assert upload.status_code == 201, upload.text
            assert client.get(f"/v1/files/{upload.json()['id']}/content").content == chats
            created = client.post(
                "/v1/fine_tuning/jobs",
                json={"model": "llama", "training_file": upload.json()["id"], "ferry": {"device": "cpu"}},
            )
            assert created.status_code == 400  # the model directory has no tokenizer: refused by the checker
            assert client.get("/v1/fine_tuning/jobs").status_code == 200
            axolotl = "base_model: llama\ndatasets: [{path: chat.jsonl, type: chat_template}]\nadapter: lora\n"
            converted = client.post(
                "/v1/conversions/axolotl", content=axolotl, headers={"content-type": "application/x-axolotl+yaml"}
            )
            assert converted.status_code == 200
    finally:
        server.stop()
    imported = set(json.loads(dump.read_text()))
    assert "service.api.app" in imported  # the dump is the server's
    assert sorted(imported.intersection(HEAVY)) == []
