"""Job statuses and the transitions allowed between them."""

from __future__ import annotations

from enum import Enum


class JobStatus(str, Enum):
    """Where a job is in its life. ``interrupted``: its process vanished; it is requeued if retries remain."""

    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})

# The whole state machine. Anything not listed here is refused by JobStore.transition.
ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.PAUSED, JobStatus.CANCELLED}),
    JobStatus.RUNNING: frozenset(
        {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.PAUSED, JobStatus.INTERRUPTED}
    ),
    JobStatus.PAUSED: frozenset({JobStatus.QUEUED, JobStatus.CANCELLED}),
    JobStatus.INTERRUPTED: frozenset({JobStatus.QUEUED, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.FAILED: frozenset({JobStatus.QUEUED}),  # resume after a failure, from the last checkpoint
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


class JobAction(str, Enum):
    """What a user may ask of a job (``POST /v1/jobs/{id}/<action>``, ``DELETE`` for delete)."""

    PAUSE = "pause"
    RESUME = "resume"
    CANCEL = "cancel"
    DELETE = "delete"


# The status each action moves a job to, and the word for the 409 sentence. With ALLOWED, the only table of
# what can be done from where: the API's ``allowed_actions`` and the dashboard's buttons are read from it.
ACTION_TARGETS: dict[JobAction, tuple[JobStatus, str]] = {
    JobAction.PAUSE: (JobStatus.PAUSED, "paused"),
    JobAction.RESUME: (JobStatus.QUEUED, "resumed"),
    JobAction.CANCEL: (JobStatus.CANCELLED, "cancelled"),
}
_ACTIONS = {target: word for target, word in ACTION_TARGETS.values()}


def allowed_actions(status: JobStatus, stop_request: str | None = None) -> list[JobAction]:
    """The actions that change a job in ``status`` (a running job pauses and cancels by request).

    While a running job winds down after a request, only a cancel still changes anything: it overrides
    a pause, and nothing overrides a cancel.
    """
    actions = [action for action, (target, _) in ACTION_TARGETS.items() if target in ALLOWED[status]]
    if status is JobStatus.RUNNING and stop_request is not None:
        actions = [JobAction.CANCEL] if stop_request == "pause" else []
    return [*actions, JobAction.DELETE] if status in FINISHED else actions


class IllegalTransition(Exception):
    """A status change the state machine does not allow; the message is a sentence for the user."""

    def __init__(self, job_id: str, current: JobStatus, target: JobStatus, message: str | None = None) -> None:
        self.job_id, self.current, self.target = job_id, current, target
        super().__init__(message or illegal_transition_message(job_id, current, target))


def illegal_transition_message(job_id: str, current: JobStatus, target: JobStatus) -> str:
    action = _ACTIONS.get(target, f"moved to {target.value}")
    allowed = [s.value for s in JobStatus if target in ALLOWED[s]]
    return f"Job {job_id} is {current.value} and cannot be {action}; only a {_or(allowed)} job can be {action}."


def deletion_refused_message(job_id: str, current: JobStatus) -> str:
    finished = [s.value for s in JobStatus if s in FINISHED]
    return (
        f"Job {job_id} is {current.value} and cannot be deleted; only a {_or(finished)} job can be "
        "deleted. Cancel it first."
    )


def _or(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def check_transition(job_id: str, current: JobStatus, target: JobStatus) -> None:
    """Raise ``IllegalTransition`` unless ``current -> target`` is in ``ALLOWED``."""
    if target not in ALLOWED[current]:
        raise IllegalTransition(job_id, current, target)
