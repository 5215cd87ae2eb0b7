"""/v1/files: upload (multipart as OpenAI's client sends it, or a raw body), list, read, download, delete.

An upload is streamed to ``<uploads>/<id>/<name>`` (a data root) with its SHA-256, under its own size limit
(``FERRY_MAX_UPLOAD_BYTES``). A ``fine-tune`` file's rows are checked before it is kept: a 422 names the first
bad row and field. The file stores the version of the rules that checked it; one checked by older rules is checked
again when it is read or a job names it (``uploads/recheck.py``). A spec names an upload by its id:
``data: {path: file-<hex>}``.
"""

from __future__ import annotations

import secrets
import sqlite3
from pathlib import Path
from typing import Annotated, Any, BinaryIO

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from jobs.fit.sizes import human_bytes
from service.api.deps import FilesDep, SettingsDep
from service.api.errors import ApiError
from service.api.openai.shapes import FileDeleted, FilePublic, FilesPublic
from service.api.routes.checkpoints import DownloadResponse
from service.api.schemas import ErrorBody
from service.queue.disk import free_bytes, refuse_if_disk_low
from service.queue.files import FileInUse, FileNotFound, FileRecord, FileStore
from service.queue.store import storable
from service.settings import Settings
from service.uploads.receive import UploadNoSpace, UploadTooLarge, UploadWriter, remove_upload, safe_name
from service.uploads.recheck import CHECKED_PURPOSE, recheck
from service.uploads.rows import RULES_VERSION, RowProblem, check_fine_tuning_rows

router = APIRouter(prefix="/files", tags=["files"])
PURPOSES = (CHECKED_PURPOSE, "user_data")  # fine-tune: rows checked on upload; user_data: kept as sent
CHUNK = 1 << 20
FILE_ID = r"^file-[0-9a-f]{1,64}$"
_ERRORS: dict[int | str, dict[str, Any]] = {404: {"model": ErrorBody}}
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(PURPOSES)},
                    },
                }
            },
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.post(
    "",
    status_code=201,
    openapi_extra=_UPLOAD_BODY,
    responses={413: {"model": ErrorBody}, 422: {"model": ErrorBody}, 507: {"model": ErrorBody}},
)
async def create_file(
    request: Request,
    settings: SettingsDep,
    files: FilesDep,
    filename: Annotated[str | None, Query(max_length=255, description="a raw body's file name")] = None,
    purpose: Annotated[str | None, Query(max_length=32, description="a raw body's purpose")] = None,
) -> FilePublic:
    """Upload a file: multipart with fields ``file`` and ``purpose`` (what ``client.files.create`` sends), or the
    raw bytes as the body with ``?filename=...&purpose=...``."""
    refuse_if_disk_low(settings.data_dir, settings.min_free_disk_bytes)
    try:
        writer = UploadWriter(settings.uploads_dir, settings.incoming_uploads_dir, limit=settings.max_upload_bytes)
    except OSError as error:  # not even an empty file fits
        raise _no_space(settings, 0) from error
    try:
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            filename, purpose = await _receive_form(request, writer)
        else:
            if not filename:
                raise ApiError(422, "invalid_request", "A raw upload needs ?filename=...; or send multipart/form-data.")
            async for chunk in request.stream():
                await run_in_threadpool(writer.write, chunk)
        purpose = _checked_purpose(purpose)
    except UploadTooLarge:
        writer.discard()
        raise ApiError(
            413,
            "body_too_large",
            f"The file is larger than {settings.max_upload_bytes} bytes; "
            "send a smaller file or raise FERRY_MAX_UPLOAD_BYTES.",
        ) from None
    except UploadNoSpace as full:
        writer.discard()
        raise _no_space(settings, full.size) from None
    except BaseException:
        writer.discard()
        raise
    file_id = f"file-{secrets.token_hex(12)}"
    name = safe_name(filename, suffix=".jsonl" if purpose == "fine-tune" else None)
    try:
        received = await run_in_threadpool(writer.commit, file_id, name)
    except UploadNoSpace as full:
        writer.discard()
        remove_upload(settings.uploads_dir, file_id)
        raise _no_space(settings, full.size) from None
    try:
        return await run_in_threadpool(_keep, files, file_id, filename or name, purpose, received, settings)
    except sqlite3.OperationalError as error:
        remove_upload(settings.uploads_dir, file_id)
        if "full" not in str(error):
            raise
        raise _no_space(settings, received.size) from None
    except BaseException:
        remove_upload(settings.uploads_dir, file_id)
        raise


@router.get("")
def list_files(
    files: FilesDep,
    purpose: Annotated[str | None, Query(max_length=32)] = None,
    after: Annotated[str | None, Query(pattern=FILE_ID, description="the last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> FilesPublic:
    """Uploaded files, newest first."""
    try:
        records, has_more = files.list(purpose=purpose, after=after, limit=limit)
    except FileNotFound as missing:
        raise ApiError(404, "not_found", str(missing)) from None
    return FilesPublic.of([FilePublic.from_record(r) for r in records], has_more)


@router.get("/{file_id}", responses=_ERRORS)
def read_file(file_id: str, files: FilesDep, settings: SettingsDep) -> FilePublic:
    """One file: name, purpose, size, SHA-256, and for a fine-tuning file its row layout and count. A fine-tuning
    file checked by older upload rules is checked by today's first (uploads/recheck.py): ``status`` is
    ``processed`` where it passes, ``error`` (``status_details`` names the row and field) where it does not."""
    record = _found(files, file_id)
    try:
        record = recheck(files, record, uploads_dir=settings.uploads_dir, max_line_bytes=settings.max_upload_line_bytes)
    except FileNotFound as missing:  # deleted while it was read
        raise ApiError(404, "not_found", str(missing)) from None
    return FilePublic.from_record(record)


@router.get(
    "/{file_id}/content",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, **_ERRORS},
)
def download_file(file_id: str, files: FilesDep, settings: SettingsDep) -> FileResponse:
    """The file's bytes as uploaded (``X-Checksum-SHA256`` is their SHA-256); ``Range: bytes=...`` gives 206.

    The file is opened before any header is sent and streamed from that handle: one deleted in between is a
    404, one deleted while it streams still arrives whole (the open handle keeps its bytes)."""
    record = _found(files, file_id)
    handle = _open(settings.uploads_dir / record.path, file_id)
    headers = {"X-Checksum-SHA256": record.sha256, "Cache-Control": "private, no-store"}
    return DownloadResponse(handle, filename=record.filename, headers=headers, media_type="application/octet-stream")


@router.delete("/{file_id}", responses={**_ERRORS, 409: {"model": ErrorBody}})
def delete_file(file_id: str, files: FilesDep, settings: SettingsDep) -> FileDeleted:
    """Delete a file and its bytes; 409 while a queued, running, paused or interrupted job names it."""
    try:
        files.delete(file_id, directory=(settings.uploads_dir / file_id).resolve())
    except FileNotFound as missing:
        raise ApiError(404, "not_found", str(missing)) from None
    except FileInUse as in_use:
        raise ApiError(409, "file_in_use", str(in_use)) from None
    remove_upload(settings.uploads_dir, file_id)
    return FileDeleted(id=file_id)


async def _receive_form(request: Request, writer: UploadWriter) -> tuple[str | None, str | None]:
    """Copy the form's ``file`` into ``writer``; returns its file name and the ``purpose`` field."""
    async with request.form(max_files=1, max_fields=16) as form:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise ApiError(422, "invalid_request", "The form has no file field 'file'; send the file as 'file'.")
        while chunk := await upload.read(CHUNK):
            await run_in_threadpool(writer.write, chunk)
        return upload.filename, purpose if isinstance(purpose, str) else None


def _checked_purpose(purpose: str | None) -> str:
    if purpose not in PURPOSES:
        raise ApiError(422, "invalid_request", f"purpose must be one of {', '.join(PURPOSES)}; got {purpose!r}.")
    return purpose


def _keep(files: FileStore, file_id: str, filename: str, purpose: str, received: Any, settings: Settings) -> FilePublic:
    """Check a fine-tuning file's rows (422 naming the first bad one), then record the file."""
    checked = None
    if purpose == CHECKED_PURPOSE:
        try:
            checked = check_fine_tuning_rows(received.path, max_line_bytes=settings.max_upload_line_bytes)
        except RowProblem as problem:
            raise ApiError(
                422,
                "invalid_file",
                f"{filename} {problem}",
                problems=[{"path": problem.field, "message": problem.message, "line": problem.row, "suggestion": None}],
            ) from None
    record = files.add(
        file_id=file_id,
        filename=storable(filename[:255]),  # a lone surrogate from the query string stored would fail every answer
        purpose=purpose,
        size=received.size,
        sha256=received.sha256,
        path=str(received.path.relative_to(received.path.parents[1])),
        format=checked.format if checked else None,
        rows=checked.rows if checked else None,
        rules_version=RULES_VERSION if checked else None,
    )
    return FilePublic.from_record(record)


def _open(path: Path, file_id: str) -> BinaryIO:
    """The upload's bytes, opened before any header is sent; gone (deleted meanwhile, or removed from the disk
    by hand) is a 404."""
    try:
        return path.open("rb")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise ApiError(
            404,
            "not_found",
            f"File {file_id} is listed but its bytes are no longer on disk (deleted, or removed from "
            f"{path.parent}); upload it again.",
        ) from None


def _no_space(settings: Settings, received: int) -> ApiError:
    """507: the disk holding the uploads filled up; says how much is free and what to do."""
    directory = settings.uploads_dir
    try:
        free = human_bytes(free_bytes(directory))
    except OSError:
        free = "an unknown amount"
    return ApiError(
        507,
        "insufficient_storage",
        f"The disk holding {directory.resolve()} ran out of space after {human_bytes(received)} of the upload; "
        f"it has {free} free. Free space on that disk (delete files or finished jobs) and upload again.",
    )


def _found(files: FileStore, file_id: str) -> FileRecord:
    try:
        return files.get(file_id)
    except FileNotFound as missing:
        raise ApiError(404, "not_found", str(missing)) from None
