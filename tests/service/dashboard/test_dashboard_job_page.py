"""The job page's readers in model.js (run by node, as the browser would): a CPU job is described in CPU
terms with no transfer charts where no byte moved, a whitespace-only sample is said in words, and a finished
job offers Delete; the event log gives each event's local time."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from service.dashboard.mount import STATIC_DIR
from tests.service.dashboard.test_dashboard_readers import read_with

node = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (CI installs it)")


@node
def test_a_cpu_job_is_known_by_its_spec_or_its_worker() -> None:
    jobs = [
        {"spec": {"device": "cpu"}},
        {"spec": {"device": "auto"}, "worker": "cpu-0"},
        {"spec": {"device": "auto"}, "worker": "gpu-0", "gpu": "NVIDIA H200"},
        {"spec": {"device": "cuda"}},
    ]
    assert read_with("a.jobs.map(m.isCpuJob)", jobs=jobs) == [True, True, False, False]


@node
def test_the_jobs_list_says_what_ran_a_job() -> None:
    jobs = [
        {"worker": "cpu0", "gpu": None},  # a CPU worker's
        {"worker": "gpu0", "gpu": None, "spec": {"device": "cpu"}},  # device: cpu on a GPU's slot
        {"worker": "gpu1", "gpu": "1"},
        {"worker": "gpu0+gpu1", "gpu": "0,1"},
        {"worker": None, "gpu": None},  # queued
    ]
    assert read_with("a.jobs.map(m.ranOn)", jobs=jobs) == ["CPU", "CPU", "1", "0,1", None]
    page = (STATIC_DIR / "pages" / "jobs.js").read_text()
    # Old code: the GPU column showed the worker's name ("cpu0") or the slot's GPU for a CPU job.
    assert 'ranOn(job) === "CPU" ? h("span", { class: "muted" }, "CPU")' in page and "job.worker) : DASH" not in page


@node
def test_transfer_charts_only_where_bytes_moved() -> None:
    cpu_rows = [{"step": 1, "h2d": 0, "d2h": 0, "h2dBytes": 0}, {"step": 2, "h2d": None, "d2h": None}]
    gpu_rows = [*cpu_rows, {"step": 3, "h2d": 12.5, "d2h": 3.1, "h2dBytes": 1 << 30}]
    assert read_with("[m.bytesMoved(a.cpu), m.bytesMoved(a.gpu), m.bytesMoved([])]", cpu=cpu_rows, gpu=gpu_rows) == [
        False,
        True,
        False,
    ]


@node
def test_a_whitespace_only_sample_is_said_in_words_not_drawn_as_a_thousand_empty_lines() -> None:
    texts = ["\n" * 1000, "", None, "  Paris.\n"]
    assert read_with("a.texts.map(m.sampleText)", texts=texts) == [
        {"text": "(whitespace only: 1000 characters)", "blank": True},
        {"text": "(empty)", "blank": True},
        {"text": "(empty)", "blank": True},
        {"text": "  Paris.\n", "blank": False},
    ]


def test_sample_blocks_are_bounded_in_height() -> None:
    css = (STATIC_DIR / "style.css").read_text()
    rule = re.search(r"\.sample-text \{([^}]*)\}", css)
    assert rule is not None and "max-height" in rule.group(1) and "overflow: auto" in rule.group(1)


def test_the_job_page_speaks_of_host_memory_on_the_cpu_and_offers_delete_when_finished() -> None:
    page = (STATIC_DIR / "pages" / "job.js").read_text()
    series = (STATIC_DIR / "pages" / "job-series.js").read_text()
    assert "makeCharts({ cpu: isCpuJob(job) })" in page and 'stat("Host memory"' in page
    assert 'allowed("delete") ? button("delete", "Delete", "danger")' in page
    assert "await apiDelete(path)" in page
    assert "transfer.element.hidden = !copies" in series


def clock_in(zone: str, *moments: object) -> list[object]:
    """format.js's clockTime of each moment, in node with the reader's time zone ``zone``."""
    script = (
        f"import {{ clockTime }} from {json.dumps((STATIC_DIR / 'format.js').as_uri())};\n"
        f"console.log(JSON.stringify({json.dumps(moments)}.map(clockTime)));\n"
    )
    env = {**os.environ, "TZ": zone}
    done = subprocess.run(
        ["node", "--input-type=module", "-e", script], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(done.stdout)


@node
def test_the_event_log_shows_each_event_at_the_readers_local_time_not_an_epoch_float() -> None:
    moment = 1765065607.25  # 2025-12-07 00:00:07.25 UTC, as a step point's `time`
    utc, tokyo = clock_in("UTC", moment, "2025-12-07T00:00:07Z", None), clock_in("Asia/Tokyo", moment)
    assert [c and c["text"] for c in utc] == ["00:00:07", "00:00:07", None]  # type: ignore[index]
    assert tokyo[0]["text"] == "09:00:07" and tokyo[0]["iso"] == "2025-12-07T00:00:07.250Z"  # type: ignore[index]
    log = (STATIC_DIR / "pages" / "event-log.js").read_text()
    assert 'timeCell(event), h("span", { class: "event-type" }' in log  # every row starts with its time
    assert "!ENVELOPE.has(key)" in log  # an unknown event's JSON leaves out `time` and `created_at`
