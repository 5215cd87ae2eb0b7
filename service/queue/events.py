"""The events the service itself writes into a job's event log, beside the job's own (jobs/events.py).

Every stored event is one of `StoredEvent`: the job process's typed events (``jobs.events.AnyJobEvent``, the
one list of them), a ``status`` change written by the one function that changes a job's status, or a
``stop_requested`` note. The events API publishes this union, so its schema names every field a client may read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from jobs.events import AnyJobEvent, ErrorCode
from service.queue.status import JobStatus


class JobError(BaseModel):
    """Why a job failed: a declared code and a sentence that names the fix where there is one."""

    code: ErrorCode
    message: str


class StatusEvent(BaseModel):
    """The job's status changed (written in the same transaction as the change)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["status"] = "status"
    status: JobStatus
    previous: JobStatus | None
    reason: str
    error: JobError | None = None


class StopRequestedEvent(BaseModel):
    """A user asked a running job to pause or cancel; the job acts on it between steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["stop_requested"] = "stop_requested"
    kind: Literal["pause", "cancel"]


# pydantic flattens the job events' own discriminated union into this one: one ``type`` tag picks any of them.
StoredEvent = Annotated[AnyJobEvent | StatusEvent | StopRequestedEvent, Field(discriminator="type")]
_STORED: TypeAdapter[Any] = TypeAdapter(StoredEvent)


def parse_stored_event(data: dict[str, Any]) -> BaseModel:
    """A stored event's typed model. Codes from before the error-code contract read as their new code."""
    return _STORED.validate_python(upgrade_stored_event(data))


def upgrade_stored_event(data: dict[str, Any]) -> dict[str, Any]:
    """A stored event's data with the codes of events from before the error-code contract as their new code."""
    if data.get("type") == "failed" and isinstance(data.get("error"), str):
        data = {**data, "error": ErrorCode.from_stored(data["error"]).value}
    error = data.get("error") if data.get("type") == "status" else None
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        data = {**data, "error": {**error, "code": ErrorCode.from_stored(error["code"]).value}}
    return data
