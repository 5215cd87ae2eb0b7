"""What the dashboard's readers in model.js make of the API's answers (run by node, as the browser would).

The contract test checks that each field they read is declared; this checks that they read the right ones:
the paging fields of ``/metrics`` and ``/events``, a listed and a streamed sample, and the merge archive.
The answers are built with the API's own models, so they have the shape the service sends.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from jobs.events import PreferenceMetrics
from service.api.schemas import EvalPoint, MergedPublic, MetricsPublic, SamplePoint, SamplesPublic
from service.dashboard.mount import STATIC_DIR

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (CI installs it)")


def read_with(expression: str, **answers: Any) -> Any:
    """Evaluate ``expression`` over model.js's exports (``m``) and ``answers`` (JSON) in node."""
    script = (
        f"import * as m from {json.dumps((STATIC_DIR / 'model.js').as_uri())};\n"
        f"const a = {json.dumps(answers)};\n"
        f"console.log(JSON.stringify({expression}));\n"
    )
    done = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


DPO_FIGURES = PreferenceMetrics(
    rewards_chosen=0.2,
    rewards_rejected=-0.1,
    rewards_accuracies=0.75,
    rewards_margins=0.3,
    logps_chosen=-5.0,
    logps_rejected=-7.0,
)


def test_a_metrics_page_gives_its_evaluations_and_cursor() -> None:
    page = MetricsPublic(
        data=[],
        eval=[
            EvalPoint(step=4, eval_loss=1.5, perplexity=4.48, event_id=9, time=1.0),
            EvalPoint(step=6, eval_loss=0.6, preference=DPO_FIGURES, event_id=11, time=2.0),  # dpo: no perplexity
        ],
        next_cursor=9,
        has_more=True,
    )
    read = read_with("m.metricsPage(a.page)", page=page.model_dump(mode="json"))
    assert read == {
        "rows": [],
        "evals": [
            {"step": 4, "evalLoss": 1.5, "perplexity": 4.48, "rewardAccuracy": None},
            {"step": 6, "evalLoss": 0.6, "perplexity": None, "rewardAccuracy": 0.75},
        ],
        "nextCursor": 9,
        "hasMore": True,
    }


def test_listed_and_streamed_samples_come_out_alike() -> None:
    listed = SamplePoint(
        step=2,
        prompt="a cat",
        artifact_path="samples/step-2/0.png",
        event_id=7,
        time=1.0,
        url="/v1/jobs/j/samples/files/x",
    )
    page = SamplesPublic(data=[listed], next_cursor=7, has_more=False)
    # A streamed event, as unwrapEvent hands it on: the event's data with no url and no stored id.
    streamed = {"type": "sample", "step": 3, "prompt": "hello", "text": " world"}
    read = read_with(
        "[m.samplesOf(a.page).map((s) => m.normalizeSample(s, '/v1/jobs/j')), m.normalizeSample(a.streamed, '/v1/jobs/j', '12')]",
        page=page.model_dump(mode="json"),
        streamed=streamed,
    )
    assert read == [
        [
            {
                "key": "7",
                "step": 2,
                "prompt": "a cat",
                "text": None,
                "reward": None,
                "artifactPath": "samples/step-2/0.png",
                "url": "/v1/jobs/j/samples/files/x",
            }
        ],
        {
            "key": "12",
            "step": 3,
            "prompt": "hello",
            "text": " world",
            "reward": None,
            "artifactPath": None,
            "url": None,
        },
    ]
    image_event = {"type": "sample", "step": 3, "artifact_path": "samples/step-3/0.png"}
    assert read_with("m.normalizeSample(a.e, '/v1/jobs/j', '13').url", e=image_event) == (
        "/v1/jobs/j/samples/files/samples/step-3/0.png"
    )


def test_the_merge_answer_gives_its_archive() -> None:
    merged = MergedPublic.model_validate(
        {"checkpoint": "step-4", "archive": {"name": "step-4-merged.tar", "bytes": 10, "sha256": "ab", "url": "/x.tar"}}
    )
    read = read_with("m.mergedArchive(a.merged)", merged=merged.model_dump(mode="json"))
    assert read == {"url": "/x.tar", "name": "step-4-merged.tar", "bytes": 10}


def test_the_offload_figures_say_what_the_budget_keeps_on_the_gpu_and_what_the_ring_reused() -> None:
    from offload import OffloadStats

    stats = OffloadStats(
        last_step_h2d_gbps=54.2, copy_wait_seconds=0.5, h2d_bytes=10, kept_resident_bytes=15 << 30, reused_bytes=7
    )
    read = read_with("m.offloadFigures(a.off)", off=dataclasses.asdict(stats))
    assert read == {"h2d": 54.2, "d2h": 0.0, "copyWait": 0.5, "h2dBytes": 10, "kept": 15 << 30, "reused": 7}


def test_a_checkpoints_exports_are_offered_as_downloads_the_routes_serve(tmp_path: Path) -> None:
    """The listing the service sends, read by model.js as the checkpoints card does: each export's link is a
    route that serves that file (the merged .tar, the GGUF, its Modelfile); a GGUF export answer gives its file."""
    from fastapi.testclient import TestClient

    from jobs.checkpoints.directory import file_sha256, save_checkpoint
    from service.api.app import create_app
    from service.checking.check import InlineSpecChecker
    from service.queue.status import JobStatus
    from service.queue.store import JobStore
    from service.settings import Settings
    from tests.service.checking.test_one_parse import IdleExecutor

    settings = Settings(data_dir=tmp_path, devices="cpu", _env_file=None)
    store = JobStore(settings.db_path)
    store.create_job(job_id="j", name=None, spec_text="name: x", spec={})
    store.transition("j", JobStatus.CANCELLED, reason="cancelled by user")
    store.close()
    output = settings.job_dir("j") / "output"
    save_checkpoint(output, 2, {}, lambda d: (d / "adapter_config.json").write_text("{}"))
    exports = output / "exports"
    made = {
        "step-00000002-merged.tar": b"tar",
        "step-00000002-q8_0.gguf": b"GGUF",
        "step-00000002-q8_0.Modelfile": b"FROM",
    }
    for name, content in made.items():
        (exports / name).parent.mkdir(parents=True, exist_ok=True)
        (exports / name).write_bytes(content)
        if not name.endswith(".Modelfile"):
            (exports / f"{name}.sha256").write_text(file_sha256(exports / name))
    (exports / "step-00000002-f16.gguf").write_bytes(b"half-written")  # no .sha256 yet: not listed

    app = create_app(settings, executor=IdleExecutor(), spec_checker=InlineSpecChecker())
    with TestClient(app, raise_server_exceptions=False) as client:
        listing = client.get("/v1/jobs/j/checkpoints").json()
        ckpt = listing["data"][0]
        read = read_with("[m.checkpointExports(a.ckpt), m.ggufExportable(a.ckpt)]", ckpt=ckpt)
        links, exportable = read
        assert exportable is True
        assert {link["name"]: link["url"] for link in links} == {
            "step-00000002-merged.tar": "/v1/jobs/j/checkpoints/step-00000002/merged",
            "step-00000002-q8_0.gguf": "/v1/jobs/j/checkpoints/step-00000002/gguf?quant=q8_0",
            "step-00000002-q8_0.Modelfile": "/v1/jobs/j/checkpoints/step-00000002/gguf/modelfile?quant=q8_0",
        }
        for link in links:
            answer = client.get(link["url"])
            assert answer.status_code == 200 and answer.content == made[link["name"]]
            assert link["bytes"] == len(made[link["name"]])
        # The card's GGUF button reads the export answer; the q8_0 file is made already, so no export runs.
        answer = client.post("/v1/jobs/j/checkpoints/step-00000002/gguf?quant=q8_0").json()
        assert read_with("m.ggufFile(a.answer)", answer=answer) == {
            "url": "/v1/jobs/j/checkpoints/step-00000002/gguf?quant=q8_0",
            "name": "step-00000002-q8_0.gguf",
            "bytes": 4,
        }
        card = client.get("/ui/static/pages/checkpoints.js")
        assert card.status_code == 200 and "data-gguf" in card.text and "checkpointExports(ckpt)" in card.text


def test_merge_is_offered_where_the_server_says_a_merge_works() -> None:
    """A LoRA checkpoint of a family that does not merge has adapter_config.json too: the file is no sign."""
    adapter = {"name": "adapter_config.json", "bytes": 2, "sha256": "ab", "url": "/a"}
    listed = [
        {"name": "a", "step": 1, "created": None, "files": [adapter], "mergeable": True},
        {"name": "b", "step": 2, "created": None, "files": [adapter], "mergeable": False},
        {"name": "c", "step": 3, "created": None, "files": []},
    ]
    assert read_with("a.listed.map(m.mergeable)", listed=listed) == [True, False, False]
    page = (STATIC_DIR / "pages" / "checkpoints.js").read_text()
    assert "const lora = mergeable(ckpt);" in page and '"adapter_config.json"' not in page
