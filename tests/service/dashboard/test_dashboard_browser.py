"""The dashboard end to end in real headless Chromium (Debian's `chromium`, driven by Playwright for
Python) against a real Ferry server on 127.0.0.1: token gate, a typo shown at its line, the CPU smoke job
submitted, watched to `succeeded` without a reload, its charts, events and a checkpoint download.
Each test saves a screenshot of its page, outside the repository: tests never rewrite tracked files. To
refresh the README's screenshots in docs/, run them with the target named:

    FERRY_SCREENSHOTS=docs python -m pytest -q tests/service/dashboard/test_dashboard_browser.py

CI (CI=true) runs `.ci/install-browser` first and these tests must run there; elsewhere they skip,
saying why, when chromium or Playwright is absent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.conftest import TOKEN, Server

REPO = Path(__file__).resolve().parents[3]
SMOKE_SPEC = REPO / "configs" / "cpu_smoke.yaml"
CHROMIUM = os.environ.get("FERRY_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LAPTOP = {"width": 1280, "height": 860}
PHONE = {"width": 390, "height": 844}


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed; run .ci/install-browser"
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        return f"{CHROMIUM} is not installed; run .ci/install-browser (Debian's chromium package)"
    return None


MISSING = _browser_missing()
if MISSING and os.environ.get("CI") == "true":
    raise RuntimeError(f"browser tests must run in CI: {MISSING}")
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Two CPU workers: the job that fails (below) runs beside the smoke job instead of ahead of it.
    root = tmp_path_factory.mktemp("ferry-ui")
    server = Server(root / "data", {"FERRY_API_TOKEN": TOKEN, "FERRY_CPU_WORKERS": "2"})
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def failing_job(server: Server) -> str:
    """A job that fails at run time on a machine without CUDA; submitted early so it is done when needed."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("device: cuda does not fail on a machine with CUDA")
    spec = re.sub(r"(?m)^device: .*$", "device: cuda", smoke_spec()).replace("name: cpu-smoke", "name: needs-a-gpu")
    with server.client() as api:
        response = api.post("/v1/jobs?queue_anyway=true", content=spec, headers={"Content-Type": "application/yaml"})
    assert response.status_code == 201, response.text
    return response.json()["id"]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server: Server):  # type: ignore[no-untyped-def]
    """A page whose browser session already holds the token (the gate has its own test)."""
    context = browser.new_context(viewport=LAPTOP, accept_downloads=True, base_url=server.url)
    context.add_init_script(f"sessionStorage.setItem('ferry.token', {TOKEN!r})")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def smoke_spec() -> str:
    if not SMOKE_SPEC.exists():
        pytest.skip(f"{SMOKE_SPEC.relative_to(REPO)} is not in this checkout yet")
    return SMOKE_SPEC.read_text()


def screenshot_dir() -> Path:
    """``FERRY_SCREENSHOTS`` (relative to the repository: ``docs`` refreshes the README's), else a temp dir."""
    named = os.environ.get("FERRY_SCREENSHOTS")
    return REPO / named if named else Path(tempfile.gettempdir()) / "ferry-screenshots"


def shot(page, name: str) -> None:  # type: ignore[no-untyped-def]
    directory = screenshot_dir()
    directory.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(directory / f"dashboard-{name}.png"), full_page=True)


def test_with_a_token_set_nothing_loads_until_it_is_given(browser, server: Server, failing_job: str) -> None:  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport=LAPTOP, base_url=server.url)
    page = context.new_page()
    answers: list[tuple[str, int]] = []
    page.on("response", lambda r: answers.append((r.url, r.status)) if "/v1/" in r.url else None)

    page.goto("/")
    page.wait_for_selector("#token-form")
    assert page.locator("#jobs-list").count() == 0
    assert answers and all(status == 401 for _, status in answers), answers
    shot(page, "token")

    page.fill("#token-input", "not-the-token")
    page.click("#token-form button[type=submit]")
    page.wait_for_selector("#token-form .form-error")
    assert page.locator("#jobs-list").count() == 0

    page.fill("#token-input", TOKEN)
    page.click("#token-form button[type=submit]")
    page.wait_for_selector("#jobs-list")
    assert page.evaluate("sessionStorage.getItem('ferry.token')") == TOKEN
    # Asked once: a reload keeps the token for this tab.
    page.reload()
    page.wait_for_selector("#jobs-list")
    assert page.locator("#token-form").count() == 0
    context.close()


def test_a_typo_is_shown_at_its_line(page) -> None:  # type: ignore[no-untyped-def]
    lines = smoke_spec().splitlines()
    index = next(i for i, line in enumerate(lines) if re.match(r"\s+learning_rate:", line))
    lines[index] = lines[index].replace("learning_rate", "learnig_rate")
    page.goto("/ui/#/submit")
    page.fill("#spec-input", "\n".join(lines) + "\n")
    page.click("#validate")

    problem = page.locator(f'#problems .problem[data-line="{index + 1}"]')
    problem.wait_for()
    assert "training.learnig_rate" in problem.inner_text()
    assert "learning_rate" in problem.locator(".problem-hint").inner_text()
    assert page.locator(f".gutter .ln.bad >> text='{index + 1}'").count() == 1
    shot(page, "submit")


def test_smoke_job_from_submit_to_checkpoint_download(page, server: Server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto("/ui/#/submit")
    page.fill("#spec-input", smoke_spec())
    page.click("#validate")
    page.wait_for_selector("#estimate")
    assert page.locator("#estimate .verdict").inner_text() in {"Fits", "Does not fit", "Fit unknown"}
    shot(page, "submit-estimate")

    page.click("#submit")
    page.wait_for_url(re.compile(r"#/jobs/job-"))
    job_id = page.url.rsplit("/", 1)[-1]
    page.evaluate("window.__noReload = true")

    # The worker shows the job it runs (unless the job is already over).
    page.click("nav [data-nav=workers]")
    page.wait_for_selector("#workers .worker")
    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_selector(f'#workers a[href="#/jobs/{job_id}"]', timeout=20_000)
    shot(page, "workers")

    # Watch it on the Jobs page: the row changes status in place, no reload.
    page.click("nav [data-nav=jobs]")
    row = page.locator(f'tr[data-job-id="{job_id}"]')
    row.wait_for()
    page.wait_for_selector(f'tr[data-job-id="{job_id}"][data-status="succeeded"]', timeout=120_000)
    assert page.evaluate("window.__noReload") is True
    assert row.locator(".pct").inner_text() == "100%"
    shot(page, "jobs")

    row.locator("a.job-link").click()
    page.wait_for_url(re.compile(f"#/jobs/{job_id}$"))
    with server.client() as api:
        points = api.get(f"/v1/jobs/{job_id}/metrics").json()["data"]
        checkpoints = api.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"]
        events = api.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    total_steps = points[-1]["total_steps"]
    assert len({p["step"] for p in points}) == total_steps
    page.wait_for_selector(f'[data-chart=loss][data-points="{total_steps}"]')
    page.wait_for_selector("[data-chart=loss] canvas")
    page.wait_for_selector("#event-log [data-type=finished]")
    assert page.locator("#event-log li").count() == len(events)
    shot(page, "job")

    # The event log comes back whole after a reload.
    page.reload()
    page.wait_for_selector("#event-log [data-type=finished]")
    assert page.locator("#event-log li").count() == len(events)

    last = checkpoints[-1]["files"][0]
    button = page.locator(f'#checkpoints a.download[data-file="{last["name"]}"]').last
    with page.expect_download() as download_info:
        button.click()
    saved = tmp_path / last["name"]
    download_info.value.save_as(saved)
    assert hashlib.sha256(saved.read_bytes()).hexdigest() == last["sha256"]


def test_a_failed_job_shows_its_error_first(page, failing_job: str) -> None:  # type: ignore[no-untyped-def]
    page.goto("/ui/#/jobs?status=failed")
    row = page.locator(f'tr[data-job-id="{failing_job}"]')
    row.wait_for(timeout=120_000)
    assert "no CUDA device" in row.locator(".row-error").inner_text()

    row.locator("a.job-link").click()
    error = page.locator("#job-error")
    error.wait_for()
    assert "no CUDA device" in error.inner_text()
    # First thing under the title: before the progress figures and the charts.
    assert page.evaluate("""() => {
        const error = document.querySelector('#job-error'), stats = document.querySelector('.stats');
        return Boolean(error.compareDocumentPosition(stats) & Node.DOCUMENT_POSITION_FOLLOWING);
    }""")
    assert page.locator("[data-action=resume]").is_enabled()
    assert page.locator("[data-action=pause]").is_disabled()
    shot(page, "job-failed")


def test_without_the_chart_library_the_job_page_says_how_to_install_it(page) -> None:  # type: ignore[no-untyped-def]
    page.route("**/ui/vendor/**", lambda route: route.fulfill(status=404, body="not installed"))
    page.goto("/ui/#/jobs?status=succeeded")
    page.locator("tr.job-row a.job-link").first.click()
    notice = page.locator("[data-chart=loss] .chart-missing")
    notice.wait_for()
    assert "npm ci --prefix service/dashboard" in notice.inner_text()
    assert page.locator("[data-stat=loss] .stat-value").inner_text() != "—"


def test_a_dropped_stream_resumes_from_the_last_event_id(page) -> None:  # type: ignore[no-untyped-def]
    """The client half of resuming: the server's half is tested in the service's SSE tests. The stream
    is cut after three events; the page must reconnect with `Last-Event-ID: 3` and show each event once."""
    from jobs.events import StepEvent, event_to_wire
    from service.api.schemas import JobPublic

    # What the API would answer (validated against its model, so the page is fed the real shape).
    job = JobPublic.model_validate(
        {
            "id": "job-cut",
            "name": "cut-stream",
            "status": "running",
            "stop_requested": None,
            "created_at": "2026-01-01T00:00:00Z",
            "updated_at": "2026-01-01T00:00:00Z",
            "started_at": "2026-01-01T00:00:00Z",
            "finished_at": None,
            "attempt": 1,
            "retries": 0,
            "worker": "cpu0",
            "device": None,
            "progress": {
                "step": 3,
                "total_steps": 4,
                "percent": 75.0,
                "elapsed_s": 3.0,
                "eta_s": 1.0,
                "estimated_finish": None,
            },
            "metrics": None,
            "memory": None,
            "offload": None,
            "last_checkpoint": None,
            "error": None,
            "allowed_actions": ["pause", "cancel"],
            "spec": {},
            "spec_text": "name: cut-stream\n",
        }
    ).model_dump(mode="json")
    seen_ids: list[str | None] = []

    def event(event_id: int, step: int) -> str:
        data = {
            "id": event_id,
            "job_id": "job-cut",
            "attempt": 1,
            "type": "step",
            "created_at": "2026-01-01T00:00:00Z",
            "data": event_to_wire(
                StepEvent(
                    step=step,
                    total_steps=4,
                    loss=1.0 / step,
                    lr=1e-3,
                    samples_per_s=8.0,
                    elapsed_s=step,
                    eta_s=4 - step,
                )
            ),
        }
        return f"id: {event_id}\nevent: step\ndata: {json.dumps(data)}\n\n"

    def stream(route) -> None:  # type: ignore[no-untyped-def]
        last = route.request.headers.get("last-event-id")
        seen_ids.append(last)
        if last is None:  # the first connection: three events, then the connection drops
            body = "retry: 100\n\n" + "".join(event(i, i) for i in (1, 2, 3))
        else:  # the reconnection: only what comes after, then the end
            job.update(status="succeeded", allowed_actions=["delete"])
            body = event(4, 4) + 'event: end\ndata: {"status": "succeeded"}\n\n'
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page.route("**/v1/jobs/job-cut/events/stream*", stream)
    page.route(
        "**/v1/jobs/job-cut/metrics*", lambda r: r.fulfill(json={"data": [], "next_cursor": 0, "has_more": False})
    )
    page.route("**/v1/jobs/job-cut/checkpoints", lambda r: r.fulfill(json={"data": []}))
    page.route("**/v1/jobs/job-cut", lambda r: r.fulfill(json=job))
    page.goto("/ui/#/jobs/job-cut")

    page.wait_for_selector('#event-log [data-event-id="4"]')
    assert seen_ids[:2] == [None, "3"]
    ids = page.eval_on_selector_all("#event-log li", "items => items.map(item => item.dataset.eventId)")
    assert ids == ["1", "2", "3", "4"]
    page.wait_for_selector('[data-chart=loss][data-points="4"]')


def test_phone_layout(page) -> None:  # type: ignore[no-untyped-def]
    page.set_viewport_size(PHONE)
    page.goto("/ui/#/jobs")
    page.wait_for_selector("#jobs-list tr.job-row, #jobs-empty")
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    shot(page, "jobs-phone")
