"""A job's JSON answer, built once per change of its stored row rather than once per poll.

Every dashboard watching a job polls ``GET /v1/jobs/{id}`` (and the list) about once a second, and a
running job's row changes a few times a second at most (its progress is written in batches). The answer is
a function of the row alone, so while the row is unchanged the bytes built for it are served again: the
cost of a poll is then the row's read and one comparison of its values, not a record, a model, its
validation and its serialization (bench/profile_requests.py).

The answers live in the API process's event loop only (``read_job`` and ``list_jobs`` are ``async``), so
there is no lock.
"""

from __future__ import annotations

import sqlite3
from collections import OrderedDict

from service.api.schemas import JobPublic
from service.queue.records import JobRecord

MAX_CACHED_SPEC_CHARS = 64 * 1024  # a row with a larger spec is answered, but not kept


class JobAnswers:
    """The latest JSON answer per (job, include_spec), for the ``capacity`` most recently read jobs.

    Example:
        answers = JobAnswers()
        body = answers.json_of(store.get_job_row(job_id), include_spec=True)
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[tuple[str, bool], tuple[tuple[object, ...], bytes]] = OrderedDict()

    def json_of(self, row: sqlite3.Row, *, include_spec: bool) -> bytes:
        """``JobPublic.from_record`` of ``row`` as JSON; built again only when a value of the row changed."""
        key, values = (row["id"], include_spec), tuple(row)
        kept = self._kept.get(key)
        if kept is not None and kept[0] == values:
            self._kept.move_to_end(key)
            return kept[1]
        job = JobPublic.from_record(JobRecord.from_row(row), include_spec=include_spec)
        body = job.__pydantic_serializer__.to_json(job)
        if len(row["spec_text"]) + len(row["spec_json"]) <= MAX_CACHED_SPEC_CHARS:
            self._kept[key] = (values, body)
            self._kept.move_to_end(key)
            if len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        return body

    def page_json(self, rows: list[sqlite3.Row], next_cursor: int | None, *, include_spec: bool) -> bytes:
        """A ``JobsPublic`` page as JSON, from each job's answer."""
        cursor = b"null" if next_cursor is None else b'"%d"' % next_cursor
        jobs = b",".join(self.json_of(row, include_spec=include_spec) for row in rows)
        return b'{"data":[' + jobs + b'],"next_cursor":' + cursor + b"}"
