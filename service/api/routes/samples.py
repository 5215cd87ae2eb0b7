"""/v1/jobs/{id}/samples/files/...: the images a job generated (its ``sample`` events' artifacts)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from service.api.deps import SettingsDep, StoreDep
from service.api.errors import ApiError

router = APIRouter(prefix="/jobs/{job_id}/samples", tags=["events"])


def sample_url(job_id: str, artifact_path: str | None) -> str | None:
    """Where the API serves a sample's artifact (None for a text sample)."""
    return f"/v1/jobs/{job_id}/samples/files/{artifact_path}" if artifact_path else None


@router.get(
    "/files/{artifact_path:path}",
    response_class=FileResponse,
    responses={200: {"content": {"image/png": {}}}},
)
def read_sample_file(job_id: str, artifact_path: str, store: StoreDep, settings: SettingsDep) -> FileResponse:
    """One generated image. Only paths a ``sample`` event of the job names are served, so no URL reaches
    another file."""
    store.get_job(job_id)
    named = {
        e.data.get("artifact_path"): e.data.get("media_type")
        for e in store.list_events(job_id, limit=100_000, types=["sample"])
    }
    path = settings.job_dir(job_id) / "output" / artifact_path
    if artifact_path not in named or not path.is_file():
        raise ApiError(
            404,
            "not_found",
            f"Job {job_id} has no sample file {artifact_path!r}; GET /v1/jobs/{job_id}/samples lists them.",
        )
    return FileResponse(Path(path), media_type=named[artifact_path] or "application/octet-stream")
