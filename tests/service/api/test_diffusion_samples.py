"""A diffusion job through the service: cache, then LoRA with samples; the images in the API and as a
gallery per step on the job page (in headless Chromium where it is installed, as in CI)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.jobs.models.diffusion.helpers import cache_job, train_job
from tests.jobs.models.diffusion.pipelines import image_folder, qwen_image_pipeline
from tests.service.conftest import TOKEN, Server, wait_for

pytestmark = pytest.mark.filterwarnings("ignore")
PROMPTS = ["a red square", "a blue circle"]


@pytest.fixture(scope="module")
def diffusion_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("ferry-diffusion")
    qwen_image_pipeline(root / "models" / "qwen")
    image_folder(root / "datasets" / "images", [(64, 48)] * 2)
    env = {
        "FERRY_API_TOKEN": TOKEN,
        "FERRY_MODEL_ROOTS": str(root / "models"),
        "FERRY_DATA_ROOTS": str(root / "datasets"),
    }
    server = Server(root / "data", env)
    server.start()
    yield server
    server.stop()


def _submit(client: httpx.Client, spec: dict) -> dict:
    response = client.post("/v1/jobs", content=yaml.safe_dump(spec), headers={"Content-Type": "application/yaml"})
    assert response.status_code == 201, response.text
    return wait_for(client, response.json()["id"], lambda j: j["status"] in ("succeeded", "failed"), timeout=240)


@pytest.fixture(scope="module")
def lora_job(diffusion_server: Server) -> str:
    """The cache job, then a LoRA job sampling at steps 2 and 4; returns the LoRA job's id."""
    with diffusion_server.client() as client:
        cached = _submit(client, {**cache_job(), "device": "cpu"})
        assert cached["status"] == "succeeded", cached.get("error")
        # A cache job's progress counts samples encoded; it has no loss to show.
        assert (cached["progress"]["step"], cached["progress"]["percent"], cached["metrics"]) == (2, 100.0, None)
        sample = {"every_steps": 2, "prompts": PROMPTS, "height": 32, "width": 32, "num_inference_steps": 2}
        job = _submit(client, train_job(sample=sample))
        assert job["status"] == "succeeded", job.get("error")
        return job["id"]


def test_samples_are_listed_with_urls_and_served_as_png(diffusion_server: Server, lora_job: str) -> None:
    with diffusion_server.client() as client:
        samples = client.get(f"/v1/jobs/{lora_job}/samples").json()["data"]
        assert [(s["step"], s["prompt"]) for s in samples] == [(step, p) for step in (2, 4) for p in PROMPTS]
        first = samples[0]
        assert first["media_type"] == "image/png" and first["text"] is None
        assert first["url"] == f"/v1/jobs/{lora_job}/samples/files/samples/step-00000002/sample-00.png"
        image = client.get(first["url"])
        assert image.status_code == 200 and image.headers["content-type"] == "image/png"
        assert image.content.startswith(b"\x89PNG")
        # The checkpoint of the same step holds the same image as an artifact.
        checkpoint = client.get(f"/v1/jobs/{lora_job}/checkpoints").json()["data"][0]
        assert checkpoint["step"] == 2 and "sample-00.png" in {f["name"] for f in checkpoint["files"]}
        other = client.get(f"/v1/jobs/{lora_job}/samples/files/checkpoints/step-00000002/training_state.pt")
        assert other.status_code == 404
        assert other.json()["error"]["message"].startswith(f"Job {lora_job} has no sample file ")
        assert httpx.get(f"{diffusion_server.url}{first['url']}").status_code == 401


def test_the_job_page_shows_a_gallery_per_step(diffusion_server: Server, lora_job: str) -> None:
    from tests.service.dashboard.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, LAPTOP, MISSING, shot

    if MISSING:
        pytest.skip(MISSING)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport=LAPTOP, base_url=diffusion_server.url)
        context.add_init_script(f"sessionStorage.setItem('ferry.token', {TOKEN!r})")
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(f"/ui/#/jobs/{lora_job}")
        page.wait_for_selector('#samples .sample-step[data-step="4"] .sample-gallery img')
        steps = page.locator("#samples .sample-step").evaluate_all("els => els.map(e => e.dataset.step)")
        assert steps == ["4", "2"]  # newest first
        images = page.locator("#samples .sample-gallery img")
        assert images.count() == 4
        page.wait_for_function(
            "() => [...document.querySelectorAll('#samples .sample-gallery img')].every(i => i.naturalWidth === 32)"
        )
        captions = page.locator('#samples .sample-step[data-step="2"] figcaption').all_inner_texts()
        assert captions == PROMPTS
        shot(page, "job-samples")
        browser.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
