"""/v1/jobs/{id}/checkpoints: list them (the best marked, the damaged named with why), download their files
with SHA-256 and range support or a whole checkpoint as one tar, merge a LoRA checkpoint into a full model
downloadable as one archive, and write one as a GGUF file (llama.cpp, Ollama, LM Studio) with its Modelfile.

Every download opens its files before the headers are sent and streams from the open handles: a checkpoint
pruned by ``checkpoint.keep_last`` or deleted mid-download still arrives whole, and one already gone is a 404.
"""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import BinaryIO

import anyio
from fastapi import APIRouter
from fastapi.responses import FileResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.types import Receive, Scope, Send

from jobs.checkpoints.archive import ArchiveMismatch, archive_sha256, open_archive
from jobs.checkpoints.directory import (
    EXPORTS_DIR,
    CheckpointInfo,
    CheckpointScan,
    DamagedCheckpoint,
    best_checkpoint,
    file_sha256,
    is_mergeable,
    scan_checkpoints,
)
from jobs.checkpoints.gguf_quants import QUANTS, check_quant
from service.api.deps import SettingsDep, StoreDep
from service.api.errors import ApiError, error_response
from service.api.merged_archives import merged_archive_sha256
from service.api.schemas import (
    CheckpointFile,
    CheckpointPublic,
    CheckpointsPublic,
    ErrorBody,
    GgufPublic,
    MergedPublic,
)
from service.settings import Settings

log = logging.getLogger("ferry.api")
router = APIRouter(prefix="/jobs/{job_id}/checkpoints", tags=["checkpoints"])


@router.get("")
def list_job_checkpoints(job_id: str, store: StoreDep, settings: SettingsDep) -> CheckpointsPublic:
    """Every complete checkpoint of the job, oldest first, with each file's size and SHA-256."""
    model_kind = store.get_job(job_id).spec.get("model", {}).get("kind")
    scan = _scan(settings.job_dir(job_id))
    best = best_checkpoint(scan.valid)
    exports = settings.job_dir(job_id) / "output" / EXPORTS_DIR
    listed = [_public(job_id, c, best, exports, model_kind) for c in scan.valid] + [_damaged(d) for d in scan.damaged]
    return CheckpointsPublic(data=sorted(listed, key=lambda c: (c.step, c.name)))


@router.post("/{checkpoint}/merge", responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}})
def merge_checkpoint(job_id: str, checkpoint: str, store: StoreDep, settings: SettingsDep) -> MergedPublic:
    """Merge a LoRA checkpoint into its base model (peft's ``merge_and_unload``), saved with
    ``save_pretrained`` and packed as one ``.tar``; a second call answers with the archive already made.

    It runs in a process of its own (``python -m jobs merge``: torch, peft and the model stay out of the
    server), which this request waits for: a large model takes a while, and its weights' size in host
    memory. Requests for a checkpoint being merged wait for that merge and answer with its result."""
    store.get_job(job_id)
    found = _checkpoint(job_id, checkpoint, settings)
    archive = _merged_archive(settings.job_dir(job_id), checkpoint)

    def merge() -> None:
        if not all((Path(found.path) / f["name"]).is_file() for f in found.files):
            raise _gone(f"A file of checkpoint {checkpoint!r} of job {job_id}")
        _merge(Path(found.path), archive.with_suffix(""))

    # One merge per checkpoint: concurrent requests wait for it and answer with its archive (or its error).
    digest = merged_archive_sha256(archive, merge)
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
    what = f"The merged model of checkpoint {checkpoint!r} of job {job_id}"
    handle = _open(archive, what)
    try:
        digest = merged_archive_sha256(archive)  # computed again if its record is missing or empty
    except FileNotFoundError as error:  # deleted since it was opened
        handle.close()
        raise _gone(what) from error
    except BaseException:
        handle.close()
        raise
    headers = {"X-Checksum-SHA256": digest, "Cache-Control": "private, no-store"}
    return DownloadResponse(handle, filename=archive.name, headers=headers, media_type="application/x-tar")


@router.post("/{checkpoint}/gguf", responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}})
def export_checkpoint_gguf(
    job_id: str, checkpoint: str, store: StoreDep, settings: SettingsDep, quant: str = "f16"
) -> GgufPublic:
    """Write the checkpoint as one GGUF file of ``quant`` (f32, f16, bf16, q8_0, q4_k_m), a LoRA one merged into its base
    first, with an Ollama ``Modelfile`` beside it; a second call answers with the file already made.

    It runs in a process of its own (``python -m jobs export``), which this request waits for."""
    store.get_job(job_id)
    quant = _quant(quant)
    found = _checkpoint(job_id, checkpoint, settings)
    path = _gguf_path(settings.job_dir(job_id), checkpoint, quant)
    if not path.exists():
        if not all((Path(found.path) / f["name"]).is_file() for f in found.files):
            raise _gone(f"A file of checkpoint {checkpoint!r} of job {job_id}")
        _run_export(Path(found.path), path, quant)
        path.with_name(path.name + ".sha256").write_text(file_sha256(path))
    url = f"/v1/jobs/{job_id}/checkpoints/{checkpoint}/gguf?quant={quant}"
    modelfile = path.with_suffix(".Modelfile")
    return GgufPublic(
        checkpoint=checkpoint,
        quant=quant,
        gguf=CheckpointFile(
            name=path.name,
            bytes=path.stat().st_size,
            sha256=path.with_name(path.name + ".sha256").read_text(),
            url=url,
        ),
        modelfile=CheckpointFile(
            name=modelfile.name,
            bytes=modelfile.stat().st_size,
            sha256=file_sha256(modelfile),
            url=f"/v1/jobs/{job_id}/checkpoints/{checkpoint}/gguf/modelfile?quant={quant}",
        ),
    )


@router.get(
    "/{checkpoint}/gguf",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, 404: {"model": ErrorBody}},
)
def download_gguf(
    job_id: str, checkpoint: str, store: StoreDep, settings: SettingsDep, quant: str = "f16"
) -> FileResponse:
    """The checkpoint's GGUF file of ``quant`` (``Range`` supported); POST .../gguf?quant=... makes it."""
    path = _made_gguf(job_id, checkpoint, store, settings, quant)
    handle = _open(path, f"The GGUF file of checkpoint {checkpoint!r} of job {job_id}")
    digest = path.with_name(path.name + ".sha256").read_text()
    headers = {"X-Checksum-SHA256": digest, "Cache-Control": "private, no-store"}
    return DownloadResponse(handle, filename=path.name, headers=headers, media_type="application/octet-stream")


@router.get("/{checkpoint}/gguf/modelfile", response_class=FileResponse, responses={404: {"model": ErrorBody}})
def download_modelfile(
    job_id: str, checkpoint: str, store: StoreDep, settings: SettingsDep, quant: str = "f16"
) -> FileResponse:
    """The Ollama Modelfile written beside the GGUF file (``ollama create NAME -f FILE`` beside the .gguf)."""
    path = _made_gguf(job_id, checkpoint, store, settings, quant).with_suffix(".Modelfile")
    handle = _open(path, f"The Modelfile of checkpoint {checkpoint!r} of job {job_id}")
    return DownloadResponse(handle, filename=path.name, headers={}, media_type="text/plain")


@router.get(
    "/{checkpoint}/archive",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}}, 404: {"model": ErrorBody}, 409: {"model": ErrorBody}},
)
def download_checkpoint_archive(
    job_id: str, checkpoint: str, store: StoreDep, settings: SettingsDep
) -> StreamingResponse:
    """The whole checkpoint as one uncompressed tar (``step-00000010/manifest.json`` first, then every file it
    lists), with ``Content-Length`` and the archive's SHA-256 in ``X-Checksum-SHA256`` and ``Repr-Digest``.

    The tar is deterministic, so its SHA-256 is known before the body: the first request for a checkpoint
    reads it once to compute it (kept under ``exports/``), later ones send at once. No ``Range``.
    """
    store.get_job(job_id)
    found = _checkpoint(job_id, checkpoint, settings)
    try:
        archive = open_archive(found)
    except FileNotFoundError as error:
        raise _gone(f"A file of checkpoint {checkpoint!r} of job {job_id}") from error
    except ArchiveMismatch as error:
        raise ApiError(409, "checkpoint_damaged", f"Checkpoint {checkpoint!r} of job {job_id}: {error}.") from error
    try:
        digest = archive_sha256(archive, settings.job_dir(job_id) / "output" / EXPORTS_DIR)
    except BaseException:
        archive.close()
        raise
    headers = {
        "Content-Length": str(archive.size),
        "Content-Disposition": f'attachment; filename="{archive.filename}"',
        "Cache-Control": "private, no-store",
        **_digest_headers(digest),
    }
    return StreamingResponse(
        archive.chunks(), media_type="application/x-tar", headers=headers, background=BackgroundTask(archive.close)
    )


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
    handle = _open(Path(found.path) / name, f"File {name!r} of checkpoint {checkpoint!r} of job {job_id}")
    headers = {**_digest_headers(entry["sha256"]), "Cache-Control": "private, no-store"}
    return DownloadResponse(handle, filename=Path(name).name, headers=headers, media_type="application/octet-stream")


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
    """A file opened before the response began, whose refused ``Range`` headers answer in the JSON error
    envelope.

    The body is read from the open handle, never reopened by path: a file unlinked after the route opened
    it (a checkpoint pruned or deleted mid-download) still streams whole. Starlette answers a malformed or
    unsatisfiable range in plain text; the range is checked here first with its own parser, so the answer a
    client gets is the one every other error has.
    """

    def __init__(self, handle: BinaryIO, *, filename: str, headers: dict[str, str], media_type: str) -> None:
        stat_result = os.fstat(handle.fileno())
        super().__init__(
            handle.name, filename=filename, headers=headers, media_type=media_type, stat_result=stat_result
        )
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # No http.response.pathsend: the server would reopen the file by its path.
        extensions = {k: v for k, v in scope.get("extensions", {}).items() if k != "http.response.pathsend"}
        try:
            await self._send(dict(scope, extensions=extensions), receive, send)
        finally:
            self.handle.close()

    async def _send(self, scope: Scope, receive: Receive, send: Send) -> None:
        http_range = Headers(scope=scope).get("range")
        if http_range is not None and Headers(scope=scope).get("if-range") is None:
            size = self.stat_result.st_size if self.stat_result is not None else 0
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

    @asynccontextmanager
    async def _open_file(self) -> AsyncIterator[anyio.AsyncFile[bytes]]:
        # Starlette's FileResponse reads its body through this; the handle stays open for the next range.
        await anyio.to_thread.run_sync(self.handle.seek, 0)
        yield anyio.wrap_file(self.handle)


def _open(path: Path, what: str) -> BinaryIO:
    """Open a file to send, before any header is: one that is gone is a 404, not a broken body."""
    try:
        return path.open("rb")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as error:
        raise _gone(what) from error


def _gone(what: str) -> ApiError:
    return ApiError(
        404,
        "not_found",
        f"{what} is listed but no longer on disk: pruned by checkpoint.keep_last, or deleted; "
        "list the checkpoints again.",
    )


def _digest_headers(sha256: str) -> dict[str, str]:
    digest = base64.b64encode(bytes.fromhex(sha256)).decode()
    return {"X-Checksum-SHA256": sha256, "Repr-Digest": f"sha-256=:{digest}:"}  # RFC 9530


def _checkpoint(job_id: str, name: str, settings: Settings) -> CheckpointInfo:
    scan = _scan(settings.job_dir(job_id))
    found = {c.name: c for c in scan.valid}.get(name)
    damaged = {c.name: c for c in scan.damaged}.get(name)
    if damaged is not None:
        raise ApiError(409, "checkpoint_damaged", f"Checkpoint {name!r} of job {job_id} is damaged: {damaged.reason}")
    if found is None:
        raise ApiError(
            404, "not_found", f"Job {job_id} has no checkpoint {name!r}; GET /v1/jobs/{job_id}/checkpoints lists them."
        )
    return found


def _merge(checkpoint: Path, output: Path) -> None:
    """``python -m jobs merge``: the merged model in ``output`` and ``output.tar``; 422 when it cannot be."""
    _run_jobs_command(
        ["merge", str(checkpoint), "--output", str(output)], "not_mergeable", f"merging {checkpoint.name}"
    )


def _run_jobs_command(arguments: list[str], refused: str, doing: str) -> None:
    """``python -m jobs ARGUMENTS`` in a process of its own (torch and the model stay out of the server).

    Its own refusal (exit code 2, the problem on its last stderr line) is a 422 of code ``refused`` with that
    line; any other failure is logged with its stderr and answered as a 500 naming ``doing``."""
    command = [sys.executable, "-m", "jobs", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if done.returncode == 0:
        return
    said = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == 2 and said:
        raise ApiError(422, refused, said[-1])
    log.error("python -m jobs %s failed (exit code %s): %s", " ".join(arguments), done.returncode, done.stderr[-4000:])
    raise RuntimeError(f"{doing} failed (exit code {done.returncode}); see the server log")


def _quant(quant: str) -> str:
    try:
        return check_quant(quant)
    except ValueError as error:
        raise ApiError(422, "bad_quant", f"quant: {error}") from None


def _made_gguf(job_id: str, checkpoint: str, store: StoreDep, settings: Settings, quant: str) -> Path:
    store.get_job(job_id)
    quant = _quant(quant)
    _checkpoint(job_id, checkpoint, settings)
    path = _gguf_path(settings.job_dir(job_id), checkpoint, quant)
    if not path.exists():
        raise ApiError(
            404,
            "not_found",
            f"Checkpoint {checkpoint!r} of job {job_id} has no {quant} GGUF file; POST "
            f"/v1/jobs/{job_id}/checkpoints/{checkpoint}/gguf?quant={quant} first.",
        )
    return path


def _run_export(checkpoint: Path, output: Path, quant: str) -> None:
    """``python -m jobs export``: the GGUF at ``output`` and its Modelfile; 422 when it cannot be."""
    arguments = ["export", str(checkpoint), "--quant", quant, "--output", str(output)]
    _run_jobs_command(arguments, "not_exportable", f"exporting {checkpoint.name}")


def _gguf_path(job_dir: Path, checkpoint: str, quant: str) -> Path:
    # Both names are checked ones (the checkpoint listing's, check_quant's), never the URL as typed.
    return job_dir / "output" / EXPORTS_DIR / f"{checkpoint}-{quant}.gguf"


def _merged_archive(job_dir: Path, checkpoint: str) -> Path:
    # The name comes from the checkpoint listing (step-NNNNNNNN), never from the URL as typed.
    return job_dir / "output" / EXPORTS_DIR / f"{checkpoint}-merged.tar"


def _scan(job_dir: Path) -> CheckpointScan:
    output = job_dir / "output"
    return scan_checkpoints(output) if output.exists() else CheckpointScan([], [])


def _exports(job_id: str, checkpoint: str, exports: Path) -> list[CheckpointFile]:
    """The finished exports of a checkpoint (a merged .tar, GGUF files, Modelfiles) with their download urls.

    Only a file whose ``.sha256`` is written counts as finished: an export under way, or one a crash cut
    short, is not listed (the exporters write their files whole, then the checksum)."""
    base = f"/v1/jobs/{job_id}/checkpoints/{checkpoint}"
    found = []
    merged = _merged_archive(exports.parent.parent, checkpoint)
    if merged.is_file() and merged.with_name(merged.name + ".sha256").is_file():
        found.append(_export_file(merged, f"{base}/merged"))
    for quant in QUANTS:
        path = _gguf_path(exports.parent.parent, checkpoint, quant)
        if path.is_file() and path.with_name(path.name + ".sha256").is_file():
            found.append(_export_file(path, f"{base}/gguf?quant={quant}"))
            modelfile = path.with_suffix(".Modelfile")
            if modelfile.is_file():
                found.append(_export_file(modelfile, f"{base}/gguf/modelfile?quant={quant}", file_sha256(modelfile)))
    return found


def _export_file(path: Path, url: str, sha256: str | None = None) -> CheckpointFile:
    try:
        digest = sha256 or path.with_name(path.name + ".sha256").read_text().strip()
        size = path.stat().st_size
    except FileNotFoundError:  # deleted between the check and now: listed with what is known
        digest, size = sha256 or "", 0
    return CheckpointFile(name=path.name, bytes=size, sha256=digest, url=url)


def _public(
    job_id: str, info: CheckpointInfo, best: CheckpointInfo | None, exports: Path, model_kind: str | None
) -> CheckpointPublic:
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
        exports=_exports(job_id, info.name, exports) if exports.is_dir() else [],
        mergeable=is_mergeable((f["name"] for f in info.files), model_kind),
    )


def _damaged(info: DamagedCheckpoint) -> CheckpointPublic:
    return CheckpointPublic(name=info.name, step=info.step or 0, created=None, files=[], damaged=info.reason)
