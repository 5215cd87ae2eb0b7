"""/v1/jobs/{id}/events, its live stream, the per-step metrics series and the job's log."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import APIRouter, Header, Query
from fastapi.responses import PlainTextResponse
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from service.api.deps import SettingsDep, StoreDep
from service.api.errors import INT64_MAX, ApiError
from service.api.routes.samples import sample_url
from service.api.schemas import (
    EvalPoint,
    EventPublic,
    EventsPublic,
    MetricPoint,
    MetricsPublic,
    SamplePoint,
    SamplesPublic,
)
from service.queue.records import EventRecord
from service.queue.store import JobNotFound, JobStore

router = APIRouter(prefix="/jobs/{job_id}", tags=["events"])

HEARTBEAT_S = 15.0
POLL_S = 0.25
RETRY_MS = 2000  # how long a browser waits before it reconnects (with Last-Event-ID)
SEND_TIMEOUT_S = 30.0  # a client that reads nothing for this long is let go (its buffers are full)
SEP = "\n"  # between the lines of an event; sse-starlette's default is CRLF
SHUTDOWN_GRACE_S = 2.0  # for a stream to finish the batch it is sending when the server stops
CATCH_UP_BATCH, CATCH_UP_PAUSE_S = 200, 0.02  # a replay runs at most 10k events/s per stream


@router.get("/events")
def list_events(
    job_id: str,
    store: StoreDep,
    after: Annotated[int, Query(ge=0, le=INT64_MAX, description="the last event id you have")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    exclude: Annotated[list[str] | None, Query(description="event types to leave out, e.g. step; may repeat")] = None,
) -> EventsPublic:
    """Stored events, oldest first, from after the cursor."""
    page, has_more = _page_of_events(store, job_id, after=after, limit=limit, exclude_types=exclude)
    return EventsPublic(
        data=[EventPublic.from_record(e) for e in page],
        next_cursor=page[-1].id if page else after,
        has_more=has_more,
    )


def _page_of_events(
    store: JobStore,
    job_id: str,
    *,
    after: int,
    limit: int,
    types: list[str] | None = None,
    exclude_types: list[str] | None = None,
) -> tuple[list[EventRecord], bool]:
    """Up to ``limit`` of the job's events after the cursor, and whether more follow; 404 for an unknown job."""
    store.get_job(job_id)
    events = store.list_events(job_id, after=after, limit=limit + 1, types=types, exclude_types=exclude_types)
    return events[:limit], len(events) > limit


@router.get(
    "/events/stream", response_class=EventSourceResponse, responses={200: {"content": {"text/event-stream": {}}}}
)
async def stream_events(
    job_id: str,
    store: StoreDep,
    after: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
    last_event_id: Annotated[str | None, Header(description="the id of the last event received")] = None,
) -> EventSourceResponse:
    """Server-sent events; a reconnecting client sends ``Last-Event-ID`` and misses nothing.

    sse-starlette runs the stream: keep-alive comments, the client's disconnect, a client that stops reading
    (let go after SEND_TIMEOUT_S) and the server's shutdown, on which every stream ends at once as a complete
    response (it was cut off mid-body when uvicorn's shutdown grace ran out).
    """
    await run_in_threadpool(store.get_job, job_id)
    start = after if last_event_id is None else _event_id(last_event_id)
    shutdown = anyio.Event()  # set by sse-starlette when the server stops: the stream then ends by itself
    return EventSourceResponse(
        _sse(store, job_id, start, shutdown),
        shutdown_event=shutdown,
        shutdown_grace_period=SHUTDOWN_GRACE_S,
        ping=HEARTBEAT_S,
        ping_message_factory=lambda: ServerSentEvent(comment="keep-alive", sep=SEP),
        sep=SEP,
        send_timeout=SEND_TIMEOUT_S,
    )


def _event_id(header: str) -> int:
    """``Last-Event-ID`` as an event id; anything but one the stream sent is the client's mistake."""
    if re.fullmatch(r"[0-9]{1,19}", header.strip()) and int(header) <= INT64_MAX:
        return int(header)
    raise ApiError(
        422,
        "invalid_request",
        f"The request is invalid: header.last-event-id: must be the id of an event this stream sent; got {header!r}.",
    )


def _render_batch(store: JobStore, job_id: str, after: int) -> tuple[bytes, int, int]:
    """The next events after ``after`` as SSE bytes, how many, and the last id."""
    events = store.list_events(job_id, after=after, limit=CATCH_UP_BATCH)
    text = b"".join(
        ServerSentEvent(EventPublic.from_record(e).model_dump_json(), id=str(e.id), event=e.type, sep=SEP).encode()
        for e in events
    )
    return text, len(events), events[-1].id if events else after


async def _sse(
    store: JobStore, job_id: str, after: int, shutdown: anyio.Event
) -> AsyncIterator[ServerSentEvent | bytes]:
    yield ServerSentEvent(retry=RETRY_MS, sep=SEP)
    # On shutdown the stream just ends, as a complete response; the browser reconnects with Last-Event-ID.
    while not shutdown.is_set():
        # Read and render in the thread pool: the event loop only passes the bytes on, so a long catch-up
        # never holds it for the time of a batch.
        text, count, after = await run_in_threadpool(_render_batch, store, job_id, after)
        if count:
            yield text
            if count == CATCH_UP_BATCH:
                # Far behind (a replay from an old id): one stream catching up must not crowd out every
                # other request's turn in the event loop and the thread pool.
                await asyncio.sleep(CATCH_UP_PAUSE_S)
            continue
        try:
            job = await run_in_threadpool(store.get_job, job_id)
        except JobNotFound:  # deleted while we streamed
            yield ServerSentEvent(json.dumps({"status": "deleted"}), event="end", sep=SEP)
            return
        if job.status.is_finished:  # everything is out; the client may close
            yield ServerSentEvent(json.dumps({"status": job.status.value}), event="end", sep=SEP)
            return
        with anyio.move_on_after(POLL_S):
            await shutdown.wait()


@router.get("/metrics")
def read_metrics(
    job_id: str,
    store: StoreDep,
    after: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 2_000,
) -> MetricsPublic:
    """One point per step: loss, learning rate, throughput, GPU/host/pinned memory, offload figures; and
    ``eval``: each evaluation (eval loss, perplexity) in the same range of event ids. A step an attempt
    re-ran (after resuming from an earlier checkpoint) shows the latest attempt's point."""
    page, has_more = _page_of_events(store, job_id, after=after, limit=limit, types=["step"])
    superseded = _superseded_from(store, job_id)
    points = [
        MetricPoint(**e.data, event_id=e.id, time=e.created_at)
        for e in page
        if e.data["step"] <= superseded.get(e.attempt, e.data["step"])
    ]
    # Evaluations up to the page's last step while more steps follow, else all of them (a final eval comes
    # after the last step): the cursor then moves past the last eval too, and none is served twice.
    evals = store.list_events(job_id, after=after, limit=limit, types=["eval"])
    if has_more:
        evals = [e for e in evals if e.id <= page[-1].id]
    eval_points = [EvalPoint(**e.data, event_id=e.id, time=e.created_at) for e in evals]
    last = max([after, *(e.id for e in page), *(e.id for e in evals)])
    return MetricsPublic(data=points, eval=eval_points, next_cursor=last, has_more=has_more)


@router.get("/samples")
def read_samples(
    job_id: str,
    store: StoreDep,
    after: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> SamplesPublic:
    """Generated samples, oldest first: the step, the prompt and the model's (greedy) completion, or the
    image it generated (``url``: the PNG; a diffusion job's gallery, one image per prompt and step)."""
    page, has_more = _page_of_events(store, job_id, after=after, limit=limit, types=["sample"])
    samples = [
        SamplePoint(**e.data, event_id=e.id, time=e.created_at, url=sample_url(job_id, e.data.get("artifact_path")))
        for e in page
    ]
    return SamplesPublic(data=samples, next_cursor=page[-1].id if page else after, has_more=has_more)


def _superseded_from(store: JobStore, job_id: str) -> dict[int, int]:
    """For each attempt, the last of its steps no later attempt re-ran: a later attempt that resumed from
    step k re-ran every step after k (one that started afresh, all of them)."""
    starts = store.list_events(job_id, limit=100_000, types=["started"])
    limits: dict[int, int] = {}
    for earlier in {e.attempt for e in starts}:
        later = [e.data.get("resumed_from_step") or 0 for e in starts if e.attempt > earlier]
        if later:
            limits[earlier] = min(later)
    return limits


@router.get("/logs", response_class=PlainTextResponse)
def read_logs(
    job_id: str,
    store: StoreDep,
    settings: SettingsDep,
    tail_bytes: Annotated[int, Query(ge=1, le=16 << 20)] = 256 << 10,
) -> PlainTextResponse:
    """The end of the job's log file (all attempts), as plain text."""
    store.get_job(job_id)
    path = settings.job_dir(job_id) / "job.log"
    if not path.exists():
        return PlainTextResponse("")
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - tail_bytes))
        return PlainTextResponse(f.read().decode("utf-8", errors="replace"))
