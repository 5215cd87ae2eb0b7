"""The /metrics body in Prometheus text exposition format, written by hand (no extra dependency)."""

from __future__ import annotations

from jobs.events import StepEvent

from .scheduler import Scheduler
from .status import JobStatus
from .store import JobStore

# (metric, field of the latest StepEvent, help)
_JOB_GAUGES = (
    ("ferry_job_step", "step", "Latest step of a running job."),
    ("ferry_job_loss", "loss", "Latest training loss of a running job."),
    ("ferry_job_samples_per_second", "samples_per_s", "Training throughput of a running job."),
    ("ferry_job_device_peak_bytes", "device_peak_bytes", "Peak device memory of a running job."),
    ("ferry_job_pinned_bytes", "pinned_bytes", "Pinned host memory held by a running job."),
)


def render_metrics(store: JobStore, scheduler: Scheduler) -> str:
    lines = ["# HELP ferry_jobs Jobs in the store by status.", "# TYPE ferry_jobs gauge"]
    for status, count in store.count_by_status().items():
        lines.append(f'ferry_jobs{{status="{status.value}"}} {count}')
    busy = len(scheduler.running)
    lines += [
        "# HELP ferry_workers Worker slots by state.",
        "# TYPE ferry_workers gauge",
        f'ferry_workers{{state="busy"}} {busy}',
        f'ferry_workers{{state="idle"}} {len(scheduler.slots) - busy}',
    ]
    running = store.jobs_with_status(JobStatus.RUNNING)
    latest = {job.id: _latest_step(job.progress) for job in running}
    for metric, key, help_text in _JOB_GAUGES:
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
        for job in running:
            value = getattr(latest[job.id], key, None)
            if isinstance(value, (int, float)):
                lines.append(f'{metric}{{job_id="{job.id}",worker="{job.worker}"}} {value}')
    lines += [
        "# HELP ferry_job_eval_loss Latest eval loss of a running job (jobs with an eval section).",
        "# TYPE ferry_job_eval_loss gauge",
    ]
    for job in running:
        evals = store.list_events(job.id, limit=100_000, types=["eval"])
        if evals:
            lines.append(
                f'ferry_job_eval_loss{{job_id="{job.id}",worker="{job.worker}"}} {evals[-1].data["eval_loss"]}'
            )
    return "\n".join(lines) + "\n"


def _latest_step(progress: dict | None) -> StepEvent | None:
    """The job's latest step event, typed (the store adds when it arrived, which the event does not declare)."""
    if not progress:
        return None
    return StepEvent.model_validate({k: v for k, v in progress.items() if k != "reported_at"})
