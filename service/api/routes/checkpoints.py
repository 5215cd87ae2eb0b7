"""/v1/jobs/{id}/checkpoints: list them (the best marked), download their files with SHA-256 and range
support, and merge a LoRA checkpoint into a full model downloadable as one archive."""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.datastructures import Headers
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.types import Receive, Scope, Send

from jobs.checkpoints.directory import EXPORTS_DIR, CheckpointInfo, best_checkpoint, file_sha256, list_checkpoints
from service.api.deps import SettingsDep, StoreDep
from service.api.errors import ApiError, error_response
from service.api.schemas import CheckpointFile, CheckpointPublic, CheckpointsPublic, ErrorBody, MergedPublic
from service.settings import Settings

log = logging.getLogger("ferry.api")
router = APIRouter(prefix="/jobs/{job_id}/checkpoints", tags=["checkpoints"])


@router.get("")
def list_job_checkpoints(job_id: str, store: StoreDep, settings: SettingsDep) -> CheckpointsPublic:
    """Every complete checkpoint of the job, oldest first, with each file's size and SHA-256."""
    store.get_job(job_id)
    checkpoints = _checkpoints(settings.job_dir(job_id))
    best = best_checkpoint(checkpoints)
    return CheckpointsPublic(data=[_public(job_id, c, best) for c in checkpoints])


@router.post("/{checkpoint}/merge", responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}})
def merge_checkpoint(job_id: str, checkpoint: str, store: StoreDep, settings: SettingsDep) -> MergedPublic:
    """Merge a LoRA checkpoint into its base model (peft's ``merge_and_unload``), saved with
    ``save_pretrained`` and packed as one ``.tar``; a second call answers with the archive already made.

    It runs in a process of its own (``python -m jobs merge``: torch, peft and the model stay out of the
    server), which this request waits for: a large model takes a while, and its weights' size in host
    memory."""
    store.get_job(job_id)
    found = _checkpoint(job_id, checkpoint, settings)
    archive = _merged_archive(settings.job_dir(job_id), checkpoint)
    if not archive.exists():
        _merge(Path(found.path), archive.with_suffix(""))
        archive.with_name(archive.name + ".sha256").write_text(file_sha256(archive))
    digest = archive.with_name(archive.name + ".sha256").read_text()
    url = f"/v1/jobs/{job_id}/checkpoints/{checkpoint}/merged"
    return MergedPublic(
        checkpoint=checkpoint,
        archive=CheckpointFile(name=archive.name, bytes=archive.stat().st_size, sha256=digest, url=url),
    )


@router.get(
    "/{checkpoint}/merged",
    response_class=FileResponse,
    responses={200: {"content": {"application/x-tar": {}}}, 404: {"model": ErrorBody}},
)
def download_merged(job_id: str, checkpoint: str, store: StoreDep, settings: SettingsDep) -> FileResponse:
    """The merged model of a checkpoint as one ``.tar`` (``Range`` supported); POST .../merge makes it."""
    store.get_job(job_id)
    _checkpoint(job_id, checkpoint, settings)
    archive = _merged_archive(settings.job_dir(job_id), checkpoint)
    if not archive.exists():
        raise ApiError(
            404,
            "not_found",
            f"Checkpoint {checkpoint!r} of job {job_id} has not been merged; POST "
            f"/v1/jobs/{job_id}/checkpoints/{checkpoint}/merge first.",
        )
    digest = archive.with_name(archive.name + ".sha256").read_text()
    headers = {"X-Checksum-SHA256": digest, "Cache-Control": "private, no-store"}
    return DownloadResponse(archive, filename=archive.name, headers=headers, media_type="application/x-tar")


@router.get(
    "/{checkpoint}/files/{name:path}",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
def download_checkpoint_file(
    job_id: str, checkpoint: str, name: str, store: StoreDep, settings: SettingsDep
) -> FileResponse:
    """One file; ``Range: bytes=...`` gives 206 partial content. ``X-Checksum-SHA256`` is of the whole file."""
    store.get_job(job_id)
    found = _checkpoint(job_id, checkpoint, settings)
    # Only names the manifest lists are served, so no path in the URL can reach another file.
    entry = next((f for f in found.files if f["name"] == name), None)
    if entry is None:
        raise ApiError(404, "not_found", f"Checkpoint {checkpoint!r} of job {job_id} has no file {name!r}.")
    digest = bytes.fromhex(entry["sha256"])
    headers = {
        "X-Checksum-SHA256": entry["sha256"],
        "Repr-Digest": f"sha-256=:{base64.b64encode(digest).decode()}:",  # RFC 9530
        "Cache-Control": "private, no-store",
    }
    return DownloadResponse(
        Path(found.path) / name, filename=Path(name).name, headers=headers, media_type="application/octet-stream"
    )


# HEAD: the size and checksum before a long download (its own operation id in the OpenAPI).
router.add_api_route(
    "/{checkpoint}/files/{name:path}",
    download_checkpoint_file,
    methods=["HEAD"],
    operation_id="head_checkpoint_file",
    response_class=FileResponse,
    summary="Download Checkpoint File's Headers",
)


class DownloadResponse(FileResponse):
    """A checkpoint file, whose refused ``Range`` headers answer in the JSON error envelope.

    Starlette answers a malformed or unsatisfiable range in plain text; the range is checked here first
    with its own parser, so the answer a client gets is the one every other error has.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        http_range = Headers(scope=scope).get("range")
        if http_range is not None and Headers(scope=scope).get("if-range") is None:
            size = os.stat(self.path).st_size
            try:
                self._parse_range_header(http_range, size)
            except MalformedRangeHeader as error:
                message = f"The Range header {http_range!r} is malformed ({error.content}); send e.g. 'bytes=0-1023'."
                return await error_response(400, "malformed_range", message)(scope, receive, send)
            except RangeNotSatisfiable:
                message = f"The Range header {http_range!r} lies outside the file's {size} bytes."
                headers = {"Content-Range": f"bytes */{size}"}
                return await error_response(416, "range_not_satisfiable", message, headers=headers)(
                    scope, receive, send
                )
        await super().__call__(scope, receive, send)


def _checkpoint(job_id: str, name: str, settings: Settings) -> CheckpointInfo:
    found = {c.name: c for c in _checkpoints(settings.job_dir(job_id))}.get(name)
    if found is None:
        raise ApiError(
            404, "not_found", f"Job {job_id} has no checkpoint {name!r}; GET /v1/jobs/{job_id}/checkpoints lists them."
        )
    return found


def _merge(checkpoint: Path, output: Path) -> None:
    """``python -m jobs merge``: the merged model in ``output`` and ``output.tar``; 422 when it cannot be."""
    command = [sys.executable, "-m", "jobs", "merge", str(checkpoint), "--output", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if done.returncode == 0:
        return
    said = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == 2 and said:  # the command's own refusal: its last line names what is wrong
        raise ApiError(422, "not_mergeable", said[-1])
    log.error("python -m jobs merge %s failed (exit code %s): %s", checkpoint, done.returncode, done.stderr[-4000:])
    raise RuntimeError(f"merging {checkpoint.name} failed (exit code {done.returncode}); see the server log")


def _merged_archive(job_dir: Path, checkpoint: str) -> Path:
    # The name comes from the checkpoint listing (step-NNNNNNNN), never from the URL as typed.
    return job_dir / "output" / EXPORTS_DIR / f"{checkpoint}-merged.tar"


def _checkpoints(job_dir: Path) -> list[CheckpointInfo]:
    output = job_dir / "output"
    return list_checkpoints(output) if output.exists() else []


def _public(job_id: str, info: CheckpointInfo, best: CheckpointInfo | None) -> CheckpointPublic:
    base = f"/v1/jobs/{job_id}/checkpoints/{info.name}/files"
    files = [
        CheckpointFile(name=f["name"], bytes=f["bytes"], sha256=f["sha256"], url=f"{base}/{f['name']}")
        for f in info.files
    ]
    return CheckpointPublic(
        name=info.name,
        step=info.step,
        created=info.created,
        files=files,
        eval_loss=info.eval_loss,
        best=best is not None and best.name == info.name,
    )
