"""The launch interface the scheduler codes against; a Ray executor implements the same two protocols."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

StopKind = Literal["pause", "cancel"]


@dataclass(frozen=True)
class LaunchRequest:
    """Everything a job's process needs; plain data so it pickles into a spawned process or a Ray task."""

    job_id: str
    attempt: int
    spec_text: str
    output_dir: Path
    device: str | None  # GPU index to expose as CUDA_VISIBLE_DEVICES; None = CPU only
    db_path: Path  # where the process writes its events
    log_path: Path
    cpu_threads: int | None = None  # torch threads for a CPU job; None = torch's default
    model_roots: list[Path] = field(default_factory=list)
    data_roots: list[Path] = field(default_factory=list)
    cache_dir: Path | None = None  # what jobs with the same inputs share (DPO's reference log-probs)
    # The server's share of host_memory_budget for this slot: offload.host_memory_limit of a job that sets none.
    host_memory_limit: int | None = None


class RunHandle(Protocol):
    """A launched job. The scheduler polls it; it never blocks."""

    pid: int | None
    started_at: float | None  # the process's start time, to tell it from a reused pid after a restart

    def exit_code(self) -> int | None:
        """None while running; the exit code once it ended (negative: killed by that signal)."""

    def exit_reason(self) -> str | None:
        """Why it ended, when the exit code alone would mislead (a lost Ray node); None otherwise."""

    def request_stop(self, kind: StopKind) -> None:
        """Ask the job to stop at its next step: ``pause`` checkpoints first, ``cancel`` does not."""

    def kill(self) -> None:
        """Stop it now (SIGKILL for a local process)."""


class Executor(Protocol):
    """Starts jobs somewhere. Events come back through the store, whatever the executor."""

    def launch(self, request: LaunchRequest) -> RunHandle:
        """Start the job and return at once."""

    def keep_warm(self) -> None:
        """Called on every scheduler tick, after the queue was fed: start what the next jobs will want
        (a local slot's spare process); must return at once."""

    def close(self) -> None:
        """Release what the executor holds between jobs (spare processes, connections)."""

    def stop_orphan(self, pid: int | None, started_at: float | None, *, grace_s: float) -> None:
        """At start-up: end a job's process left running by a previous server (``pid``/``started_at`` as
        its handle reported them), giving it ``grace_s`` to finish the checkpoint it is writing."""
