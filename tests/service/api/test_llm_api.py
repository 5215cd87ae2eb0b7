"""Chat fine-tuning through the service: 422s for bad data at submit, eval metrics, samples, the best
checkpoint, the merge action and its archive, the eval gauge in /metrics."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import yaml

from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, save_llama, write_jsonl
from tests.service.conftest import wait_status


def roots(tmp_path: Path) -> dict[str, str]:
    models, data = tmp_path / "models", tmp_path / "datasets"
    save_bpe_tokenizer(models / "tok")
    save_llama(models / "llama")
    write_jsonl(data / "chat.jsonl", [chat_record(i) for i in range(16)])
    return {"FERRY_MODEL_ROOTS": str(models), "FERRY_DATA_ROOTS": str(data)}


def test_bad_chat_data_is_a_422_naming_row_and_field_and_nothing_is_queued(tmp_path: Path, make_server) -> None:
    env = roots(tmp_path)
    rows = [chat_record(i) for i in range(16)]
    rows[4]["messages"][1]["role"] = "human"
    write_jsonl(Path(env["FERRY_DATA_ROOTS"]) / "bad.jsonl", rows)
    server = make_server(**env)
    spec = llm_spec(data={"path": "bad.jsonl"}, lora={"target_modules": ["q_proj", "c_attn"]})
    with server.client() as client:
        for route in ("/v1/jobs", "/v1/jobs/validate"):
            answer = client.post(
                route, content=yaml.safe_dump(spec, sort_keys=False), headers={"content-type": "application/yaml"}
            )
            assert answer.status_code == 422
            problems = {p["path"]: p for p in answer.json()["error"]["problems"]}
            assert problems["data.path"]["message"] == (
                "bad.jsonl row 5: field 'messages[1].role': must be one of system, user, assistant, tool, "
                "developer; got 'human' (data.format: chat)"
            )
            assert problems["data.path"]["line"] is not None
            assert problems["lora.target_modules"]["message"].startswith("['c_attn'] match no module of llama")
        assert client.get("/v1/jobs").json()["data"] == []


def test_chat_job_reports_eval_samples_best_checkpoint_and_merges(tmp_path: Path, make_server) -> None:
    server = make_server(**roots(tmp_path))
    spec = llm_spec(
        eval={"split": 0.25, "every_steps": 2},
        text_samples={"prompts": ["the quick fox"], "every_steps": 3, "max_new_tokens": 4},
        checkpoint={"every_steps": 2, "keep_last": 1},
    )
    with server.client() as client:
        job = client.post("/v1/jobs", content=yaml.safe_dump(spec), headers={"content-type": "application/yaml"}).json()
        wait_status(client, job["id"], "succeeded", timeout=180)
        base = f"/v1/jobs/{job['id']}"

        metrics = client.get(f"{base}/metrics").json()
        assert [p["step"] for p in metrics["data"]] == list(range(1, 7))
        evals = metrics["eval"]
        assert [e["step"] for e in evals] == [0, 2, 4, 6] and all(e["perplexity"] > 1 for e in evals)  # 0: the base
        # The cursor moves past the last evaluation: nothing is served twice.
        again = client.get(f"{base}/metrics", params={"after": metrics["next_cursor"]}).json()
        assert again["data"] == [] and again["eval"] == []

        samples = client.get(f"{base}/samples").json()["data"]
        assert [(s["step"], s["prompt"]) for s in samples] == [(3, "the quick fox"), (6, "the quick fox")]

        checkpoints = client.get(f"{base}/checkpoints").json()["data"]
        best_step = min(evals, key=lambda e: e["eval_loss"])["step"]
        assert [c["step"] for c in checkpoints if c["best"]] == [best_step]
        assert all(c["eval_loss"] == next(e["eval_loss"] for e in evals if e["step"] == c["step"]) for c in checkpoints)

        name = checkpoints[-1]["name"]
        assert client.get(f"{base}/checkpoints/{name}/merged").status_code == 404
        merged = client.post(f"{base}/checkpoints/{name}/merge")
        assert merged.status_code == 200, merged.text
        archive = merged.json()["archive"]
        download = client.get(archive["url"])
        assert download.headers["x-checksum-sha256"] == archive["sha256"] and len(download.content) == archive["bytes"]
        with tarfile.open(fileobj=io.BytesIO(download.content)) as tar:
            assert f"{name}-merged/config.json" in tar.getnames()
        assert client.post(f"{base}/checkpoints/step-00000099/merge").status_code == 404


def test_prometheus_shows_the_latest_eval_loss_of_a_running_job(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from jobs.events import EvalEvent
    from service.api.prometheus import render_metrics
    from service.queue.store import JobStore

    store = JobStore(tmp_path / "ferry.db")
    store.create_job(job_id="job-1", name="chat", spec_text="name: chat", spec={})
    store.claim_next(worker="cpu0", device=None)
    for step, loss in ((2, 3.5), (4, 2.25)):
        store.append_event("job-1", 1, EvalEvent(step=step, eval_loss=loss, perplexity=2.718281828**loss))
    text = render_metrics(store, SimpleNamespace(running={}, slots=[])).decode()
    assert '\nferry_job_eval_loss{job_id="job-1",worker="cpu0"} 2.25\n' in text


def test_a_bad_export_section_is_a_422_naming_the_field_and_nothing_is_queued(tmp_path: Path, make_server) -> None:
    server = make_server(**roots(tmp_path))
    bad = [
        (llm_spec(export={"gguf": {"quant": "q5_k_m"}}), "export.gguf.quant", "llama-quantize model-f16.gguf"),
        (llm_spec(export={"gguf": {"quant": "int3"}}), "export.gguf.quant", "unknown quant 'int3'"),
        (llm_spec(lora=None, export={"merged": True}), "export.merged", "already a whole model"),
        (llm_spec(export={"gguf": "q8_0"}), "export.gguf", ""),
    ]
    with server.client() as client:
        for spec, path, said in bad:
            for route in ("/v1/jobs", "/v1/jobs/validate"):
                answer = client.post(
                    route, content=yaml.safe_dump(spec, sort_keys=False), headers={"content-type": "application/yaml"}
                )
                assert answer.status_code == 422, answer.text
                problems = {p["path"]: p["message"] for p in answer.json()["error"]["problems"]}
                assert said in problems[path]
        assert client.get("/v1/jobs").json()["data"] == []
