"""A job's failure and log messages reach the user with paths as the spec wrote them, never the server's layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobs.events import LogEvent
from service.workers.executor import child
from service.workers.executor.base import LaunchRequest


class Sink:
    """The store's ``append_events``, kept in a list."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def append_events(self, job_id: str, attempt: int, events: list[Any]) -> None:
        self.events += events


def test_failed_and_log_messages_name_paths_relative_to_their_root(tmp_path: Path) -> None:
    models, data = tmp_path / "srv" / "models", tmp_path / "srv" / "datasets"
    request = LaunchRequest(
        job_id="job-paths", attempt=1, spec_text="", output_dir=tmp_path / "out", device=None,
        db_path=tmp_path / "ferry.sqlite3", log_path=tmp_path / "job.log",
        model_roots=[models], data_roots=[data],
    )  # fmt: skip
    sink = Sink()
    reporter = child.EventReporter(sink, request)
    reporter(LogEvent(level="warning", message=f"{models.resolve()}/llama has no generation_config.json"))
    reporter.failed(ValueError(f"'{data.resolve()}/chats/part-1.jsonl' row 25: field 'messages': is missing"))
    # Old code: the absolute paths under tmp_path, as the job's process resolved them.
    assert [e["message"] for e in sink.events] == [
        "llama has no generation_config.json",
        "'chats/part-1.jsonl' row 25: field 'messages': is missing",
    ]
